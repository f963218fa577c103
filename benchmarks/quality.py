"""Quality benchmark: the demo's eval artifact as one JSON of per-decoder numbers and AUP per family.

    python benchmarks/quality.py [--config configs/demo.yaml] [--store ./a2d-store]

Reads the eval artifact that `make demo` produced (it runs nothing when that artifact is missing:
run `make demo` first). Writes benchmarks/results/quality.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = (
    "tpf",
    "tokens_per_s",
    "token_agreement",
    "exact_match",
    "answer_accuracy",
    "repetition_rate",
    "mean_accepted",
    "mismatches_vs_reference",
    "samples",
    "ci95",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    from a2d.stores.readers import read_metrics
    from benchmarks.common import built, write_result

    _, refs, store = built(args.config, args.store, "eval")
    doc = read_metrics(store, refs["eval"])
    write_result(
        "quality",
        {
            "config": Path(args.config).name,
            "eval_key": refs["eval"].key,
            "decoders": {
                name: {k: s.get(k) for k in FIELDS} if "tpf" in s else s
                for name, s in doc["decoders"].items()
            },
            "aup": doc["aup"],
            "aup_metric": doc["aup_metric"],
            "aup_metric_reason": doc.get("aup_metric_reason"),
            "counting": doc.get("counting"),
        },
    )


if __name__ == "__main__":
    main()
