"""A block-diffusion drafter over the target's own hidden states, in the DFlash format.

The drafter is a small dense decoder (Qwen3-style layers) with no embedding and no LM head of its
own: it borrows the target's frozen input embedding and output head. It reads the target's residual
stream after K selected layers ("output of layer k", the anchors' capture point), fuses them

    context = hidden_norm(fc(concat(h_k1, ..., h_kK)))          (C, K*H) -> (C, H)

and every draft layer attends, bidirectionally, over [context keys/values ; block keys/values]: the
context enters each layer as extra keys and values (its own k_proj/v_proj, k_norm and RoPE at the
context positions), the block is `[last committed token, MASK x (B-1)]` at the next B positions, and
block position k (k >= 1) predicts the token at that position. One forward drafts B-1 tokens.

The checkpoint is what vLLM (`"method": "dflash"`) and SGLang (`--speculative-algorithm DFLASH`)
load: `config.json` (a Qwen3 config with `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers` and `dflash_config: {block_size, target_layer_ids, mask_token_id}`) and
`model.safetensors` with unprefixed names (`fc`, `hidden_norm`, `norm`, `layers.i.…`). a2d adds one
file engines ignore, `draft_vocab.safetensors`: the token ids a2d's own decoder restricts draft logits
to (a drafter trained with `vocab: train`); absent, drafts range over the whole vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
VOCAB = "draft_vocab.safetensors"


def spread_layers(num_target_layers: int, count: int) -> list[int]:
    """DFlash's default target layers: `count` layers spread evenly over [1, L - 3] (one: the middle)."""
    if count == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    return sorted({int(round(start + i * (end - start) / (count - 1))) for i in range(count)})


@dataclass(frozen=True)
class DrafterConfig:
    """Everything the drafter's shape and its pairing with the target depend on."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    def to_hf(self) -> dict[str, Any]:
        """config.json: every Qwen3 config field, plus DFlash's own."""
        from transformers import Qwen3Config

        qwen = Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False,
            attention_bias=False,
            use_cache=False,
        ).to_dict()
        qwen.update(
            architectures=[ARCHITECTURE],
            model_type="qwen3",
            rope_theta=self.rope_theta,  # beside rope_parameters: 4.x readers know only this spelling
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={
                "block_size": self.block_size,
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        )
        qwen.pop("transformers_version", None)
        return qwen

    @classmethod
    def from_hf(cls, doc: dict[str, Any]) -> DrafterConfig:
        """Read a DFlash config.json (ours or another trainer's); a clear error for anything else."""
        if ARCHITECTURE not in (doc.get("architectures") or []):
            raise ValueError(
                f"config.json architectures {doc.get('architectures')} is not [{ARCHITECTURE!r}]: not a DFlash drafter"
            )
        dflash = doc.get("dflash_config") or {}
        missing = [k for k in ("target_layer_ids", "mask_token_id") if k not in dflash]
        if missing:
            raise ValueError(
                f"config.json dflash_config lacks {missing}: not a complete DFlash drafter config"
            )
        rope = doc.get("rope_parameters") or {}
        heads = doc["num_attention_heads"]
        return cls(
            hidden_size=doc["hidden_size"],
            num_hidden_layers=doc["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=doc.get("num_key_value_heads", heads),
            head_dim=doc.get("head_dim") or doc["hidden_size"] // heads,
            intermediate_size=doc["intermediate_size"],
            vocab_size=doc["vocab_size"],
            block_size=int(dflash.get("block_size", doc.get("block_size"))),
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            num_target_layers=doc["num_target_layers"],
            mask_token_id=dflash["mask_token_id"],
            rms_norm_eps=doc.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", doc.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=doc.get("max_position_embeddings", 32768),
        )


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., n, head_dim) of the default (non-interleaved) rotary embedding at `positions` (..., n)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[..., None] * inv  # (..., n, d/2)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, n, d) rotated by cos/sin (B, n, d)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None].to(x.dtype) + turned * sin[:, None].to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, n, H) -> rotated keys and values (B, kv_heads, n, d)."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """Block queries over [context ; block]: x (B, Q, H), ctx_k/v (B, kv, C, d), mask (B, Q, C + Q) bool."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None] if mask is not None else None)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The drafter's own weights (no embedding, no LM head): `fc`, `hidden_norm`, `layers`, `norm`."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.draft_vocab: torch.Tensor | None = None  # token ids drafts are restricted to (a2d only)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 1.0 / math.sqrt(self.config.hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        for layer in self.layers:  # residual branches start small: the block starts near its embeddings
            nn.init.normal_(layer.self_attn.o_proj.weight, std=std / (2 * len(self.layers)))
            nn.init.normal_(layer.mlp.down_proj.weight, std=std / (2 * len(self.layers)))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(…, K*H) concatenated target layer outputs -> (…, H) context states."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(positions, self.config.head_dim, self.config.rope_theta)

    def context_kv(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's keys and values: context (B, C, H) fused states at positions (B, C)."""
        cos, sin = self.rope(positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """block (B, Q, H) input embeddings at positions (B, Q) over the context's keys/values;
        mask (B, Q, C + Q) bool (None: every query sees everything). Returns normed states (B, Q, H)."""
        cos, sin = self.rope(positions)
        x = block.to(self.fc.weight.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    # --- the checkpoint format -------------------------------------------------------------------

    def save(self, out: Path, extra: dict[str, Any] | None = None) -> None:
        """config.json + model.safetensors (+ draft_vocab.safetensors) into the directory `out`."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        doc = self.config.to_hf()
        doc["torch_dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        if extra:
            doc["a2d"] = extra
        (out / CONFIG).write_text(json.dumps(doc, indent=2, sort_keys=True))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(out / WEIGHTS))
        if self.draft_vocab is not None:
            save_file({"token_ids": self.draft_vocab.to(torch.int64).contiguous()}, str(out / VOCAB))

    def save_pretrained(self, out, safe_serialization: bool = True) -> None:
        """The trainer's checkpoint hook (`a2d.stores.checkpoints.save`): the same DFlash directory."""
        self.save(Path(out))

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu") -> DFlashDraftModel:
        """A drafter from the format alone (config.json and safetensors; no pickle)."""
        from safetensors.torch import load_file

        cfg_path, weights = Path(folder) / CONFIG, Path(folder) / WEIGHTS
        if not cfg_path.is_file() or not weights.is_file():
            raise FileNotFoundError(f"{folder} is not a DFlash drafter: it needs {CONFIG} and {WEIGHTS}")
        model = cls(DrafterConfig.from_hf(json.loads(cfg_path.read_text())))
        tensors = load_file(str(weights))
        expected = model.state_dict()
        wrong = sorted(set(tensors) ^ set(expected))
        if wrong:
            raise ValueError(
                f"{weights} does not match its config.json: unexpected or missing tensors {wrong[:6]}"
            )
        bad = [k for k, v in tensors.items() if v.shape != expected[k].shape]
        if bad:
            raise ValueError(f"{weights}: tensors {bad[:4]} have shapes that do not match config.json")
        dtype = next(iter(tensors.values())).dtype
        model.to(dtype).load_state_dict(tensors)
        vocab = Path(folder) / VOCAB
        if vocab.is_file():
            model.draft_vocab = load_file(str(vocab))["token_ids"]
        return model.to(device).eval()


def pick_mask_token(tok, rows: int) -> int:
    """The row of the target's embedding the drafter reads as MASK: the tokenizer's mask token, else
    the first embedding row past the tokenizer's vocabulary (padding rows), else the last row."""
    if getattr(tok, "mask_token_id", None) is not None and tok.mask_token_id < rows:
        return int(tok.mask_token_id)
    if len(tok) < rows:
        return len(tok)
    return rows - 1


def block_mask(starts: torch.Tensor, ctx_len: torch.Tensor, width: int, block: int) -> torch.Tensor:
    """Training attention for M blocks per sequence: (B, M*block, width + M*block) bool.

    Block m (its first token at position starts[b, m]) sees the context positions before its start
    (and inside the sequence, `ctx_len[b]`) and every position of its own block, nothing of the others:
    exactly what one decode step sees.
    """
    b, m = starts.shape
    ctx = torch.arange(width, device=starts.device)
    see_ctx = (ctx[None, None] < starts[..., None]) & (ctx[None, None] < ctx_len[:, None, None])  # (B, M, W)
    see_ctx = see_ctx.repeat_interleave(block, 1)  # (B, M*block, W)
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool, device=starts.device)] * m)
    return torch.cat([see_ctx, own[None].expand(b, -1, -1)], 2)


def position_weights(block: int, gamma: float) -> torch.Tensor:
    """CE weight of block offsets 1..block-1: exp(-(k-1)/γ) (the first draft matters most)."""
    k = torch.arange(1, block, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)
