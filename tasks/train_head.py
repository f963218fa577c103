"""Diffusion-head training: a process of its own (launched by the head task, or by `accelerate launch`).

    python -m tasks.train_head JOB.json

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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from flows.config import HeadSpec, TeacherSpec, TrainOptions
from models.capture import capture_layers
from models.losses import alignment_loss, masked_diffusion_loss
from models.student import Student, build_student, lm_head, student_hidden
from models.teacher import autocast, resolve_precision
from models.trajectory import ViewSampler
from stores import checkpoints
from stores.anchors import AnchorReader
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import teacher as teacher_stage
from tasks.interrupt import StopFlag
from tasks.responses import read_responses
from tasks.tracking import Tracker
from tasks.trajectories import read_trajectories


class TrainJob(BaseModel):
    """Everything the training process needs, passed as JSON."""

    model_config = ConfigDict(extra="forbid")
    store: str
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


def diffusion_ce(
    student: Student, batch: dict, loss_mask: torch.Tensor, spec: HeadSpec, device, capture=None
):
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


def train(job: TrainJob) -> dict[str, Any]:
    from accelerate import Accelerator

    spec, opts = job.spec, job.train
    accelerator = Accelerator(cpu=job.device == "cpu")
    world, rank = accelerator.num_processes, accelerator.process_index
    torch.manual_seed(spec.seed)
    store = ArtifactStore(job.store)
    teacher_dir = teacher_stage.local_dir(store, job.teacher)
    student = build_student(
        teacher_dir,
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
    )
    reader = AnchorReader(store, job.anchors)
    reader.check(teacher_key=job.teacher.key, capture="residual")
    table = read_responses(store, job.responses)
    samples = sorted((r for r in table.to_pylist() if r["split"] == "train"), key=lambda r: r["sample_id"])
    if not samples:
        raise ValueError(
            "no training samples: every prompt is in the eval split; lower prompts.eval_fraction"
        )
    trajs = read_trajectories(store, job.trajectories)
    sampler = ViewSampler(
        spec.seed, spec.steps, spec.r_min_start, spec.r_min_end, spec.r_max, spec.window_sizes
    )
    params = [p for p in student.model.parameters() if p.requires_grad] + [student.mask.weight]
    if spec.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
    # Nothing goes through accelerator.prepare: the student's forward is called on its inner module
    # (DDP's hooks would not fire), so gradients are averaged explicitly below, and a prepared
    # scheduler would step once per process.
    ckpt_root = Path(job.workdir) / "checkpoints"
    remote = checkpoints.remote_root(ArtifactStore(job.store), job.head)
    step = 0
    last = checkpoints.latest(ckpt_root)
    if last is not None:
        state, extras = checkpoints.load(last, optimizer, scheduler)
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(student.model, load_file(last / "adapter" / "adapter_model.safetensors"))
        student.load_extras(extras)
        step = state["step"]
        emit("resume", step=step, checkpoint=last.name)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, lambda *_: stop())  # this process's main thread
    precision = resolve_precision(opts.mixed_precision, accelerator.device)
    tracker = Tracker(
        opts.wandb_project if rank == 0 else None,
        "head",
        job.head.key,
        {"head": spec.model_dump(mode="json"), "train": opts.model_dump(mode="json"), "precision": precision},
        Path(job.workdir),
    )
    if tracker.url:
        emit("wandb", url=tracker.url)
    layers = reader.layers
    history = []
    while step < spec.steps:
        lam = spec.align_weight * (
            1.0 if spec.align_schedule == "constant" else max(0.0, 1 - step / spec.steps)
        )
        stats: dict[str, float] = {"loss": 0.0, "ce": 0.0, "align": 0.0}
        for micro in range(spec.grad_accum):
            g = micro * world + rank  # global micro-batch index: seeds masks independently of world size
            idx = micro_batch_indices(len(samples), spec, step, g, world)
            batch_samples = [samples[i] for i in idx]
            batch = make_batch(
                batch_samples, trajs, spec, sampler, step, g, student.info.mask_id, student.tok.pad_token_id
            )
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step, 1, g]))
            chosen = (
                sorted(rng.choice(layers, size=min(spec.align_layers, len(layers)), replace=False).tolist())
                if lam > 0
                else []
            )
            captured: dict[int, torch.Tensor] = {}
            with (
                capture_layers(student.model.get_base_model(), chosen, captured.__setitem__),
                autocast(accelerator.device, precision),
            ):
                loss, info = diffusion_ce(student, batch, batch["loss"], spec, accelerator.device)
            align = torch.zeros((), device=accelerator.device)
            if chosen:
                anchors = reader.batch(
                    [s["sample_id"] for s in batch_samples], chosen, spec.align_token_fraction, rng
                )
                s_h, t_h = [], []
                for b, a in enumerate(anchors):
                    pos = torch.as_tensor(a["positions"], dtype=torch.long)
                    pos_ok = pos < batch["pad"][b].sum()
                    for j, layer in enumerate(chosen):
                        s_h.append(captured[layer][b, pos[pos_ok].to(accelerator.device)])
                        t_h.append(a["hidden"][pos_ok.numpy(), j].to(accelerator.device))
                align = alignment_loss(s_h, t_h)
            total = loss + lam * align
            if spec.complementary:
                with autocast(accelerator.device, precision):
                    comp, _ = diffusion_ce(student, batch, batch["comp_loss"], spec, accelerator.device)
                total = total + comp
            accelerator.backward(total / spec.grad_accum)
            stats["loss"] += total.item() / spec.grad_accum
            stats["ce"] += info["ce"] / spec.grad_accum
            stats["align"] += float(align.detach()) / spec.grad_accum
        if world > 1:  # the mean over ranks, as DDP computes it
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)  # SUM: gloo has no AVG
                    p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if world > 1:  # every rank stops at the same step, or the others would wait forever
            flag = torch.tensor([float(stop.set)], device=accelerator.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop.set = bool(flag.item())
        history.append({"step": step, **{k: round(v, 6) for k, v in stats.items()}})
        tracker.log({**history[-1], "lr": scheduler.get_last_lr()[0], "lambda": lam}, step)
        if rank == 0 and (step % opts.log_every == 0 or step == spec.steps):
            emit("progress", total=spec.steps, **history[-1], lr=scheduler.get_last_lr()[0])
        if step % opts.checkpoint_every == 0 or step == spec.steps or stop.set or step == job.stop_after:
            if rank == 0:
                cursor = step * spec.grad_accum * world * spec.micro_batch_size
                checkpoints.publish(
                    ckpt_root,
                    step,
                    opts.keep_checkpoints,
                    student.model,
                    student.extras(),
                    optimizer,
                    scheduler,
                    cursor,
                    {"world": world},
                    remote=remote,
                )
                emit("checkpoint", step=step)
            accelerator.wait_for_everyone()
            if stop.set or step == job.stop_after:
                emit("stopped", step=step)
                tracker.finish()
                return {"step": step, "stopped": True, "history": history}
    tracker.finish()
    return {
        "step": step,
        "stopped": False,
        "history": history,
        "student": student.info.__dict__,
        "precision": precision,
    }


def main(argv: list[str] | None = None) -> int:
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
