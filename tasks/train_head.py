"""Diffusion-head training: a process of its own (launched by the head task, or by `accelerate launch`).

    python -m a2d.tasks.train_head JOB.json

Every source of randomness is a function of (seed, step, global micro-batch index), the data order
of (seed, epoch), and the checkpoint holds adapter, extras, optimizer, scheduler, RNG, step and data
cursor: a resumed run reproduces the uninterrupted one. SIGTERM checkpoints and exits.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from a2d.models.capture import capture_layers
from a2d.models.losses import alignment_loss, masked_diffusion_loss
from a2d.models.student import Student, build_student, lm_head, student_hidden
from a2d.models.teacher import autocast, resolve_precision
from a2d.models.trajectory import ViewSampler
from a2d.specs import HeadSpec, TeacherSpec, TrainOptions
from a2d.stores import checkpoints
from a2d.stores.anchors import AnchorReader
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.stores.readers import check_same_responses, read_responses, read_trajectories
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.interrupt import StopFlag
from a2d.tasks.tracking import Tracker


class TrainJob(BaseModel):
    """Everything the training process needs, passed as JSON."""

    model_config = ConfigDict(extra="forbid")
    store_uri: str  # absolute: the training process resolves nothing relative
    head: ArtifactRef
    teacher: ArtifactRef
    teacher_spec: TeacherSpec
    responses: ArtifactRef
    anchors: ArtifactRef
    trajectories: ArtifactRef
    spec: HeadSpec
    train: TrainOptions
    device: str = "cpu"
    workdir: str
    stop_after: int | None = None  # for tests/debugging: exit cleanly after this step


def emit(kind: str, **fields: Any) -> None:
    """A structured line the parent task parses (progress, metrics, W&B link); rank 0 only.

    Every rank shares the parent's stdout pipe, so the line goes out in one write: a write under
    PIPE_BUF bytes is never interleaved with another process's output.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"A2D {kind} {json.dumps(fields, sort_keys=True)}\n".encode())


def lr_lambda(spec: HeadSpec):
    def f(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        if spec.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if spec.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return f


@functools.lru_cache(maxsize=4)
def sample_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, 7919])).permutation(n)


def micro_batch_indices(n: int, spec: HeadSpec, step: int, g: int, world: int) -> list[int]:
    """Sample indices of global micro-batch g at `step`; the data cursor is a function of (step, g)."""
    per_step = spec.grad_accum * world * spec.micro_batch_size
    start = step * per_step + g * spec.micro_batch_size
    out = []
    for c in range(start, start + spec.micro_batch_size):
        out.append(int(sample_order(n, spec.seed, c // n)[c % n]))
    return out


def make_batch(
    samples: list[dict],
    trajs: dict,
    spec: HeadSpec,
    sampler: ViewSampler,
    step: int,
    g: int,
    mask_id: int,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """Masked inputs for one micro-batch: (B, T) ids, targets, loss masks (+ complementary), t (B,)."""
    views = []
    for j, s in enumerate(samples):
        resp = np.asarray(s["response_ids"])[: max(1, spec.max_seq_len - len(s["prompt_ids"]))]
        p = len(s["prompt_ids"])
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step, 0, g, j]))
        if spec.mask_schedule == "trajectory":
            traj = trajs.get(s["sample_id"])
            if traj is not None and len(traj["response_ids"]) != len(resp):  # cut by max_seq_len
                traj = {
                    **traj,
                    "response_ids": traj["response_ids"][: len(resp)],
                    "unmask_step": traj["unmask_step"][: len(resp)],
                }
            v = sampler.view(step, 0, g, j, s["sample_id"], resp, traj)
            lo, hi = v.window
            window = np.zeros(len(resp), bool)
            window[lo:hi] = True
            masked, comp, t = v.masked, v.complement, max(v.ratio, spec.eps)
        else:
            t = float(rng.uniform(spec.eps, 1.0))
            masked = rng.random(len(resp)) < t
            masked[rng.integers(len(resp))] = True  # at least one supervised token
            window, comp = np.ones(len(resp), bool), ~masked
        views.append((s["prompt_ids"], resp, p, masked, comp, window, t))
    width = max(len(v[0]) + len(v[1]) for v in views)
    b = len(views)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    pad = torch.zeros((b, width), dtype=torch.long)
    loss = torch.zeros((b, width), dtype=torch.bool)
    comp_loss = torch.zeros((b, width), dtype=torch.bool)
    sup = torch.zeros((b, width), dtype=torch.bool)
    for i, (prompt, resp, p, masked, comp, window, _) in enumerate(views):
        n = p + len(resp)
        ids[i, :p] = torch.tensor(prompt)
        ids[i, p:n] = torch.from_numpy(resp.astype(np.int64))
        pad[i, :n] = 1
        loss[i, p:n] = torch.from_numpy(masked & window)
        comp_loss[i, p:n] = torch.from_numpy(comp & window)
        sup[i, p:n] = torch.from_numpy(window)
    t = torch.tensor([v[6] for v in views], dtype=torch.float32)
    return {"targets": ids, "pad": pad, "loss": loss, "comp_loss": comp_loss, "supervised": sup, "t": t}


def diffusion_ce(student: Student, batch: dict, loss_mask: torch.Tensor, spec: HeadSpec, device):
    """One student forward with `loss_mask` positions replaced by the mask token; CE at those positions."""
    ids = batch["targets"].masked_fill(loss_mask, student.info.mask_id).to(device)
    pad = batch["pad"].to(device)
    hidden = student_hidden(student, ids, pad, spec.attention, spec.block_size)  # (B, T, H)
    b_idx, t_idx = loss_mask.nonzero(as_tuple=True)
    src = t_idx - 1 if spec.logit_alignment == "shifted" else t_idx  # shifted: logits at p-1 predict p
    logits = lm_head(student)(hidden[b_idx.to(device), src.to(device)])  # (N, V)
    return masked_diffusion_loss(
        logits,
        batch["targets"].to(device),
        loss_mask.to(device),
        batch["supervised"].to(device),
        batch["t"].to(device),
        spec.weighting,
        spec.normaliser,
    )


@dataclass
class Run:
    """What every step of one training process uses: built once by `setup`."""

    job: TrainJob
    accelerator: Any
    student: Student
    reader: AnchorReader
    samples: list[dict]
    trajs: dict[str, dict]
    sampler: ViewSampler
    params: list[torch.nn.Parameter]
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
    """Student, data, optimizer and scheduler for one process; nothing has trained yet."""
    from accelerate import Accelerator

    spec, opts = job.spec, job.train
    accelerator = Accelerator(cpu=job.device == "cpu")
    torch.manual_seed(spec.seed)
    store = ArtifactStore(job.store_uri)
    student = build_student(
        teacher_stage.local_dir(store, job.teacher),
        spec.quantization,
        spec.dtype,
        str(accelerator.device),
        {
            "rank": spec.lora_rank,
            "alpha": spec.lora_alpha,
            "dropout": spec.lora_dropout,
            "rslora": spec.rslora,
        },
        spec.attention,
        spec.linear_attention,
        spec.block_size,
        opts.gradient_checkpointing,
        trust_remote_code=job.teacher_spec.trust_remote_code,
    )
    reader = AnchorReader(store, job.anchors)
    reader.check(teacher_key=job.teacher.key, capture="residual")
    reader.check_responses(store, job.responses)
    table = read_responses(store, job.responses)
    samples = sorted((r for r in table.to_pylist() if r["split"] == "train"), key=lambda r: r["sample_id"])
    if not samples:
        raise ValueError(
            "no training samples: every prompt is in the eval split; lower prompts.eval_fraction"
        )
    trajs = read_trajectories(store, job.trajectories)
    check_same_responses(store, job.trajectories, trajs, samples)
    sampler = ViewSampler(
        spec.seed, spec.steps, spec.r_min_start, spec.r_min_end, spec.r_max, spec.window_sizes
    )
    params = [p for p in student.model.parameters() if p.requires_grad] + [student.mask.weight]
    if spec.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    # Nothing goes through accelerator.prepare: the student's forward is called on its inner module
    # (DDP's hooks would not fire), so gradients are averaged explicitly in `train_step`, and a
    # prepared scheduler would step once per process.
    return Run(
        job=job,
        accelerator=accelerator,
        student=student,
        reader=reader,
        samples=samples,
        trajs=trajs,
        sampler=sampler,
        params=params,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec)),
        precision=resolve_precision(opts.mixed_precision, accelerator.device),
        ckpt_root=Path(job.workdir) / "checkpoints",
        remote=checkpoints.remote_root(store, job.head),
    )


def resume(run: Run) -> int:
    """Load the newest checkpoint into the run, if any; the step to continue from."""
    last = checkpoints.latest(run.ckpt_root)
    if last is None:
        return 0
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state, extras = checkpoints.load(last, run.optimizer, run.scheduler)
    set_peft_model_state_dict(run.student.model, load_file(last / "adapter" / "adapter_model.safetensors"))
    run.student.load_extras(extras)
    emit("resume", step=state["step"], checkpoint=last.name)
    return state["step"]


def align_term(
    run: Run, batch_samples: list[dict], batch: dict, chosen: list[int], captured: dict, rng
) -> torch.Tensor:
    """1 - cos between the student's captured layers and the teacher's anchors at the same tokens."""
    spec = run.job.spec
    anchors = run.reader.batch(
        [s["sample_id"] for s in batch_samples], chosen, spec.align_token_fraction, rng
    )
    s_h, t_h = [], []
    for b, a in enumerate(anchors):
        pos = torch.as_tensor(a["positions"], dtype=torch.long)
        pos_ok = pos < batch["pad"][b].sum()
        for j, layer in enumerate(chosen):
            s_h.append(captured[layer][b, pos[pos_ok].to(run.device)])
            t_h.append(a["hidden"][pos_ok.numpy(), j].to(run.device))
    return alignment_loss(s_h, t_h)


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimizer step over `grad_accum` micro-batches on every rank; the step's mean stats."""
    spec = run.job.spec
    lam = spec.align_weight * (1.0 if spec.align_schedule == "constant" else max(0.0, 1 - step / spec.steps))
    stats: dict[str, float] = {"loss": 0.0, "ce": 0.0, "align": 0.0}
    for micro in range(spec.grad_accum):
        g = micro * run.world + run.rank  # global micro-batch index: masks do not depend on world size
        idx = micro_batch_indices(len(run.samples), spec, step, g, run.world)
        batch_samples = [run.samples[i] for i in idx]
        batch = make_batch(
            batch_samples,
            run.trajs,
            spec,
            run.sampler,
            step,
            g,
            run.student.info.mask_id,
            run.student.tok.pad_token_id,
        )
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step, 1, g]))
        layers = run.reader.layers
        chosen = (
            sorted(rng.choice(layers, size=min(spec.align_layers, len(layers)), replace=False).tolist())
            if lam > 0
            else []
        )
        captured: dict[int, torch.Tensor] = {}
        with (
            capture_layers(run.student.model.get_base_model(), chosen, captured.__setitem__),
            autocast(run.device, run.precision),
        ):
            loss, info = diffusion_ce(run.student, batch, batch["loss"], spec, run.device)
        align = align_term(run, batch_samples, batch, chosen, captured, rng) if chosen else torch.zeros(())
        total = loss + lam * align.to(loss.device)
        if spec.complementary:
            with autocast(run.device, run.precision):
                comp, _ = diffusion_ce(run.student, batch, batch["comp_loss"], spec, run.device)
            total = total + comp
        run.accelerator.backward(total / spec.grad_accum)
        stats["loss"] += total.item() / spec.grad_accum
        stats["ce"] += info["ce"] / spec.grad_accum
        stats["align"] += float(align.detach()) / spec.grad_accum
    if run.world > 1:  # the mean over ranks, as DDP computes it
        for p in run.params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)  # SUM: gloo has no AVG
                p.grad.div_(run.world)
    torch.nn.utils.clip_grad_norm_(run.params, spec.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return {**stats, "lambda": lam}


def save_checkpoint(run: Run, step: int) -> None:
    """Rank 0 writes (and mirrors) the checkpoint of `step`; every rank waits for it."""
    spec = run.job.spec
    if run.rank == 0:
        cursor = step * spec.grad_accum * run.world * spec.micro_batch_size
        checkpoints.publish(
            run.ckpt_root,
            step,
            run.job.train.keep_checkpoints,
            run.student.model,
            run.student.extras(),
            run.optimizer,
            run.scheduler,
            cursor,
            {"world": run.world},
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


def train(job: TrainJob) -> dict[str, Any]:
    """Train to `spec.steps` (resuming from the newest checkpoint); SIGTERM checkpoints and stops."""
    spec, opts = job.spec, job.train
    run = setup(job)
    step = resume(run)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, lambda *_: stop())  # this process's main thread
    tracker = Tracker(
        opts.wandb_project if run.rank == 0 else None,
        "head",
        job.head.key,
        {
            "head": spec.model_dump(mode="json"),
            "train": opts.model_dump(mode="json"),
            "precision": run.precision,
        },
        Path(job.workdir),
    )
    if tracker.url:
        emit("wandb", url=tracker.url)
    history = []
    with tracker:
        while step < spec.steps:
            stats = train_step(run, step)
            step += 1
            stopping = stop_everywhere(run, stop) or step == job.stop_after
            history.append({"step": step, **{k: round(v, 6) for k, v in stats.items() if k != "lambda"}})
            tracker.log(
                {**history[-1], "lr": run.scheduler.get_last_lr()[0], "lambda": stats["lambda"]}, step
            )
            if run.rank == 0 and (step % opts.log_every == 0 or step == spec.steps):
                emit("progress", total=spec.steps, **history[-1], lr=run.scheduler.get_last_lr()[0])
            if step % opts.checkpoint_every == 0 or step == spec.steps or stopping:
                save_checkpoint(run, step)
            if stopping:
                emit("stopped", step=step)
                return {"step": step, "stopped": True, "history": history}
    return {
        "step": step,
        "stopped": False,
        "history": history,
        "student": run.student.info.__dict__,
        "precision": run.precision,
    }


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


if __name__ == "__main__":
    sys.exit(main())
