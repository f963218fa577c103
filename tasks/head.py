"""head stage: launch diffusion-head training in its own process(es), stream its logs, publish the adapter."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import task
from tqdm import tqdm

from flows.config import HeadSpec, LoadSpec, TeacherSpec, TrainOptions
from models.teacher import resolve_device
from stores import checkpoints
from stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from stores.keys import artifact_key
from stores.uri import Location
from tasks.concurrency import gpu_slot
from tasks.interrupt import Stopped, on_sigterm
from tasks.report import Progress, in_prefect_run
from tasks.stage import logger
from tasks.train_head import TrainJob

STAGE = "head"
FORMAT_VERSION = 1
SHARD = "adapter"


def key_for(spec: HeadSpec, teacher_key: str, anchors_key: str, trajectories_key: str) -> str:
    return artifact_key(
        STAGE,
        FORMAT_VERSION,
        spec,
        {"teacher": teacher_key, "anchors": anchors_key, "trajectories": trajectories_key},
    )


def workdir(store: ArtifactStore, ref: ArtifactRef) -> Path:
    """Where checkpoints live: inside the artifact on local disk, else in the local cache."""
    loc = store.loc(ref)
    if loc.is_local:
        return loc.local_path()
    from tasks.teacher import cache_root

    return cache_root() / "work" / ref.stage / ref.key


def restore_checkpoints(store: ArtifactStore, ref: ArtifactRef, work: Path) -> Location | None:
    """On a remote store, bring the newest checkpoint mirrored there into `work/checkpoints` (a retry
    on another machine resumes from it) and return where checkpoints are mirrored; None on local disk."""
    remote = checkpoints.remote_root(store, ref)
    if remote is not None:
        found = checkpoints.restore(remote, work / "checkpoints")
        if found is not None:
            logger().info("%s %s resumes from checkpoint %s", ref.stage, ref.key, found.name)
    return remote


def launch_command(job_path: Path, train: TrainOptions) -> list[str]:
    """`python -m tasks.train_head` for one process; `accelerate launch` for several."""
    if train.num_processes * train.num_machines == 1:
        return [sys.executable, "-m", "tasks.train_head", str(job_path)]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        str(train.num_processes * train.num_machines),
        "--num_machines",
        str(train.num_machines),
    ]
    # --multi_gpu is accelerate's multi-process mode: NCCL on GPUs; without GPUs it runs MULTI_CPU
    # with gloo (its --cpu flag would start a single process).
    cmd.append("--multi_gpu")
    return [*cmd, "-m", "tasks.train_head", str(job_path)]


def parse_event(line: str) -> tuple[str, str, dict[str, Any]] | None:
    """An `A2D kind {json}` line from the training process, or None for any other line.

    A line that looks like an event but does not parse (a foreign process wrote into the middle of
    it) is logged as plain output rather than failing a run that is training fine.
    """
    if not line.startswith("A2D "):
        return None
    kind, _, payload = line[4:].partition(" ")
    try:
        fields = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return (kind, payload, fields) if isinstance(fields, dict) else None


def run_training(job: TrainJob, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the training process to the end, streaming its lines into the logs; raises on failure
    (`Stopped` when SIGTERM stopped it after a checkpoint)."""
    work = Path(job.workdir)
    work.mkdir(parents=True, exist_ok=True)
    job_path = work / "job.json"
    job_path.write_text(job.model_dump_json(indent=2))
    (work / "result.json").unlink(missing_ok=True)  # written by the trainer when it ends
    progress = Progress(job.spec.steps, f"head {job.head.key}")
    root = Path(__file__).resolve().parents[1]
    full_env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        launch_command(job_path, job.train),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=str(root),
    )
    assert proc.stdout is not None
    # SIGTERM to this process (pod eviction, Prefect cancellation) is passed on, so the trainer
    # saves a checkpoint at the end of its current step before everything exits.
    bar = tqdm(total=job.spec.steps, desc=f"head {job.head.key}", leave=False)
    with on_sigterm(lambda: proc.send_signal(signal.SIGTERM)), bar:
        code = _stream(proc, progress, bar)
    done = work / "result.json"
    result = json.loads(done.read_text()) if done.is_file() else None
    if result is None or (code != 0 and not result["stopped"]):
        raise RuntimeError(
            f"head training exited with code {code}; rerun the head stage to resume from the last checkpoint"
        )
    # after SIGTERM torchrun exits non-zero even though every rank checkpointed and stopped cleanly
    if result["stopped"] and job.stop_after is None:
        raise Stopped(
            f"head training stopped by SIGTERM at step {result['step']} after saving a checkpoint; "
            "rerun the head stage to resume"
        )
    return result


def _stream(proc: subprocess.Popen, progress: Progress, bar: tqdm) -> int:
    """Forward the trainer's lines into the logs (events parsed) until it exits; its exit code."""
    log = logger()
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        event = parse_event(line)
        if event is not None:
            kind, payload, fields = event
            if kind in ("progress", "resume"):
                bar.update(fields["step"] - bar.n)
                progress.advance(fields["step"] - progress.done)
            if kind == "wandb" and fields.get("url") and in_prefect_run():
                from prefect.artifacts import create_link_artifact

                create_link_artifact(key="a2d-head-wandb", link=fields["url"], description="W&B run")
            log.info("train %s %s", kind, payload)
        elif line and "Loading weights" not in line:
            log.info("train | %s", line)
    return proc.wait()


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
    work = workdir(store, ref)
    job = TrainJob(
        store=store_uri,
        head=ref,
        teacher=teacher,
        teacher_spec=teacher_spec,
        responses=responses,
        anchors=anchors,
        trajectories=trajectories,
        spec=spec,
        train=train,
        device=str(resolve_device(device)),
        workdir=str(work),
    )
    restore_checkpoints(store, ref, work)  # the trainer mirrors new ones itself
    with gpu_slot():
        result = run_training(job)
    last = checkpoints.latest(work / "checkpoints")
    if last is None or json.loads((last / checkpoints.STATE).read_text())["step"] != spec.steps:
        raise RuntimeError("training finished without a final checkpoint")
    info = result.get("student", {})
    diffusion_spec = {
        "mask_id": info["mask_id"],
        "attention": spec.attention,
        "linear_attention": spec.linear_attention if info["linear_attention_layers"] else "n/a",
        "linear_attention_layers": info["linear_attention_layers"],
        "logit_alignment": spec.logit_alignment,
        "block_size": spec.block_size,
        "teacher_key": teacher.key,
        "quantization": info["quantization"],
        "quantization_fallback": info.get("fallback"),
        "lora_modules": info["lora_modules"],
        "lora_targets": info["target_names"],
        "steps": spec.steps,
    }
    with store.shard_output(ref, SHARD) as out:
        shutil.copytree(last / "adapter", out)
        shutil.copy(last / "extras.safetensors", out / "extras.safetensors")
        (out / "diffusion_spec.json").write_text(json.dumps(diffusion_spec, indent=2, sort_keys=True))
        files = {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}
    history = result["history"]
    stats = {
        "rows": 0,
        "tokens": 0,
        "diffusion_spec": diffusion_spec,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "precision": result.get("precision"),
        "history": history[-50:],
    }
    return store.write_marker(ref, SHARD, files, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    m = markers[SHARD]
    return {
        "diffusion_spec": m["diffusion_spec"],
        "first_loss": m["first_loss"],
        "final_loss": m["final_loss"],
    }


def load_student(store: ArtifactStore, ref: ArtifactRef, device: str = "cpu", load: LoadSpec | None = None):
    """The trained student of a complete head artifact, ready for decoding."""
    from safetensors.torch import load_file

    from models.student import build_student
    from tasks import teacher as teacher_stage

    manifest = store.manifest(ref)
    dspec = manifest["metrics"]["diffusion_spec"]
    spec = HeadSpec.model_validate(manifest["spec"])
    teacher_ref = store.ref("teacher", manifest["upstream"]["teacher"])
    adapter = store.local_copy(ref, SHARD, teacher_stage.cache_root())
    student = build_student(
        teacher_stage.local_dir(store, teacher_ref),
        spec.quantization,
        spec.dtype,
        device,
        {"rank": spec.lora_rank, "alpha": spec.lora_alpha, "dropout": 0.0, "rslora": spec.rslora},
        spec.attention,
        spec.linear_attention,
        spec.block_size,
        adapter_dir=adapter,
    )
    student.load_extras(load_file(adapter / "extras.safetensors"))
    student.model.eval()
    return student, dspec
