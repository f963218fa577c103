"""Training views that are decode states, and the batch tensors built from them.

A decoder meets exactly one kind of state: the prompt and the committed blocks (clean, causal),
then the open block of `block_size` positions, some of them still masked, and nothing after it.
Blocks are counted from the response start, so the first response token opens block 0 whatever
the prompt length. A training view is such a state for one sample:

- a block b drawn uniformly from the response's blocks (block-aligned, never straddling two);
- a mask ratio r ~ U(r_min(step), r_max) up to 1.0 (every decode block starts fully masked);
- inside the block, the positions the teacher committed last are masked (its d3LLM trajectory:
  the state when it had committed about 1 - r of the block), or a random subset when the sample
  has no trajectory (counted by reason), or each position with probability t ~ U(eps, 1) for the
  `uniform` schedule;
- a response that ended with EOS is padded with EOS up to its last block, and those positions are
  supervised (the decoder must learn to stop); a response cut at the length budget uses whole
  blocks only, so no EOS is invented;
- everything after the block is absent from the input.

The complementary view (d3LLM) masks exactly the block positions the primary view left clean, with
its own t = its masked share.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from a2d.models.trajectory import check_pairing, mask_ratio_bounds

LAST = np.iinfo(np.int32).max  # trajectory step given to EOS padding: committed after every real token


@dataclass(frozen=True, eq=False)  # eq=False: field-wise == on arrays has no single truth value
class BlockView:
    """One decode state of one sample: which block is open and which of its positions are masked."""

    block: int  # block index, counted from the response start
    start: int  # response offset of the block's first position (block * block_size)
    tokens: np.ndarray  # (n,) the block's target tokens (EOS padding included)
    masked: np.ndarray  # (n,) bool: positions shown as the mask token
    ratio: float  # the drawn mask ratio r (or t)
    source: str  # "trajectory", "random" or "uniform"

    @property
    def complement(self) -> np.ndarray:
        return ~self.masked


def canvas(response: np.ndarray, block_size: int, eos_id: int, finished: bool) -> np.ndarray:
    """The response as blocks: EOS-padded to whole blocks when it ended with EOS, else cut to whole
    blocks (a response shorter than one block stays as it is)."""
    length = len(response)
    if finished:
        return np.concatenate([response, np.full((-length) % block_size, eos_id, dtype=response.dtype)])
    whole = (length // block_size) * block_size
    return response[: whole or length]


def masked_count(n: int, ratio: float) -> int:
    """Masked positions in a block of n at ratio r: at least one, so every view supervises something."""
    return min(n, max(1, int(math.floor(ratio * n + 0.5))))


@dataclass
class ViewSampler:
    """Decode-state views per sample; every draw is a function of (seed, step, micro-batch, index)."""

    seed: int
    total_steps: int
    block_size: int
    schedule: str = "trajectory"  # "trajectory" or "uniform"
    r_min_start: float = 0.0
    r_min_end: float = 0.8
    r_max: float = 1.0
    eps: float = 1e-3
    fallbacks: Counter[str] = field(default_factory=Counter, init=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        mask_ratio_bounds(0, self.total_steps, self.r_min_start, self.r_min_end, self.r_max)

    def view(
        self,
        step: int,
        micro_batch: int,
        index: int,
        sample_id: str,
        response: np.ndarray,
        eos_id: int,
        finished: bool,
        trajectory: dict[str, Any] | None,
        max_blocks: int,
    ) -> BlockView:
        """Draw the block, the ratio and the masked positions of one sample's view."""
        seq = np.random.SeedSequence([self.seed, step, micro_batch], spawn_key=(index,))
        rng = np.random.default_rng(seq)
        response = np.asarray(response)
        full = canvas(response, self.block_size, eos_id, finished)
        blocks = max(1, min(max_blocks, math.ceil(len(full) / self.block_size)))
        b = int(rng.integers(blocks))
        start = b * self.block_size
        tokens = full[start : start + self.block_size]
        n = len(tokens)
        if self.schedule == "uniform":
            t = float(rng.uniform(self.eps, 1.0))
            masked = rng.random(n) < t
            if not masked.any():
                masked[rng.integers(n)] = True
            return BlockView(b, start, tokens, masked, t, "uniform")
        r_min, r_max = mask_ratio_bounds(step, self.total_steps, self.r_min_start, self.r_min_end, self.r_max)
        ratio = float(rng.uniform(r_min, r_max))
        k = masked_count(n, ratio)
        traj = trajectory or {}
        reason = check_pairing(
            traj.get("sample_id"), traj.get("response_ids"), traj.get("unmask_step"), sample_id, response
        )
        masked = np.zeros(n, dtype=bool)
        if reason is None:
            steps = np.full(n, LAST, dtype=np.int64)
            real = np.asarray(traj["unmask_step"][start : start + n], dtype=np.int64)
            steps[: len(real)] = real
            # Stable sort by commit step: the last-committed k are masked (ties: the later position).
            masked[np.argsort(steps, kind="stable")[n - k :]] = True
            return BlockView(b, start, tokens, masked, ratio, "trajectory")
        self.fallbacks[reason] += 1
        masked[rng.permutation(n)[:k]] = True
        return BlockView(b, start, tokens, masked, ratio, "random")


def build_batch(
    prompts: list[list[int]],
    responses: list[np.ndarray],
    views: list[BlockView],
    mask_id: int,
    pad_id: int,
    complementary: bool,
) -> dict[str, torch.Tensor]:
    """Left-padded model inputs for a micro-batch of views (+ their complements).

    Row r holds prompt + committed blocks + the open block with its masked positions replaced by
    `mask_id`; nothing follows the block. Returns (R rows, T columns):
      ids, targets (B, T) long; pad, open, loss, block (B, T) bool; t (R,) masked share;
      kind (R,) 0 = primary view, 1 = complement; sample (R,) index into the micro-batch;
      offset (R,) column of each row's first response position (a response position p sits at
      column offset + p).
    Open positions run from the first masked one to the end of the row.
    """
    rows = []
    for i, (prompt, response, view) in enumerate(zip(prompts, responses, views, strict=True)):
        prefix = list(prompt) + [int(x) for x in np.asarray(response)[: view.start]]
        for kind, masked in ((0, view.masked), (1, view.complement)):
            if kind == 1 and not (complementary and masked.any()):
                continue
            block = [int(x) for x in view.tokens]
            shown = [mask_id if m else x for x, m in zip(block, masked, strict=True)]
            rows.append((i, kind, prefix + shown, prefix + block, len(prefix), masked, len(prompt)))
    width = max(len(r[2]) for r in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.full((n, width), pad_id, dtype=torch.long)
    pad = torch.zeros((n, width), dtype=torch.bool)
    open_ = torch.zeros((n, width), dtype=torch.bool)
    loss = torch.zeros((n, width), dtype=torch.bool)
    block = torch.zeros((n, width), dtype=torch.bool)
    t = torch.zeros(n)
    offset = torch.zeros(n, dtype=torch.long)
    for r, (_, _, shown, target, block_at, masked, prompt_len) in enumerate(rows):
        left = width - len(shown)  # left padding: every row's open block ends at the last column
        ids[r, left:] = torch.tensor(shown)
        targets[r, left:] = torch.tensor(target)
        pad[r, left:] = True
        cols = left + block_at + torch.arange(len(masked))
        loss[r, cols] = torch.from_numpy(masked)
        block[r, cols] = True
        open_[r, left + block_at + int(np.argmax(masked)) :] = True
        t[r] = float(masked.mean())
        offset[r] = left + prompt_len
    return {
        "ids": ids,
        "targets": targets,
        "pad": pad,
        "open": open_,
        "loss": loss,
        "block": block,
        "t": t,
        "kind": torch.tensor([r[1] for r in rows]),
        "sample": torch.tensor([r[0] for r in rows]),
        "offset": offset,
    }
