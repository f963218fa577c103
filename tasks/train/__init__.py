"""One trainer for the head, the VFM and the drafter: a process of its own (or several, through
`accelerate launch`), driven by a JSON job; the models differ only through their objective
(`a2d.models.objectives`), which each stage's module builds (`objective(store, job, device, precision)`).

    python -m a2d.tasks.train JOB.json
"""

from a2d.tasks.train.job import TrainJob, emit
from a2d.tasks.train.loop import train
from a2d.tasks.train.process import launch_command, run_training

__all__ = ["TrainJob", "emit", "launch_command", "run_training", "train"]
