"""head stage: launch diffusion-head training in its own process(es), stream its logs, publish the adapter."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import task
from tqdm import tqdm

from a2d.models.student import DiffusionSpec
from a2d.models.teacher import resolve_device
from a2d.specs import HeadSpec, TeacherSpec, TrainOptions
from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.interrupt import Stopped, on_sigterm, stop_requested
from a2d.tasks.report import Progress
from a2d.tasks.runtime import logger
from a2d.tasks.students import HEAD_SHARD
from a2d.tasks.tracking import publish_link
from a2d.tasks.train_head import TrainJob
from a2d.tasks.training import restore_checkpoints, workdir

STAGE = "head"
# Library warnings the trainer's stderr carries (transformers FutureWarnings, bitsandbytes notes, the
# `warnings.warn(` source line that follows each): noise in a run's log, still on the process's stderr.
THIRD_PARTY_NOISE = re.compile(
    r"(Warning: |^\s*warnings\.warn\(|site-packages/|bitsandbytes|`kernels`|UserWarning|DeprecationWarning)"
)
SHARD = HEAD_SHARD
FORMAT_VERSION = 2  # 2: decode-state views, block attention from the response start, adapter scope


def key_inputs(spec: HeadSpec, teacher_key: str, anchors_key: str, trajectories_key: str) -> KeyInputs:
    """The head key: the whole training spec and the teacher, anchors and trajectories it learns from."""
    upstream = {"teacher": teacher_key, "anchors": anchors_key, "trajectories": trajectories_key}
    return KeyInputs(STAGE, FORMAT_VERSION, spec.model_dump(mode="json"), upstream)


def launch_command(job_path: Path, train: TrainOptions) -> list[str]:
    """`python -m a2d.tasks.train_head` for one process; `accelerate launch` for several."""
    if train.num_processes * train.num_machines == 1:
        return [sys.executable, "-m", "a2d.tasks.train_head", str(job_path)]
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
    return [*cmd, "-m", "a2d.tasks.train_head", str(job_path)]


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
    if stop_requested():  # SIGTERM came while this task was getting ready: start nothing
        raise Stopped("head training was not started: SIGTERM arrived first; rerun the head stage to resume")
    # The trainer is the installed `a2d.tasks.train_head`, run in this process's working directory;
    # the job names the store by its absolute URI, so a relative store cannot resolve elsewhere.
    proc = subprocess.Popen(
        launch_command(job_path, job.train),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    logger().info("head training process %d started: %s", proc.pid, job_path)
    # SIGTERM to this process (pod eviction, Prefect cancellation) is passed on, so the trainer
    # saves a checkpoint at the end of its current step before everything exits. The flow's main
    # thread receives it (run_sharded forwards it here, to this task's worker thread).
    bar = tqdm(total=job.spec.steps, desc=f"head {job.head.key}", leave=False)
    with on_sigterm(lambda: proc.send_signal(signal.SIGTERM)) as forwarded, bar:
        if not forwarded:
            logger().warning("SIGTERM cannot reach this task (no forwarding on the main thread)")
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
            if kind == "wandb":
                publish_link("head", fields.get("url"))
            log.info("train %s %s", kind, payload)
        elif line and "Loading weights" not in line:
            if THIRD_PARTY_NOISE.search(line):  # kept on the process's stderr, not in the run's log
                sys.stderr.write(f"train | {line}\n")  # not print(): log_prints would relay it
            else:
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
        store_uri=store.root.uri,
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
    if last is None or checkpoints.step_of(last) != spec.steps:
        raise RuntimeError(
            f"head training ended without a verified checkpoint of step {spec.steps} "
            f"(newest: {last.name if last else 'none'}); rerun the head stage to resume"
        )
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
