"""head stage: the diffusion head's key, its objective from what it reads, and the published adapter
(the training runs in its own process(es), a2d.tasks.train)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import torch
from prefect import task

from a2d.models.generate import eos_ids
from a2d.models.objectives.head import HeadObjective
from a2d.models.student import DiffusionSpec
from a2d.specs import HeadSpec, TeacherSpec, TrainOptions
from a2d.stores.anchors import AnchorReader
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import check_same_responses, read_responses, read_trajectories
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.students import HEAD_SHARD, head_student
from a2d.tasks.train import TrainJob
from a2d.tasks.training import run_trainer, stage_job

STAGE = "head"
SHARD = HEAD_SHARD
FORMAT_VERSION = 2  # 2: decode-state views, block attention from the response start, adapter scope


def key_inputs(spec: HeadSpec, teacher_key: str, anchors_key: str, trajectories_key: str) -> KeyInputs:
    """The head key: the whole training spec and the teacher, anchors and trajectories it learns from."""
    upstream = {"teacher": teacher_key, "anchors": anchors_key, "trajectories": trajectories_key}
    return KeyInputs(STAGE, FORMAT_VERSION, spec.model_dump(mode="json"), upstream)


def objective(store: ArtifactStore, job: TrainJob, device: torch.device, precision: str) -> HeadObjective:
    """The head's objective from what it reads: the student on the teacher, the anchors (checked against
    the teacher and responses), the training responses and their trajectories."""
    spec, inputs = job.spec, job.inputs
    student = head_student(
        teacher_stage.local_dir(store, inputs["teacher"]),
        spec,
        str(device),
        job.teacher_spec.trust_remote_code,
        gradient_checkpointing=job.train.gradient_checkpointing,
    )
    reader = AnchorReader(store, inputs["anchors"])
    reader.check(teacher_key=inputs["teacher"].key, capture="residual")
    reader.check_responses(store, inputs["responses"])
    table = read_responses(store, inputs["responses"])
    samples = sorted((r for r in table.to_pylist() if r["split"] == "train"), key=lambda r: r["sample_id"])
    if not samples:
        raise ValueError(
            "no training samples: every prompt is in the eval split; lower prompts.eval_fraction"
        )
    trajs = read_trajectories(store, inputs["trajectories"])
    check_same_responses(store, inputs["trajectories"], trajs, samples)
    eos = eos_ids(student.inner, student.tok)
    token_ids = {
        "mask": student.info.mask_id,
        "pad": student.tok.pad_token_id,
        "eos": eos[0],
        "eos_set": set(eos),
    }
    return HeadObjective(spec, student, reader, samples, trajs, token_ids, device, precision)


@task(name="head-train", task_run_name="head-{ref.key}", tags=["gpu"])
def head_train(
    store_uri: str,
    ref: ArtifactRef,
    spec: HeadSpec,
    train: TrainOptions,
    teacher: ArtifactRef,
    teacher_spec: TeacherSpec,
    responses: ArtifactRef,
    anchors: ArtifactRef,
    trajectories: ArtifactRef,
    device: str,
) -> dict:
    """Train (resuming from the last checkpoint), then publish adapter + extras + diffusion_spec.json."""
    store = ArtifactStore(store_uri)
    inputs = {"teacher": teacher, "responses": responses, "anchors": anchors, "trajectories": trajectories}
    job = stage_job(store, ref, inputs, spec, train, device, teacher_spec)
    result, last = run_trainer(store, job)
    info = result.get("student", {})
    diffusion_spec = DiffusionSpec(
        mask_id=info["mask_id"],
        attention=spec.attention,
        adapter_scope=spec.adapter_scope,
        linear_attention=spec.linear_attention if info["linear_attention_layers"] else "n/a",
        linear_attention_layers=info["linear_attention_layers"],
        logit_alignment=spec.logit_alignment,
        block_size=spec.block_size,
        teacher_key=teacher.key,
        quantization=info["quantization"],
        quantization_fallback=info.get("fallback"),
        lora_modules=info["lora_modules"],
        lora_targets=tuple(info["target_names"]),
        steps=spec.steps,
    ).to_json()
    with store.shard_output(ref, SHARD) as out:
        shutil.copytree(last / "adapter", out)
        shutil.copy(last / "extras.safetensors", out / "extras.safetensors")
        (out / "diffusion_spec.json").write_text(json.dumps(diffusion_spec, indent=2, sort_keys=True))
        files = {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}
    history = result["history"]
    rows, tokens = trained_on(store, responses)
    stats = {
        "rows": rows,  # the training responses the head learned from
        "tokens": tokens,
        "diffusion_spec": diffusion_spec,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "precision": result.get("precision"),
        "history": history[-50:],
    }
    return store.write_marker(ref, SHARD, files, stats)


def trained_on(store: ArtifactStore, responses: ArtifactRef) -> tuple[int, int]:
    """(rows, response tokens) of the training split a model stage learned from (its table's figures)."""
    from a2d.stores.readers import read_responses

    train = [r for r in read_responses(store, responses).to_pylist() if r["split"] == "train"]
    return len(train), sum(len(r["response_ids"]) for r in train)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    m = markers[SHARD]
    return {
        "diffusion_spec": m["diffusion_spec"],
        "first_loss": m["first_loss"],
        "final_loss": m["final_loss"],
    }
