"""The training loop every stage shares: setup, resume, one optimizer step over every process,
tracking, progress, held-out marks, checkpoints and SIGTERM (torchtitan's Trainer, in small).

An objective (`a2d.models.objectives`) draws each step's batch from (seed, step, micro-batch), so a
step does not depend on how many processes share it; the checkpoint holds the weights, optimizer,
scheduler, RNG, step and data cursor, so a resumed run reproduces the uninterrupted one. SIGTERM
checkpoints the current step and stops, on every process at the same step.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from a2d.models.objectives import Objective
from a2d.models.teacher import resolve_precision
from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.interrupt import StopFlag, on_sigterm
from a2d.tasks.tracking import Tracker
from a2d.tasks.train.job import TrainJob, emit


@dataclass
class Run:
    """What every step of one training process uses: built once by `setup`."""

    job: TrainJob
    accelerator: Any
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    precision: str
    ckpt_root: Path
    remote: Any

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


def setup(job: TrainJob) -> Run:
    """The objective (built by the stage's module from what it reads), optimizer and scheduler of one
    process; nothing has trained yet."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=job.device == "cpu")
    torch.manual_seed(job.spec.seed)
    store = ArtifactStore(job.store_uri)
    precision = resolve_precision(job.train.mixed_precision, accelerator.device)
    stage = importlib.import_module(f"a2d.tasks.{job.stage}")  # its `objective` is the stage's wiring
    objective = stage.objective(store, job, accelerator.device, precision)
    optimizer = objective.optimizer()
    # Nothing goes through accelerator.prepare: the models' forwards are not their modules' own calls
    # (DDP's hooks would not fire), so gradients are averaged explicitly in `train_step`, and a
    # prepared scheduler would step once per process.
    return Run(
        job=job,
        accelerator=accelerator,
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, objective.schedule()),
        precision=precision,
        ckpt_root=Path(job.workdir) / "checkpoints",
        remote=checkpoints.remote_root(store, job.ref),
    )


def resume(run: Run) -> int:
    """Load the newest checkpoint into the run, if any; the step to continue from."""
    last = checkpoints.latest(run.ckpt_root)
    if last is None:
        return 0
    state, extras = checkpoints.load(last, run.optimizer, run.scheduler)
    run.objective.load(last, state, extras)
    emit("resume", step=state["step"], checkpoint=last.name)
    return state["step"]


def train_step(run: Run, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One optimizer step over the step's batch on every rank; (history row, tracker-only figures)."""
    objective = run.objective
    stats = objective.forward_backward(step, run.rank, run.world)
    params = objective.parameters()
    if run.world > 1:  # the mean over ranks, as DDP computes it
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)  # SUM: gloo has no AVG
                p.grad.div_(run.world)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, objective.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return objective.record(stats, run.scheduler.get_last_lr()[0], float(grad_norm))


def save_checkpoint(run: Run, step: int) -> None:
    """Rank 0 writes (and mirrors) the checkpoint of `step`; every rank waits for it."""
    if run.rank == 0:
        saved = run.objective.saved(step, run.world)
        checkpoints.publish(
            run.ckpt_root,
            step,
            run.job.train.keep_checkpoints,
            saved.model,
            saved.extras,
            run.optimizer,
            run.scheduler,
            saved.cursor,
            saved.info,
            remote=run.remote,
        )
        emit("checkpoint", step=step)
    run.accelerator.wait_for_everyone()


def stop_everywhere(run: Run, stop: StopFlag) -> bool:
    """Whether any rank was asked to stop: every rank stops at the same step, or the others would wait forever."""
    if run.world > 1:
        flag = torch.tensor([float(stop.set)], device=run.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        stop.set = bool(flag.item())
    return stop.set


def tracker_of(run: Run) -> Tracker:
    """The run's W&B tracker (rank 0's; a no-op elsewhere): spec, run options and the objective's own."""
    job = run.job
    config = {
        job.stage: job.spec.model_dump(mode="json"),
        "train": job.train.model_dump(mode="json"),
        **run.objective.tracked(),
    }
    project = job.train.wandb_project if run.rank == 0 else None
    return Tracker(project, job.stage, job.ref.key, config, Path(job.workdir))


def train(job: TrainJob) -> dict[str, Any]:
    """Train to `spec.steps` (resuming from the newest checkpoint); SIGTERM checkpoints and stops."""
    spec, opts = job.spec, job.train
    run = setup(job)
    step = resume(run)
    stop = StopFlag()
    tracker = tracker_of(run)
    if tracker.url:
        emit("wandb", url=tracker.url)
    tracker.publish_link()  # in a flow run (a training in the task's own process)
    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    with on_sigterm(stop), tracker:
        while step < spec.steps:
            row, tracked = train_step(run, step)
            step += 1
            stopping = stop_everywhere(run, stop) or step == job.stop_after
            history.append({"step": step, **row})
            tracker.log({**history[-1], **tracked}, step)
            if run.rank == 0 and (step % opts.log_every == 0 or step == spec.steps):
                emit("progress", total=spec.steps, **{**history[-1], "lr": run.scheduler.get_last_lr()[0]})
            mark = run.objective.held_out(step) if run.rank == 0 else None
            if mark is not None:
                emit("heldout", **mark)
            if step % opts.checkpoint_every == 0 or step == spec.steps or stopping:
                save_checkpoint(run, step)
            if stopping:
                if stop.set:
                    emit("stopped", step=step)
                break
    return {
        "step": step,
        "stopped": stop.set,
        "history": history,
        "train_seconds": round(time.perf_counter() - started, 3),
        **run.objective.summary(),
    }
