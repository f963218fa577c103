"""trajectories stage: d3LLM pseudo-trajectories as one int16 unmask step per response token."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from prefect import task

from a2d.models.block_decode import forced_commit_steps
from a2d.models.trajectory import confidence_trajectory
from a2d.specs import TrajectorySpec
from a2d.stores.anchors import AnchorReader
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.parquet import TOKENS, read_shard, write_shard
from a2d.tasks.students import load_student

STAGE = "trajectories"
FORMAT_VERSION = 1
SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_ids", TOKENS),
        ("response_ids", TOKENS),
        ("unmask_step", pa.list_(pa.int16())),
        ("num_steps", pa.int32()),
        ("block_size", pa.int32()),
        ("source", pa.string()),
    ]
)


def key_inputs(spec: TrajectorySpec, responses_key: str, anchors_key: str) -> KeyInputs:
    """The trajectories key: the decode settings of a source it does not use are left out."""
    data = spec.model_dump(mode="json")
    if spec.source == "teacher-confidence":
        data.pop("head_key")
        data.pop("threshold")
    return KeyInputs(STAGE, FORMAT_VERSION, data, {"responses": responses_key, "anchors": anchors_key})


def response_confidence(
    reader: AnchorReader, sample_id: str, prompt_len: int, response_len: int
) -> np.ndarray:
    """The teacher's confidence for each response token, in response order (NaN-free)."""
    sc = reader.scalars(sample_id)
    pos = sc["positions"].astype(np.int64)
    conf = sc["confidence"].astype(np.float64)
    keep = pos >= prompt_len
    pos, conf = pos[keep] - prompt_len, conf[keep]
    if len(pos) != response_len or not np.array_equal(pos, np.arange(response_len)):
        raise ValueError(
            f"anchors for sample {sample_id} cover {len(pos)} response tokens, the response has {response_len}: "
            "the anchors were made from other responses; rebuild them"
        )
    # A response token at position 0 (empty prompt) has no prediction: commit it last.
    return np.nan_to_num(conf, nan=0.0)


@task(name="trajectories-shard", task_run_name="trajectories-{shard}")
def trajectories_shard(
    store_uri: str,
    ref: ArtifactRef,
    shard: str,
    spec: TrajectorySpec,
    responses: ArtifactRef,
    anchors: ArtifactRef,
) -> dict:
    """Order each response's positions by teacher confidence, block by block; one Parquet shard."""
    store = ArtifactStore(store_uri)
    reader = AnchorReader(store, anchors)
    reader.check_responses(store, responses, [shard])  # the anchors describe exactly these rows
    rows = read_shard(store.loc(responses), f"{shard}.parquet").to_pylist()
    out: dict[str, list] = {f.name: [] for f in SCHEMA}
    student = None
    if spec.source == "diffusion-decode":
        student, dspec = load_student(store, store.ref("head", spec.head_key))
        if dspec.block_size != spec.block_size:
            raise ValueError(
                f"trajectories.block_size={spec.block_size} but head {spec.head_key} decodes blocks of "
                f"{dspec.block_size}: set trajectories.block_size={dspec.block_size}"
            )
    for r in rows:
        if student is not None:
            raw, _ = forced_commit_steps(
                student, r["prompt_ids"], r["response_ids"], spec.threshold, dspec.logit_alignment
            )
            steps = np.asarray(raw, dtype=np.int16)
        else:
            conf = response_confidence(reader, r["sample_id"], len(r["prompt_ids"]), len(r["response_ids"]))
            block = min(spec.block_size, max(len(conf), 1))
            steps, _ = confidence_trajectory(conf, block, min(spec.steps_per_block, block))
        out["sample_id"].append(r["sample_id"])
        out["prompt_ids"].append(r["prompt_ids"])
        out["response_ids"].append(r["response_ids"])
        out["unmask_step"].append(steps.tolist())
        out["num_steps"].append(int(steps.max()) if len(steps) else 0)
        out["block_size"].append(spec.block_size)
        out["source"].append(spec.source)
    name = f"{shard}.parquet"
    with store.shard_output(ref, name) as path:
        n = write_shard(path, out, SCHEMA)
        sha = hash_local_tree(path)[""]
    tokens = int(sum(len(x) for x in out["response_ids"]))
    stats = {"rows": n, "tokens": tokens, "steps": int(sum(out["num_steps"]))}
    return store.write_marker(ref, shard, {name: sha}, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    rows = sum(m["rows"] for m in markers.values())
    tokens = sum(m["tokens"] for m in markers.values())
    steps = sum(m["steps"] for m in markers.values())
    return {
        "samples": rows,
        "mean_steps": round(steps / max(rows, 1), 2),
        "mean_tokens_per_step": round(tokens / max(steps, 1), 3),
    }
