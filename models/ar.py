"""Autoregressive decoding with the KV cache: the baseline every speed-up divides by.

`ar_decode` is a2d's own greedy loop: the prompt once, then one token per forward, each forward
computing logits for its last row only (`logits_to_keep=1`) and no attention mask (one unpadded
row): the least a cached greedy decode can do, at least as fast as transformers' `generate`
(measured side by side in benchmarks/decode.py). Every model call is counted.

`hf_prompt_lookup` is transformers' own prompt-lookup decoding, the library baseline a2d's
speculative decoders are compared with; transformers refuses it on stateful (hybrid) models.
"""

from __future__ import annotations

import torch

from a2d.models.block_decode import Decoded


@torch.no_grad()
def ar_decode(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    banned: int | None = None,
) -> Decoded:
    """Greedy decoding of one prompt; `banned` is a token id never emitted (a student's added mask row)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    eos = set(eos_ids)
    ids = torch.tensor([prompt], device=device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        if banned is not None:
            logits[banned] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        ids = torch.tensor([[token]], device=device)
    return Decoded(out, len(out), list(range(1, len(out) + 1)))


@torch.no_grad()
def hf_generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int | None,
    **kw,
) -> Decoded:
    """transformers' greedy `generate` on one prompt (`kw`: e.g. prompt_lookup_num_tokens), every
    model call counted; the tokens up to and including the first EOS."""
    count = [0]
    handle = model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        ids = torch.tensor([prompt], device=next(model.parameters()).device)
        new = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            **kw,
        )[0, len(prompt) :].tolist()
    finally:
        handle.remove()
    out = new[: next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))]
    return Decoded(out, count[0], [])


def hf_prompt_lookup(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int | None,
    tokens: int,
) -> Decoded:
    """transformers' prompt-lookup decoding (`prompt_lookup_num_tokens=tokens`), every model call counted."""
    if any(hasattr(m, "linear_attn") for m in model.modules()):
        raise ValueError(
            "transformers' prompt lookup refuses stateful (hybrid) models: use the decoder ar:prompt-lookup"
        )
    return hf_generate(model, prompt, max_new_tokens, eos_ids, pad_id, prompt_lookup_num_tokens=tokens)
