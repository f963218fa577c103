"""vfm stage: the noise adapter trained against the frozen diffusion student (a2d.tasks.train); its key,
its objective from what it reads, and the published adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from prefect import task

from a2d.models.objectives.vfm import VFMObjective
from a2d.specs import TrainOptions, VFMSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import read_responses
from a2d.tasks.head import trained_on
from a2d.tasks.students import FLOW_MAP_LORA, VFM_SHARD, load_student
from a2d.tasks.train import TrainJob
from a2d.tasks.train import train as train_in_process
from a2d.tasks.training import run_trainer, stage_job

STAGE = "vfm"
SHARD = VFM_SHARD
FORMAT_VERSION = 1


def key_inputs(spec: VFMSpec, head_key: str, responses_key: str) -> KeyInputs:
    """The vfm key: the VFM spec, the head it distils and the responses it trains on."""
    return KeyInputs(
        STAGE, FORMAT_VERSION, spec.model_dump(mode="json"), {"head": head_key, "responses": responses_key}
    )


def objective(store: ArtifactStore, job: TrainJob, device: torch.device, precision: str) -> VFMObjective:
    """The VFM's objective from what it reads: the head's trained student and the training responses."""
    student, dspec = load_student(store, job.inputs["head"], str(device))
    rows = sorted(
        (r for r in read_responses(store, job.inputs["responses"]).to_pylist() if r["split"] == "train"),
        key=lambda r: r["sample_id"],
    )
    return VFMObjective(job.spec, student, dspec, rows, str(device), precision)


def train_vfm(
    store: ArtifactStore,
    head: ArtifactRef,
    responses: ArtifactRef,
    spec: VFMSpec,
    train: TrainOptions,
    work: Path,
    device: str = "cpu",
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train q_φ in this process (tests); checkpoints under `work/checkpoints`."""
    job = TrainJob(
        store_uri=store.root.uri,
        ref=store.ref(STAGE, key_inputs(spec, head.key, responses.key).key),
        inputs={"head": head, "responses": responses},
        spec=spec,
        train=train,
        device=device,
        workdir=str(work),
        stop_after=stop_after,
    )
    return train_in_process(job)


@task(name="vfm-train", task_run_name="vfm-{ref.key}", tags=["gpu"])
def vfm_train(
    store_uri: str,
    ref: ArtifactRef,
    spec: VFMSpec,
    train: TrainOptions,
    head: ArtifactRef,
    responses: ArtifactRef,
    device: str,
) -> dict:
    store = ArtifactStore(store_uri)
    job = stage_job(store, ref, {"head": head, "responses": responses}, spec, train, device)
    result, last = run_trainer(store, job)
    with store.shard_output(ref, SHARD) as out:
        shutil.copytree(last / "adapter", out)
        if spec.tune_lora:
            shutil.copy(last / "extras.safetensors", out / FLOW_MAP_LORA)
        (out / "vfm_spec.json").write_text(
            json.dumps({**spec.model_dump(mode="json"), "head_key": head.key}, indent=2, sort_keys=True)
        )
        files = {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}
    hist = result["history"]
    rows, tokens = trained_on(store, responses)
    stats = {
        "rows": rows,  # the training responses the flow map learned from
        "tokens": tokens,
        "first_ce": hist[0]["ce"] if hist else None,
        "final_ce": hist[-1]["ce"] if hist else None,
        "history": hist[-50:],
    }
    return store.write_marker(ref, SHARD, files, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    m = markers[SHARD]
    return {"first_ce": m["first_ce"], "final_ce": m["final_ce"]}
