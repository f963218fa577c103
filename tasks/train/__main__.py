"""`python -m a2d.tasks.train JOB.json`: one training process (one rank under `accelerate launch`)."""

import sys

from a2d.tasks.train.process import main

if __name__ == "__main__":
    sys.exit(main())
