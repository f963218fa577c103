"""The drafter's objective: DFlash blocks drawn from the teacher's stored states, CE weighted along
the block, held-out acceptance with the teacher's own continuation.

A training block is exactly a decode step's: the block starting at position s is `[token s, MASK x
(B-1)]` at positions s..s+B-1, it sees the fused layer outputs of positions < s and itself, and block
offset k predicts token s+k. Many random starts per response share one forward
(`a2d.models.drafter.block_mask`). The frozen head restricted to the draft vocabulary is the decoding
proposal's too (`a2d.models.dflash_drafter.DFlashDrafter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from a2d.models.drafter import DFlashDraftModel, block_mask, position_weights
from a2d.models.objectives import Objective, Saved, lr_lambda, mean_over_ranks
from a2d.models.teacher import autocast

CURVE_POINTS = (0.25, 0.5, 1.0)  # shares of the steps at which held-out τ is measured


@dataclass
class Sequence:
    """One response as the drafter trains on it: tokens, where the response starts, the fused
    input features (T, K*H) of every position."""

    sample_id: str
    tokens: torch.Tensor  # (T,) long
    prompt_len: int
    features: torch.Tensor  # (T, K*H), stored dtype
    soft_rows: torch.Tensor | None = None  # (T, k) head rows of the teacher's top tokens after position t
    soft_p: torch.Tensor | None = None  # (T, k) their probabilities, renormalised over the k

    @property
    def starts(self) -> np.ndarray:
        """Block starts s with at least one target: s in [prompt_len, T - 2]."""
        return np.arange(self.prompt_len, len(self.tokens) - 1)


@dataclass
class Frozen:
    """What the drafter borrows from the teacher: embedding, output head (restricted to the draft
    vocabulary when it has one), and the map from token id to head row."""

    embed: torch.Tensor  # (V, H)
    head: torch.Tensor  # (V', H)
    vocab: torch.Tensor | None  # (V',) token ids, or None for the whole vocabulary
    row_of: torch.Tensor | None  # (V,) head row of each token id, -1 outside the vocabulary


def draft_head(head: torch.nn.Module, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head's weight (V', H) and bias (V',) restricted to the draft vocabulary (its rows
    in `vocab` order), or the whole head's without one. The weight is detached: the head is frozen."""
    weight, bias = head.weight.detach(), getattr(head, "bias", None)
    if vocab is not None:
        weight = weight[vocab.to(weight.device)]
        bias = bias[vocab.to(bias.device)] if bias is not None else None
    return weight, bias


def draft_tokens(vocab: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """The token ids of draft-head rows (the rows themselves without a draft vocabulary)."""
    return rows if vocab is None else vocab.to(rows.device)[rows]


def frozen_parts(model, vocab: torch.Tensor | None, device: str) -> Frozen:
    embed = model.get_input_embeddings().weight.detach().to(device)
    head = draft_head(model.get_output_embeddings(), vocab)[0].to(device)
    row_of = None
    if vocab is not None:
        row_of = torch.full((embed.shape[0],), -1, dtype=torch.long, device=device)
        row_of[vocab.to(device)] = torch.arange(len(vocab), device=device)
    return Frozen(embed, head, vocab, row_of)


def train_vocab(rows: list[dict], eos: list[int]) -> torch.Tensor:
    ids = {t for r in rows for t in list(r["prompt_ids"]) + list(r["response_ids"])} | set(eos)
    return torch.tensor(sorted(ids), dtype=torch.long)


def make_batch(seqs: list[Sequence], spec: Any, rng: np.random.Generator, mask_id: int, device: str):
    """Features (b, W, K*H), context lengths, starts (b, M), block ids (b, M, B), targets (b, M, B-1)
    and, with soft targets, the teacher's top head rows and probabilities (b, M, B-1, k) (else None)."""
    b, m, block = len(seqs), spec.blocks_per_sample, spec.block_size
    soft = seqs[0].soft_rows is not None
    k = seqs[0].soft_rows.shape[1] if soft else 0
    soft_rows = torch.zeros((b, m, block - 1, k), dtype=torch.long)
    soft_p = torch.zeros((b, m, block - 1, k), dtype=torch.float32)
    width = max(len(s.tokens) for s in seqs)
    feats = torch.zeros((b, width, seqs[0].features.shape[1]), dtype=seqs[0].features.dtype)
    ctx_len = torch.tensor([len(s.tokens) for s in seqs])
    starts = torch.zeros((b, m), dtype=torch.long)
    ids = torch.full((b, m, block), mask_id, dtype=torch.long)
    targets = torch.full((b, m, block - 1), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        feats[i, : len(s.tokens)] = s.features
        cands = s.starts
        chosen = np.sort(rng.choice(cands, m, replace=len(cands) < m))
        starts[i] = torch.from_numpy(chosen)
        for j, st in enumerate(chosen.tolist()):
            ids[i, j, 0] = s.tokens[st]
            tail = s.tokens[st + 1 : st + block]
            targets[i, j, : len(tail)] = tail
            if soft:  # offset d predicts token st + d: the teacher's distribution at st + d - 1
                soft_rows[i, j, : len(tail)] = s.soft_rows[st : st + len(tail)]
                soft_p[i, j, : len(tail)] = s.soft_p[st : st + len(tail)]
    out = feats.to(device), ctx_len.to(device), starts.to(device), ids.to(device), targets.to(device)
    return (*out, soft_rows.to(device), soft_p.to(device)) if soft else (*out, None, None)


def block_states(drafter: DFlashDraftModel, frozen: Frozen, feats, ctx_len, starts, ids) -> torch.Tensor:
    """The drafter's states of every block offset >= 1: (b, M, B-1, H)."""
    b, m, block = ids.shape
    width = feats.shape[1]
    positions = torch.arange(width, device=feats.device)[None].expand(b, -1)
    kv = drafter.context_kv(drafter.fuse(feats), positions)
    block_pos = (starts[..., None] + torch.arange(block, device=feats.device)).reshape(b, -1)
    mask = block_mask(starts, ctx_len, width, block)
    states = drafter(frozen.embed[ids.reshape(b, -1)], block_pos, kv, mask)
    return states.reshape(b, m, block, -1)[:, :, 1:]


def head_logits(states: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The frozen head's logits (..., V') of states (..., H), as one matrix product. `states @ head.T`
    on the (b, M, B-1, H) offsets slice (not contiguous) runs as b*M batched products of 3 rows each:
    on 2 AVX2 cores that was 0.5 s of the demo drafter's 0.84 s training step, forward and backward."""
    flat = states.reshape(-1, states.shape[-1])
    return F.linear(flat, head.to(states.dtype)).view(*states.shape[:-1], head.shape[0])


def head_targets(frozen: Frozen, targets: torch.Tensor) -> torch.Tensor:
    if frozen.row_of is None:
        return targets
    rows = frozen.row_of[targets.clamp_min(0)]
    return torch.where(targets < 0, targets, rows)


def drafter_loss(
    drafter,
    frozen: Frozen,
    batch,
    weights: torch.Tensor,
    norm: torch.Tensor | None = None,
    distill: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE, per-offset top-1 accuracy (B-1,)) of one batch; with `norm`, the weighted CE
    sum is divided by it (the whole step's weight when the batch is one process's share). With
    `distill`, each offset's CE is (1 - distill) on the greedy token + distill on the teacher's
    top-k distribution there (the batch's soft targets)."""
    feats, ctx_len, starts, ids, targets, soft_rows, soft_p = batch
    states = block_states(drafter, frozen, feats, ctx_len, starts, ids)  # (b, M, B-1, H)
    logits = head_logits(states, frozen.head).float()  # (b, M, B-1, V')
    tgt = head_targets(frozen, targets)
    if not distill:
        ce = F.cross_entropy(logits.flatten(0, 2), tgt.flatten(), ignore_index=-100, reduction="none")
        ce = ce.view(tgt.shape)
    else:
        if soft_rows is None:
            raise ValueError("drafter.distill needs the teacher's soft targets in the batch")
        logp = logits.log_softmax(-1)  # once for both terms
        hard = -logp.gather(-1, tgt.clamp_min(0)[..., None])[..., 0] * (tgt >= 0)
        soft = -(soft_p * logp.gather(-1, soft_rows)).sum(-1)  # (b, M, B-1)
        ce = (1.0 - distill) * hard + distill * soft
    valid = (tgt >= 0).float()
    w = weights.to(ce.device)[None, None] * valid
    loss = (ce * w).sum() / (w.sum().clamp_min(1e-8) if norm is None else norm)
    with torch.no_grad():
        hit = (logits.argmax(-1) == tgt).float() * valid
        acc = hit.sum((0, 1)) / valid.sum((0, 1)).clamp_min(1)
    return loss, acc


def decode_chain(accepted_at: dict[int, int], first: int) -> list[int]:
    """The accepted-draft counts of the blocks a greedy decode meets: the first block starts at
    `first`; after n accepted drafts the verify's own token lands too, so the next starts n + 1 on."""
    out, start = [], first
    while start in accepted_at:
        out.append(accepted_at[start])
        start += accepted_at[start] + 1
    return out


@torch.no_grad()
def teacher_forced(
    drafter, frozen: Frozen, seqs: list[Sequence], block: int, mask_id: int, device: str
) -> dict:
    """Held-out acceptance with the teacher's own continuation: from every block start, how many
    leading drafts equal the teacher's tokens. τ = 1 + mean accepted (the verify's own token included).

    `tau_decode_chain` is τ over the block starts a greedy decode meets: the first block starts at
    the first response token, each next one where the last stopped (after n accepted drafts, at
    start + n + 1). A decode's blocks start right after its rejections, where drafting is harder than
    at a random position, so this is what a lossless decode's τ comes to, and it sits below `tau`."""
    accepted: list[int] = []
    chain: list[int] = []
    by_offset = np.zeros(block - 1)
    reach = np.zeros(block - 1)
    for s in seqs:
        starts = s.starts
        at: dict[int, int] = {}  # block start -> drafts accepted there
        for lo in range(0, len(starts), 64):
            chunk = torch.from_numpy(starts[lo : lo + 64])[None].to(device)
            ids = torch.full((1, chunk.shape[1], block), mask_id, dtype=torch.long, device=device)
            ids[0, :, 0] = s.tokens.to(device)[chunk[0]]
            states = block_states(
                drafter,
                frozen,
                s.features[None].to(device),
                torch.tensor([len(s.tokens)], device=device),
                chunk,
                ids,
            )[0]
            best = head_logits(states, frozen.head).argmax(-1)  # (M, B-1)
            drafts = draft_tokens(frozen.vocab, best)
            for j, st in enumerate(chunk[0].tolist()):
                truth = s.tokens[st + 1 : st + block].tolist()
                n = 0
                while n < len(truth) and drafts[j, n].item() == truth[n]:
                    n += 1
                accepted.append(n)
                at[st] = n
                reach[: len(truth)] += 1
                by_offset[:n] += 1
        chain += decode_chain(at, s.prompt_len)
    mean = float(np.mean(accepted)) if accepted else 0.0
    return {
        "starts": len(accepted),
        "tau": round(1.0 + mean, 4),
        "tau_decode_chain": round(1.0 + float(np.mean(chain)), 4) if chain else None,
        "chain_starts": len(chain),
        "accept_by_offset": [
            round(float(a / r), 4) if r else None for a, r in zip(by_offset, reach, strict=True)
        ],
    }


class DrafterObjective(Objective):
    """The DFlash drafter's training: one batch of `micro_batch_size` responses a step, drawn by
    (seed, step); several processes split it by rows, each dividing by the whole batch's weight."""

    stage = "drafter"

    def __init__(
        self,
        spec: Any,
        drafter: DFlashDraftModel,
        frozen: Frozen,
        seqs: list[Sequence],
        held: list[Sequence],
        layers: list[int],
        device: str,
        precision: str,
    ):
        self.spec, self.drafter, self.frozen = spec, drafter, frozen
        self.seqs, self.held, self.layers = seqs, held, layers
        self.device, self.precision = device, precision
        self.mask_id = drafter.config.mask_token_id
        self.max_grad_norm = spec.max_grad_norm
        self.weights = position_weights(spec.block_size, spec.gamma)
        self.marks = sorted({max(1, round(f * spec.steps)) for f in CURVE_POINTS})
        self.curve: list[dict[str, Any]] = []
        self.params = list(drafter.parameters())
        drafter.train()

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.params, lr=self.spec.lr, weight_decay=self.spec.weight_decay)

    def schedule(self) -> Callable[[int], float]:
        return lr_lambda(self.spec)

    def forward_backward(self, step: int, rank: int, world: int) -> dict[str, Any]:
        spec, seqs = self.spec, self.seqs
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, step]))
        picked = [
            seqs[i] for i in rng.choice(len(seqs), min(spec.micro_batch_size, len(seqs)), replace=False)
        ]
        if len(picked) < world:
            raise ValueError(f"{len(picked)} responses a step cannot be split over {world} processes")
        batch = make_batch(picked, spec, rng, self.mask_id, self.device)
        norm = None
        if world > 1:  # rows of this process; the loss is divided by the whole batch's weight
            valid = (head_targets(self.frozen, batch[4]) >= 0).float()
            norm = (self.weights.to(valid.device)[None, None] * valid).sum().clamp_min(1e-8)
            share = slice(rank * len(picked) // world, (rank + 1) * len(picked) // world)
            batch = tuple(None if t is None else t[share] for t in batch)
        with autocast(torch.device(self.device), self.precision):
            loss, acc = drafter_loss(self.drafter, self.frozen, batch, self.weights, norm, self.spec.distill)
        if world > 1:
            loss = loss * world  # averaged over the processes: the sum of their shares
        loss.backward()
        return {"loss": mean_over_ranks(loss.detach(), world), "acc": mean_over_ranks(acc, world)}

    def record(
        self, stats: dict[str, Any], lr: float, grad_norm: float
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        row = {
            "loss": round(stats["loss"].item(), 6),
            "acc_1": round(stats["acc"][0].item(), 4),
            "acc_last": round(stats["acc"][-1].item(), 4),
            "grad_norm": round(float(grad_norm), 4),
            "lr": lr,
        }
        return row, {}

    def held_out(self, step: int) -> dict[str, Any] | None:
        if step not in self.marks or not self.held:
            return None
        self.drafter.eval()
        point = {
            "step": step,
            **teacher_forced(
                self.drafter, self.frozen, self.held, self.spec.block_size, self.mask_id, self.device
            ),
        }
        self.drafter.train()
        self.curve.append(point)
        return point

    def saved(self, step: int, world: int) -> Saved:
        return Saved(self.drafter, {}, step * self.spec.micro_batch_size, {"curve": self.curve})

    def load(self, folder: Path, state: dict[str, Any], extras: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import load_file

        self.drafter.load_state_dict(load_file(folder / "adapter" / "model.safetensors"))
        self.curve = state.get("curve", [])

    def tracked(self) -> dict[str, Any]:
        return {"layers": self.layers}

    def summary(self) -> dict[str, Any]:
        return {
            "curve": self.curve,
            "layers": self.layers,
            "rows": len(self.seqs),
            "tokens": int(sum(len(s.tokens) - s.prompt_len for s in self.seqs)),
        }
