"""Readers of complete stage artifacts: what a downstream stage, the CLI or a benchmark reads back.

Each refuses a partial artifact (through `ArtifactStore.manifest`) with a message saying how to
finish it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.stores.parquet import read_shard

EVAL_SHARD = "report"  # the eval artifact's one shard: metrics.json, report.md, the plot


def _table(store: ArtifactStore, ref: ArtifactRef, shards: list[str] | None = None) -> pa.Table:
    names = shards if shards is not None else list(store.manifest(ref)["shards"])
    loc = store.loc(ref)
    with store.reading(ref, names):
        return pa.concat_tables([read_shard(loc, f"{s}.parquet") for s in names])


def read_prompts(store: ArtifactStore, ref: ArtifactRef, split: str | None = None) -> pa.Table:
    """All prompt rows of a complete prompts artifact, optionally one split."""
    table = _table(store, ref)
    return table if split is None else table.filter(pc.equal(table["split"], split))


def read_responses(store: ArtifactStore, ref: ArtifactRef, shard: str | None = None) -> pa.Table:
    """All rows (or one shard's) of a complete responses artifact."""
    store.manifest(ref)
    return _table(store, ref, [shard] if shard else None)


def read_held_out(store: ArtifactStore, ref: ArtifactRef) -> list[dict[str, Any]]:
    """The held-out (split "eval") rows of a complete responses artifact, in stored order."""
    return [r for r in read_responses(store, ref).to_pylist() if r["split"] == "eval"]


def read_trajectories(store: ArtifactStore, ref: ArtifactRef) -> dict[str, dict[str, Any]]:
    """All records of a complete trajectories artifact keyed by sample id (numpy arrays inside)."""
    out = {}
    for rec in _table(store, ref).to_pylist():
        rec["response_ids"] = np.asarray(rec["response_ids"], dtype=np.int64)
        rec["prompt_ids"] = np.asarray(rec["prompt_ids"], dtype=np.int64)
        rec["unmask_step"] = np.asarray(rec["unmask_step"], dtype=np.int16)
        out[rec["sample_id"]] = rec
    return out


def check_same_responses(
    store: ArtifactStore,
    trajectories: ArtifactRef,
    records: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
) -> None:
    """Refuse trajectory records whose response tokens differ from the response rows they are paired with."""
    for row in rows:
        rec = records.get(row["sample_id"])
        if rec is not None and rec["response_ids"].tolist() != list(row["response_ids"]):
            uri = store.loc(trajectories).uri
            raise ValueError(
                f"trajectories at {uri} hold other response tokens for sample {row['sample_id']!r} than the "
                f"responses it is trained with: they were made from other rows; delete {uri} and rerun"
            )


def read_metrics(store: ArtifactStore, ref: ArtifactRef) -> dict[str, Any]:
    """The metrics document of a complete eval artifact."""
    store.manifest(ref)
    return json.loads(store.loc(ref).read_bytes(f"{EVAL_SHARD}/metrics.json"))
