"""Diffusion-head training: a process of its own (launched by the head task, or by `accelerate launch`).

    python -m a2d.tasks.train_head JOB.json

Every source of randomness is a function of (seed, step, global micro-batch index), the data order
of (seed, epoch), and the checkpoint holds adapter, extras, optimizer, scheduler, RNG, step and data
cursor: a resumed run reproduces the uninterrupted one. SIGTERM checkpoints and exits.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from a2d.models.canvas import freeze_linear_states, new_cache, select_rows
from a2d.models.capture import capture_layers
from a2d.models.generate import eos_ids
from a2d.models.losses import alignment_loss, masked_diffusion_loss, time_weight
from a2d.models.student import Student, lm_head, student_forward
from a2d.models.teacher import autocast, resolve_precision
from a2d.models.views import ViewSampler, build_batch
from a2d.specs import HeadSpec, TeacherSpec, TrainOptions
from a2d.stores import checkpoints
from a2d.stores.anchors import AnchorReader
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.stores.readers import check_same_responses, read_responses, read_trajectories
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.interrupt import StopFlag
from a2d.tasks.students import head_student
from a2d.tasks.tracking import Tracker
from a2d.tasks.training import lr_lambda


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
    samples: list[dict], trajs: dict, run_sampler: ViewSampler, spec: HeadSpec, step: int, g: int, ids: dict
) -> dict[str, torch.Tensor]:
    """One micro-batch of decode-state views (+ complements) as left-padded tensors (see models.views).

    `ids` holds the student's mask, pad and EOS ids and the set of every EOS id.
    """
    views = []
    for j, s in enumerate(samples):
        response = np.asarray(s["response_ids"], dtype=np.int64)
        finished = bool(len(response)) and int(response[-1]) in ids["eos_set"]
        max_blocks = max(1, (spec.max_seq_len - len(s["prompt_ids"])) // spec.block_size)
        views.append(
            run_sampler.view(
                step,
                g,
                j,
                s["sample_id"],
                response,
                ids["eos"],
                finished,
                trajs.get(s["sample_id"]),
                max_blocks,
            )
        )
    batch = build_batch(
        [s["prompt_ids"] for s in samples],
        [np.asarray(s["response_ids"]) for s in samples],
        views,
        ids["mask"],
        ids["pad"],
        spec.complementary,
    )
    batch["views"] = views
    return batch


def diffusion_ce(
    student: Student, batch: dict, spec: HeadSpec, device, capture: list[int] | None = None
) -> tuple[torch.Tensor, dict[str, float], dict[int, torch.Tensor], int]:
    """The student's loss at the masked positions of the batch's views (each kind of view normalised
    by its own count), its stats, the captured layer states and the column they start at.

    Under `block` attention with `adapter_scope: masked` the prefix has no trainable parameter in it
    (it is the base model), so it runs once per sample without grad into a cache, and only the open
    block (plus the prefix's last position, whose logits predict the block's first token) runs with
    grad: backward costs the block, not the whole sequence.
    """
    captured: dict[int, torch.Tensor] = {}
    ids, pad, open_ = (batch[k].to(device) for k in ("ids", "pad", "open"))
    split = 0
    cache = None
    if spec.attention == "block" and spec.adapter_scope == "masked":
        split = max(0, ids.shape[1] - spec.block_size - 1)
        primary = torch.nonzero(batch["kind"] == 0).flatten()  # one row per sample, in sample order
        with torch.no_grad():
            cache = new_cache(student.inner)
            none_open = torch.zeros_like(open_[primary, :split])
            student_forward(student, ids[primary, :split], pad[primary, :split], none_open, cache=cache)
        select_rows(cache, batch["sample"].to(device))  # a complement shares its sample's prefix
        freeze_linear_states(cache)
    with capture_layers(student.inner, capture or [], captured.__setitem__):
        hidden = student_forward(
            student,
            ids[:, split:],
            pad[:, split:],
            open_[:, split:],
            cache=cache,
            past_pad=pad[:, :split] if cache is not None else None,
        )  # (R, T - split, H)
    rows, cols = batch["loss"].nonzero(as_tuple=True)
    src = cols - 1 if spec.logit_alignment == "shifted" else cols  # shifted: logits at p-1 predict p
    logits = lm_head(student)(hidden[rows.to(device), (src - split).to(device)])  # (N, V)
    # Each kind of view (primary, complement) is one mean: over its masked (or its supervised) tokens.
    per_row = (batch["loss"] if spec.normaliser == "masked" else batch["block"]).sum(1).float()  # (R,)
    per_kind = torch.zeros(2).index_add_(0, batch["kind"], per_row)  # (2,)
    norm = 1.0 / per_kind[batch["kind"]][rows]  # (N,)
    time_w = time_weight(batch["t"], spec.weighting)[rows]
    loss, info = masked_diffusion_loss(
        logits,
        batch["targets"][rows, cols].to(device),
        time_w.to(device),
        norm.to(device),
        spec.entropy_weight,
    )
    # Draft accuracy: positions predicted from a mask row, as a decoder's drafts are. A position
    # predicted from a clean token (offset 1 after the prefix) is the base's own next token, right
    # whenever the base is, so `masked_acc` flatters the head; this is the figure drafting meets.
    from_mask = (batch["ids"][rows, src] == student.info.mask_id) & batch["open"][rows, src]
    right = (logits.argmax(-1).cpu() == batch["targets"][rows, cols])[from_mask]
    info["draft_acc"] = float(right.float().mean()) if len(right) else 0.0
    return loss, info, captured, split


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
    token_ids: dict[str, Any]  # mask, pad, eos, eos_set
    align_layers: list[int]  # the late stored layers alignment draws from
    align_centre: torch.Tensor | None  # (len(align_layers), H) teacher mean per layer
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
    student = head_student(
        teacher_stage.local_dir(store, job.teacher),
        spec,
        str(accelerator.device),
        job.teacher_spec.trust_remote_code,
        gradient_checkpointing=opts.gradient_checkpointing,
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
        spec.seed,
        spec.steps,
        spec.block_size,
        spec.mask_schedule,
        spec.r_min_start,
        spec.r_min_end,
        spec.r_max,
        spec.eps,
    )
    eos = eos_ids(student.inner, student.tok)
    token_ids = {
        "mask": student.info.mask_id,
        "pad": student.tok.pad_token_id,
        "eos": eos[0],
        "eos_set": set(eos),
    }
    # Late layers only: early layers at a masked position cannot match a teacher that saw the token.
    depth = int(reader.meta.get("num_model_layers") or (max(reader.layers) + 1))
    late = [layer for layer in reader.layers if layer >= spec.align_from * depth] or reader.layers[-1:]
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
        token_ids=token_ids,
        align_layers=late,
        align_centre=reader.layer_means(late),
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
    run: Run, batch: dict, samples: list[dict], chosen: list[int], captured: dict, split: int, rng
) -> torch.Tensor:
    """1 - centred cos between the student's captured layers and the teacher's anchors, at the masked
    positions of the primary views (a sampled share of them)."""
    spec = run.job.spec
    centre = [run.align_centre[run.align_layers.index(layer)].to(run.device) for layer in chosen]
    s_h, t_h, c_h = [], [], []
    for row in torch.nonzero(batch["kind"] == 0).flatten().tolist():
        sample = samples[int(batch["sample"][row])]
        cols = torch.nonzero(batch["loss"][row]).flatten()
        cols = cols[torch.from_numpy(rng.random(len(cols)) < spec.align_token_fraction)]
        # absolute position of a column in prompt+response: prompt length + response offset
        wanted = (cols - batch["offset"][row] + len(sample["prompt_ids"])).numpy()
        found, hidden = run.reader.at(sample["sample_id"], chosen, wanted)  # (k, L, H)
        if not len(found):
            continue
        at = torch.from_numpy(found - len(sample["prompt_ids"])) + batch["offset"][row] - split
        for j, layer in enumerate(chosen):
            s_h.append(captured[layer][row, at.to(run.device)])
            t_h.append(hidden[:, j].to(run.device))
            c_h.append(centre[j])
    return alignment_loss(s_h, t_h, c_h)


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimizer step over `grad_accum` micro-batches on every rank; the step's mean stats."""
    spec = run.job.spec
    lam = spec.align_weight * (1.0 if spec.align_schedule == "constant" else max(0.0, 1 - step / spec.steps))
    stats: dict[str, float] = {"loss": 0.0, "ce": 0.0, "align": 0.0, "acc": 0.0, "draft_acc": 0.0}
    for micro in range(spec.grad_accum):
        g = micro * run.world + run.rank  # global micro-batch index: masks do not depend on world size
        idx = micro_batch_indices(len(run.samples), spec, step, g, run.world)
        samples = [run.samples[i] for i in idx]
        batch = make_batch(samples, run.trajs, run.sampler, spec, step, g, run.token_ids)
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step, 1, g]))
        layers = run.align_layers
        chosen = (
            sorted(rng.choice(layers, size=min(spec.align_layers, len(layers)), replace=False).tolist())
            if lam > 0
            else []
        )
        with autocast(run.device, run.precision):
            loss, info, captured, split = diffusion_ce(run.student, batch, spec, run.device, chosen)
        align = align_term(run, batch, samples, chosen, captured, split, rng) if chosen else torch.zeros(())
        total = loss + lam * align.to(loss.device)
        run.accelerator.backward(total / spec.grad_accum)
        stats["loss"] += total.item() / spec.grad_accum
        stats["ce"] += info["ce"] / spec.grad_accum
        stats["acc"] += info["masked_acc"] / spec.grad_accum
        stats["draft_acc"] += info["draft_acc"] / spec.grad_accum
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
