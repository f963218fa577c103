"""The VFM's objective: the noise adapter q_φ(z | prompt) and (jointly, by default) the flow map's
LoRA, trained on CE(completion)/(2τ²) + β·KL(q_φ ‖ prior) with reparameterised z.

A step's batch is `micro_batch_size` training responses drawn by (seed, step), with its noise; several
processes split it by rows (the noise is drawn for the whole batch first), so the step does not
depend on the number of processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from a2d.models.generate import eos_ids
from a2d.models.objectives import Objective, Saved, mean_over_ranks
from a2d.models.student import DiffusionSpec, Student, apply_lora, lora_parameters
from a2d.models.teacher import autocast
from a2d.models.vfm import NoiseAdapter, encode_prompt, flow_map_logits, kl_to_prior

MAX_GRAD_NORM = 1.0


def batch_tensors(rows: list[dict], length: int, eos: int, pad: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts (B, P) and completion targets (B, L): the response, then EOS to length L."""
    width = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), length), eos, dtype=torch.long)
    for i, r in enumerate(rows):
        p = r["prompt_ids"]
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
        resp = r["response_ids"][:length]
        targets[i, : len(resp)] = torch.tensor(resp)
    return {"ids": ids, "pad": mask, "targets": targets}


def tunable_lora(student: Any) -> dict[str, torch.nn.Parameter]:
    """The student's LoRA parameters, switched to trainable, by name."""
    lora = lora_parameters(student)
    if not lora:
        raise ValueError("vfm.tune_lora is set but the head's student has no LoRA parameters")
    for p in lora.values():
        p.requires_grad_(True)
    return lora


def vfm_losses(
    student: Any,
    adapter: NoiseAdapter,
    batch: dict[str, torch.Tensor],
    rng: np.random.Generator,
    spec: Any,
    dspec: DiffusionSpec,
    device: str,
    share: slice = slice(None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch through q_φ and the flow map: (CE of the one-step logits, KL(q ‖ N(mask, I))).

    `share`: the rows this process trains on; the noise is drawn for the whole batch, and the CE is
    then this share's sum over the whole batch's supervised positions."""
    rows = len(batch["targets"])
    ids, pad, targets = (batch[k][share].to(device) for k in ("ids", "pad", "targets"))
    prompt = encode_prompt(student, ids, pad)  # once, without grad: the flow map's prefix cache too
    mu, logvar = adapter(prompt.states, pad, spec.max_len)
    mu, logvar = mu.float(), logvar.float()
    noise = torch.from_numpy(rng.standard_normal((rows, *mu.shape[1:])).astype(np.float32))[share].to(device)
    z = adapter.embed(mu + (0.5 * logvar).exp() * noise)  # reparameterised, in embedding units
    supervised = torch.ones_like(targets, dtype=torch.bool)
    whole = rows * targets.shape[1]  # supervised positions of the whole batch
    if spec.refine_fraction > 0:  # commit a random share of true tokens; the loss is on the rest
        keep_all = rng.random((rows, targets.shape[1])) < rng.uniform(0, spec.refine_fraction)
        keep = torch.from_numpy(keep_all[share]).to(device)
        true_emb = student.model.get_base_model().get_input_embeddings()(targets)
        z = torch.where(keep[..., None], true_emb.to(z.dtype), z)
        supervised = ~keep
        whole = int((~keep_all).sum())
    shifted = dspec.logit_alignment == "shifted"
    logits = flow_map_logits(student, prompt, z, shifted)
    ce = torch.nn.functional.cross_entropy(logits[supervised].float(), targets[supervised])  # (B, L, V) rows
    if len(targets) < rows:
        ce = ce * (int(supervised.sum()) / whole)
    return ce, kl_to_prior(mu, logvar, adapter.prior_mean)


class VFMObjective(Objective):
    """q_φ (and the flow map's LoRA when tuned) against the frozen diffusion student."""

    stage = "vfm"
    max_grad_norm = MAX_GRAD_NORM

    def __init__(
        self, spec: Any, student: Student, dspec: DiffusionSpec, rows: list[dict], device: str, precision: str
    ):
        self.spec, self.student, self.dspec, self.rows = spec, student, dspec, rows
        self.device, self.precision = device, precision
        student.model.requires_grad_(False)
        base = student.model.get_base_model()
        self.eos = eos_ids(base, student.tok)[0]
        embed_weight = base.get_input_embeddings().weight
        adapter = NoiseAdapter(embed_weight.shape[1], spec.max_len, spec.width, spec.layers, spec.heads)
        self.adapter = adapter.to(device)
        self.adapter.init_mean(student.mask.weight.detach(), float(embed_weight.float().pow(2).mean().sqrt()))
        # Joint tuning trains the flow map's LoRA weights too; they are checkpointed as "extras".
        self.lora = tunable_lora(student) if spec.tune_lora else {}
        self.groups = [{"params": list(self.adapter.parameters()), "lr": spec.lr}]
        if self.lora:
            self.groups.append({"params": list(self.lora.values()), "lr": spec.lora_lr})

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for g in self.groups for p in g["params"]]

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.groups)

    def forward_backward(self, step: int, rank: int, world: int) -> dict[str, Any]:
        spec = self.spec
        if spec.micro_batch_size % world:
            raise ValueError(
                f"vfm.micro_batch_size={spec.micro_batch_size} does not split over {world} processes"
            )
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step]))
        batch = batch_tensors(
            [self.rows[i] for i in rng.choice(len(self.rows), spec.micro_batch_size)],
            spec.max_len,
            self.eos,
            self.student.tok.pad_token_id,
        )
        per = spec.micro_batch_size // world
        share = slice(None) if world == 1 else slice(rank * per, (rank + 1) * per)
        with autocast(torch.device(self.device), self.precision):
            ce, kl = vfm_losses(self.student, self.adapter, batch, rng, spec, self.dspec, self.device, share)
        if world > 1:
            ce = ce * world  # averaged over the processes: the sum of their shares
        beta = spec.beta * min(1.0, (step + 1) / max(1.0, spec.beta_warmup * spec.steps))
        loss = ce / (2 * spec.tau**2) + beta * kl
        loss.backward()
        figures = mean_over_ranks(torch.stack([loss.detach(), ce.detach(), kl.detach()]), world)
        return {"loss": figures[0], "ce": figures[1], "kl": figures[2], "beta": beta}

    def record(
        self, stats: dict[str, Any], lr: float, grad_norm: float
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        row = {
            "loss": round(stats["loss"].item(), 6),
            "ce": round(stats["ce"].item(), 6),
            "kl": round(stats["kl"].item(), 4),
        }
        return row, {"beta": stats["beta"]}

    def saved(self, step: int, world: int) -> Saved:
        extras = {name: p.detach() for name, p in self.lora.items()}
        return Saved(self.adapter, extras, step * self.spec.micro_batch_size)

    def load(self, folder: Path, state: dict[str, Any], extras: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import load_file

        apply_lora(self.lora, extras)
        self.adapter.load_state_dict(load_file(folder / "adapter" / "noise_adapter.safetensors"))

    def tracked(self) -> dict[str, Any]:
        return {"precision": self.precision}
