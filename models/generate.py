"""Batched autoregressive generation with the KV cache (greedy by default), for teacher responses.

Sampling never touches torch's global RNG: responses shards generate concurrently in threads of one
process, so a global seed would make a sample depend on thread timing. Each sample draws from its own
generator (seeded per sample by the caller), via the Gumbel-max trick over the temperature/top-p
scores: the argmax of scores + Gumbel noise is an exact sample from their softmax, so HF's greedy
loop (KV cache, EOS handling) does the sampling, and a sample is the same whichever batch, shard
or thread it is generated in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper


@dataclass
class Generated:
    response_ids: list[list[int]]  # per sample, EOS included when generation stopped on it
    finish_reason: list[str]  # "eos" or "length"
    forwards: int  # decoder forward passes used for the batch


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (B, T): generation appends on the right."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def sample_seed(seed: int, sample_id: str) -> int:
    """The seed of one sample's generator: a function of the run's seed and the sample alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{sample_id}".encode()).digest()[:8], "big") >> 1


class GumbelSampler(LogitsProcessor):
    """Adds Gumbel(0, 1) noise to each row's scores from that row's own generator (B rows, B seeds)."""

    def __init__(self, seeds: Sequence[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores (B, V); uniform u in [0, 1) per row -> -log(-log u); -inf scores (top-p cut) stay -inf
        u = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
        return scores + gumbel.to(device=scores.device, dtype=scores.dtype)


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
) -> Generated:
    """Generate continuations for a batch of prompts; stops each sample at its first EOS.

    Sampling (`do_sample`) needs one seed per prompt (`sample_seed`); it applies the temperature
    and top-p given here and nothing else (no top-k from the model's generation config).
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    kwargs: dict = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id)
    # Greedy in HF's loop either way; the model's generation config must not switch sampling on.
    kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if do_sample:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError("sampled generation needs one seed per prompt (see sample_seed)")
        kwargs["logits_processor"] = LogitsProcessorList(
            [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p), GumbelSampler(seeds)]
        )
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # (B, T + new)
    new = out[:, ids.shape[1] :].tolist()
    responses, reasons = [], []
    eos = set(eos_ids)
    for row in new:
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        if cut is None:
            responses.append(row)
            reasons.append("length")
        else:
            responses.append(row[: cut + 1])
            reasons.append("eos")
    return Generated(responses, reasons, forwards=len(new[0]) if new else 0)


def eos_ids(model: torch.nn.Module, tok) -> list[int]:
    """Every token id that ends a response: the generation config's EOS ids plus the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = (
        list(ids) if isinstance(ids, list) else [ids] if ids is not None else []
    )  # a copy: never edit the config
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    if not ids:
        raise ValueError("the teacher has no EOS token: set eos_token_id in its generation_config")
    return ids
