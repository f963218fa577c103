"""The diffusion head's objective: decode-state views of the training responses, masked-diffusion
CE (+ d3LLM's sharpening term) and the centred alignment to the teacher's anchors.

Every source of randomness is a function of (seed, step, global micro-batch index) and the data order
of (seed, epoch), so a step's batch does not depend on the number of processes: micro-batch g of a
step runs on process g % world.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from a2d.models.canvas import freeze_linear_states, new_cache, select_rows
from a2d.models.capture import capture_layers
from a2d.models.losses import alignment_loss, masked_diffusion_loss, time_weight
from a2d.models.objectives import Objective, Saved, lr_lambda
from a2d.models.student import Student, lm_head, student_forward
from a2d.models.teacher import autocast
from a2d.models.views import ViewSampler, build_batch


@functools.lru_cache(maxsize=4)
def sample_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, 7919])).permutation(n)


def micro_batch_indices(n: int, spec: Any, step: int, g: int, world: int) -> list[int]:
    """Sample indices of global micro-batch g at `step`; the data cursor is a function of (step, g)."""
    per_step = spec.grad_accum * world * spec.micro_batch_size
    start = step * per_step + g * spec.micro_batch_size
    out = []
    for c in range(start, start + spec.micro_batch_size):
        out.append(int(sample_order(n, spec.seed, c // n)[c % n]))
    return out


def make_batch(
    samples: list[dict], trajs: dict, run_sampler: ViewSampler, spec: Any, step: int, g: int, ids: dict
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
    student: Student, batch: dict, spec: Any, device, capture: list[int] | None = None
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


def align_term(
    run: HeadObjective, batch: dict, samples: list[dict], chosen: list[int], captured: dict, split: int, rng
) -> torch.Tensor:
    """1 - centred cos between the student's captured layers and the teacher's anchors, at the masked
    positions of the primary views (a sampled share of them)."""
    spec = run.spec
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


class HeadObjective(Objective):
    """The head's training: `grad_accum` micro-batches of `micro_batch_size` samples per process a step."""

    stage = "head"

    def __init__(
        self,
        spec: Any,
        student: Student,
        reader: Any,  # the anchors (stores.anchors.AnchorReader): `at` and `layer_means`
        samples: list[dict],
        trajs: dict[str, dict],
        token_ids: dict[str, Any],
        device: torch.device,
        precision: str,
    ):
        self.spec, self.student, self.reader = spec, student, reader
        self.samples, self.trajs, self.token_ids = samples, trajs, token_ids
        self.device, self.precision = device, precision
        self.max_grad_norm = spec.max_grad_norm
        self.sampler = ViewSampler(
            spec.seed,
            spec.steps,
            spec.block_size,
            spec.mask_schedule,
            spec.r_min_start,
            spec.r_min_end,
            spec.r_max,
            spec.eps,
        )
        # Late layers only: early layers at a masked position cannot match a teacher that saw the token.
        depth = int(reader.meta.get("num_model_layers") or (max(reader.layers) + 1))
        late = [layer for layer in reader.layers if layer >= spec.align_from * depth] or reader.layers[-1:]
        self.align_layers = late
        self.align_centre = reader.layer_means(late)  # (len(late), H) teacher mean per layer
        self.params = [p for p in student.model.parameters() if p.requires_grad] + [student.mask.weight]

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def optimizer(self) -> torch.optim.Optimizer:
        spec = self.spec
        if spec.optimizer == "sgd":
            return torch.optim.SGD(self.params, lr=spec.lr, weight_decay=spec.weight_decay)
        return torch.optim.AdamW(self.params, lr=spec.lr, weight_decay=spec.weight_decay)

    def schedule(self) -> Callable[[int], float]:
        return lr_lambda(self.spec)

    def forward_backward(self, step: int, rank: int, world: int) -> dict[str, Any]:
        spec = self.spec
        lam = spec.align_weight * (
            1.0 if spec.align_schedule == "constant" else max(0.0, 1 - step / spec.steps)
        )
        stats: dict[str, float] = {"loss": 0.0, "ce": 0.0, "align": 0.0, "acc": 0.0, "draft_acc": 0.0}
        for micro in range(spec.grad_accum):
            g = micro * world + rank  # global micro-batch index: masks do not depend on world size
            idx = micro_batch_indices(len(self.samples), spec, step, g, world)
            samples = [self.samples[i] for i in idx]
            batch = make_batch(samples, self.trajs, self.sampler, spec, step, g, self.token_ids)
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step, 1, g]))
            layers = self.align_layers
            chosen = (
                sorted(rng.choice(layers, size=min(spec.align_layers, len(layers)), replace=False).tolist())
                if lam > 0
                else []
            )
            with autocast(self.device, self.precision):
                loss, info, captured, split = diffusion_ce(self.student, batch, spec, self.device, chosen)
            align = (
                align_term(self, batch, samples, chosen, captured, split, rng) if chosen else torch.zeros(())
            )
            total = loss + lam * align.to(loss.device)
            (total / spec.grad_accum).backward()
            stats["loss"] += total.item() / spec.grad_accum
            stats["ce"] += info["ce"] / spec.grad_accum
            stats["acc"] += info["masked_acc"] / spec.grad_accum
            stats["draft_acc"] += info["draft_acc"] / spec.grad_accum
            stats["align"] += float(align.detach()) / spec.grad_accum
        return {**stats, "lambda": lam}

    def record(
        self, stats: dict[str, Any], lr: float, grad_norm: float
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        row = {k: round(v, 6) for k, v in stats.items() if k != "lambda"}
        return row, {"lr": lr, "lambda": stats["lambda"]}

    def saved(self, step: int, world: int) -> Saved:
        spec = self.spec
        cursor = step * spec.grad_accum * world * spec.micro_batch_size
        return Saved(self.student.model, self.student.extras(), cursor, {"world": world})

    def load(self, folder: Path, state: dict[str, Any], extras: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(
            self.student.model, load_file(folder / "adapter" / "adapter_model.safetensors")
        )
        self.student.load_extras(extras)

    def tracked(self) -> dict[str, Any]:
        return {"precision": self.precision}

    def summary(self) -> dict[str, Any]:
        return {"student": self.student.info.__dict__, "precision": self.precision}
