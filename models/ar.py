"""Autoregressive decoding with the KV cache: the baseline every speed-up divides by.

`ar_decode` is a2d's own greedy loop: the prompt once through the model, then one token per
forward, each computing logits for its last row only. On a llama-family model (llama, qwen2,
qwen3: plain fp32 linears, full attention, RoPE) on the CPU the one-token forwards run through
`LeanStep`, the same layers written as ~20 tensor ops each over preallocated K/V buffers: on a
2-core CPU transformers' module structure costs ~20 ms per step of a 30-layer model whatever its
width (a hidden-64 llama's step takes 20 ms), a quarter of a SmolLM2-135M step; the lean step is
the same function (logits equal to the library forward's, bit for bit on SmolLM2, checked in the
tests) at ~0.8x its time. Other models (hybrid, PEFT-wrapped, quantized) keep the library forward.
Every model call is counted.

`hf_prompt_lookup` is transformers' own prompt-lookup decoding, the library baseline a2d's
speculative decoders are compared with; transformers refuses it on stateful (hybrid) models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from a2d.models.block_decode import Decoded

LEAN_FAMILIES = ("llama", "qwen2", "qwen3")
LEAN_ROPE = ("default", "linear", "llama3")  # RoPE whose angles depend on the position only


@dataclass
class LeanState:
    """One decode's K/V buffers (per layer, (1, kv_heads, total, head_dim)), RoPE tables and next position."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    pos: int


class LeanStep:
    """One-token decoder forwards of a llama-family model over preallocated K/V buffers.

    `start(cache, total)` takes over a library cache filled by the prompt forward (a `LeanState`,
    one per decode); `step(state, token)` feeds one token at its next position and returns its
    logits (vocab,). The layers run the
    model's own parameters and linears (a packed linear's kernel choice included), in the
    library's order of operations, so the logits are the library forward's up to float rounding.
    """

    def __init__(self, model: nn.Module):
        cfg, inner = model.config, model.model
        self.model, self.inner = model, inner
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.half = self.head_dim // 2
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    layer.input_layernorm.variance_epsilon,
                    attn.q_proj.forward,
                    attn.k_proj.forward,
                    attn.v_proj.forward,
                    attn.o_proj.forward,
                    None if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.variance_epsilon),
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon,
                    mlp.gate_proj.forward,
                    mlp.up_proj.forward,
                    mlp.down_proj.forward,
                )
            )
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.head = model.lm_head.forward

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether `model` is a plain fp32 CPU llama-family causal LM the lean step reproduces."""
        cfg = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        if cfg is None or getattr(cfg, "model_type", None) not in LEAN_FAMILIES or inner is None:
            return False
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in LEAN_ROPE or getattr(cfg, "hidden_act", None) != "silu":
            return False
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return False  # sliding-window layers
        if type(model).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            return False
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        linears = [model.lm_head] + [
            getattr(part, n, None)
            for layer in inner.layers
            for part in (layer.self_attn, layer.mlp)
            for n in names
        ]
        return all(  # PEFT wrappers, quantized layers, bf16 or GPU weights: the library forward
            type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
            for m in linears
            if m is not None
        )

    def empty(self, total: int) -> LeanState:
        """Zeroed buffers and RoPE tables for `total` positions, nothing cached yet."""
        ref = self.inner.embed_tokens.weight
        shape = (1, self.kv_heads, total, self.head_dim)
        keys = [ref.new_zeros(shape) for _ in self.layers]
        values = [ref.new_zeros(shape) for _ in self.layers]
        cos, sin = self.inner.rotary_emb(ref[:1], torch.arange(total, device=ref.device)[None])
        return LeanState(keys, values, cos[0], sin[0], 0)

    def start(self, cache, total: int) -> LeanState:
        """Take over `cache` (the prompt's K/V), with room for `total` positions in all."""
        pos = cache.get_seq_length()
        if len(cache.layers) != len(self.layers) or pos >= total:
            raise ValueError(f"cache of {len(cache.layers)} layers, {pos} positions: cannot hold {total}")
        state = self.empty(total)
        for k, v, layer in zip(state.keys, state.values, cache.layers, strict=True):
            k[:, :, :pos], v[:, :, :pos] = layer.keys, layer.values
        state.pos = pos
        return state

    def step(self, state: LeanState, token: int) -> torch.Tensor:
        heads, kv, dim, half, pos = self.heads, self.kv_heads, self.head_dim, self.half, state.pos
        if pos >= state.cos.shape[0]:
            raise ValueError(f"position {pos} is past the {state.cos.shape[0]} the buffers were made for")
        cos, sin = state.cos[pos], state.sin[pos]
        h = self.inner.embed_tokens.weight[token].view(1, 1, -1)
        for i, (w1, eps1, q, k, v, o, qk_norm, w2, eps2, gate, up, down) in enumerate(self.layers):
            x = w1 * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps1))
            qs, ks = q(x).view(heads, dim), k(x).view(kv, dim)
            if qk_norm is not None:
                wq, wk, eps = qk_norm
                qs = wq * (qs * torch.rsqrt(qs.pow(2).mean(-1, keepdim=True) + eps))
                ks = wk * (ks * torch.rsqrt(ks.pow(2).mean(-1, keepdim=True) + eps))
            qk = torch.cat((qs, ks))
            qk = qk * cos + torch.cat((-qk[:, half:], qk[:, :half]), -1) * sin
            keys, values = state.keys[i], state.values[i]
            keys[0, :, pos] = qk[heads:]
            values[0, :, pos] = v(x).view(kv, dim)
            a = F.scaled_dot_product_attention(
                qk[:heads].view(1, heads, 1, dim),
                keys[:, :, : pos + 1],
                values[:, :, : pos + 1],
                enable_gqa=heads != kv,
            )
            h = h + o(a.view(1, 1, -1))
            x = w2 * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps2))
            h = h + down(F.silu(gate(x)) * up(x))
        w, eps = self.norm
        h = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
        state.pos = pos + 1
        return self.head(h)[0, -1]


def lean_step(model: nn.Module) -> LeanStep | None:
    """A `LeanStep` over the model's modules as they are now, or None where the library forward runs.

    Made per decode, not kept on the model: PEFT wraps, packing replaces and `.to()` converts
    modules in place, and a kept step would go on calling the modules it was made over."""
    return LeanStep(model) if LeanStep.supports(model) else None


@torch.no_grad()
def ar_decode(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    banned: int | None = None,
    lean: bool = True,
) -> Decoded:
    """Greedy decoding of one prompt; `banned` is a token id never emitted (a student's added mask
    row); `lean=False` keeps the library forward for every step (a reference)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    eos = set(eos_ids)
    ids = torch.tensor([prompt], device=device)
    fast = lean_step(model) if lean and not model.training else None  # no dropout in the lean step
    state = None
    out: list[int] = []
    while len(out) < max_new_tokens:
        if state is not None:
            logits = fast.step(state, out[-1])
        else:
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            if fast is not None:
                state = fast.start(cache, len(prompt) + max_new_tokens)
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
            "transformers' prompt lookup refuses stateful (hybrid) models: use the decoder spec:lookup"
        )
    return hf_generate(model, prompt, max_new_tokens, eos_ids, pad_id, prompt_lookup_num_tokens=tokens)
