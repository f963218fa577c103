"""Trajectories benchmark: stored bytes per sample vs d3LLM's full-snapshot JSON of the same trajectories.

    python benchmarks/trajectories.py [--samples 48] [--max-new-tokens 256]

Runs the real pipeline (teacher → … → trajectories) on a small random llama teacher in a temporary
store, with d3LLM's teacher setting (one token committed per step in blocks of 32), then compares
the Parquet bytes with the JSON d3LLM would write. Writes benchmarks/results/trajectories.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from a2d.models.trajectory import snapshot_json_bytes  # noqa: E402
from a2d.specs import load_config  # noqa: E402
from a2d.stores.artifacts import ArtifactStore  # noqa: E402
from a2d.stores.readers import read_trajectories  # noqa: E402
from benchmarks.common import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    args = ap.parse_args()
    from a2d.flows.cli import prefect_session
    from a2d.flows.pipeline import pipeline

    store = tempfile.mkdtemp(prefix="a2d-bench-traj-")
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"store={store}",
            "teacher.architecture=llama",
            "teacher.layers=2",
            f"prompts.bundled_rows={args.samples}",
            "prompts.rows_per_shard=16",
            f"responses.max_new_tokens={args.max_new_tokens}",
            "anchors.layers=[0]",
            f"trajectories.block_size={args.block}",
            f"trajectories.steps_per_block={args.block}",
        ],
    )
    with prefect_session():  # the CLI's Prefect settings: its temporary server's startup timeout
        refs = pipeline(cfg, until="trajectories")
    st = ArtifactStore(store)
    manifest = st.manifest(refs["trajectories"])
    stored = manifest["bytes"]
    recs = read_trajectories(st, refs["trajectories"])
    mask_id = 256  # any id: JSON size depends on its digits; a 3-digit id like the byte vocabulary's
    snap = sum(
        snapshot_json_bytes(r["response_ids"], r["unmask_step"], mask_id, r["prompt_ids"])
        for r in recs.values()
    )
    lengths = [len(r["response_ids"]) for r in recs.values()]
    write_result(
        "trajectories",
        {
            "samples": len(recs),
            "mean_response_length": round(float(np.mean(lengths)), 1),
            "mean_steps": manifest["metrics"]["mean_steps"],
            "block_size": args.block,
            "stored_bytes_per_sample": round(stored / len(recs), 1),
            "snapshot_json_bytes_per_sample": round(snap / len(recs), 1),
            "bytes_ratio_vs_snapshot_json": round(stored / snap, 5),
            "target": "<= 0.01",
        },
    )


if __name__ == "__main__":
    main()
