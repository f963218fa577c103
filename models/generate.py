"""Batched autoregressive generation with the KV cache (greedy by default), for teacher responses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    seed: int | None = None,
) -> Generated:
    """Generate continuations for a batch of prompts; stops each sample at its first EOS."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p)
        if seed is not None:
            torch.manual_seed(seed)
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
