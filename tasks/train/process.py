"""Training as a process of its own: the command that starts one (or several, `accelerate launch`),
the task side that streams its lines into the run's logs, and the process's own entry point."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from a2d.specs import TrainOptions
from a2d.tasks.interrupt import Stopped, on_sigterm, stop_requested
from a2d.tasks.report import Progress
from a2d.tasks.runtime import logger
from a2d.tasks.tracking import publish_link
from a2d.tasks.train.job import TrainJob, emit
from a2d.tasks.train.loop import train

# Library warnings the trainer's stderr carries (transformers FutureWarnings, bitsandbytes notes, the
# `warnings.warn(` source line that follows each): noise in a run's log, still on the process's stderr.
THIRD_PARTY_NOISE = re.compile(
    r"(Warning: |^\s*warnings\.warn\(|site-packages/|bitsandbytes|`kernels`|UserWarning|DeprecationWarning)"
)


def launch_command(job_path: Path, train: TrainOptions) -> list[str]:
    """`python -m a2d.tasks.train` for one process; `accelerate launch` for several."""
    if train.num_processes * train.num_machines == 1:
        return [sys.executable, "-m", "a2d.tasks.train", str(job_path)]
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
    return [*cmd, "-m", "a2d.tasks.train", str(job_path)]


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
    stage = job.stage
    progress = Progress(job.spec.steps, f"{stage} {job.ref.key}")
    if stop_requested():  # SIGTERM came while this task was getting ready: start nothing
        raise Stopped(
            f"{stage} training was not started: SIGTERM arrived first; rerun the {stage} stage to resume"
        )
    # The trainer is the installed `a2d.tasks.train`, run in this process's working directory;
    # the job names the store by its absolute URI, so a relative store cannot resolve elsewhere.
    proc = subprocess.Popen(
        launch_command(job_path, job.train),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    logger().info("%s training process %d started: %s", stage, proc.pid, job_path)
    # SIGTERM to this process (pod eviction, Prefect cancellation) is passed on, so the trainer
    # saves a checkpoint at the end of its current step before everything exits. The flow's main
    # thread receives it (run_sharded forwards it here, to this task's worker thread).
    bar = tqdm(total=job.spec.steps, desc=f"{stage} {job.ref.key}", leave=False)
    with on_sigterm(lambda: proc.send_signal(signal.SIGTERM)) as forwarded, bar:
        if not forwarded:
            logger().warning("SIGTERM cannot reach this task (no forwarding on the main thread)")
        code = _stream(proc, stage, progress, bar)
    done = work / "result.json"
    result = json.loads(done.read_text()) if done.is_file() else None
    if result is None or (code != 0 and not result["stopped"]):
        raise RuntimeError(
            f"{stage} training exited with code {code}; rerun the {stage} stage to resume from the last checkpoint"
        )
    # after SIGTERM torchrun exits non-zero even though every rank checkpointed and stopped cleanly
    if result["stopped"] and job.stop_after is None:
        raise Stopped(
            f"{stage} training stopped by SIGTERM at step {result['step']} after saving a checkpoint; "
            f"rerun the {stage} stage to resume"
        )
    return result


def _stream(proc: subprocess.Popen, stage: str, progress: Progress, bar: tqdm) -> int:
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
                publish_link(stage, fields.get("url"))
            log.info("train %s %s", kind, payload)
        elif line and "Loading weights" not in line:
            if THIRD_PARTY_NOISE.search(line):  # kept on the process's stderr, not in the run's log
                sys.stderr.write(f"train | {line}\n")  # not print(): log_prints would relay it
            else:
                log.info("train | %s", line)
    return proc.wait()


def die_with_parent() -> None:
    """Linux: have the kernel send this process SIGTERM when the process that launched it dies.

    A task process killed outright (SIGKILL, OOM) cannot forward anything; the trainer then still
    checkpoints its current step and stops instead of running on as an orphan.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    argv = argv if argv is not None else sys.argv[1:]
    job = TrainJob.model_validate_json(Path(argv[0]).read_text())
    result = train(job)
    out = Path(job.workdir) / "result.json"
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result, indent=2, default=str))
    emit("done", step=result["step"], stopped=result["stopped"])
    return 0
