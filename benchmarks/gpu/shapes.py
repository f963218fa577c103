"""Random-weight models of the real Qwen3.6-27B shape (nothing downloaded), and a tiny flavour for CPU.

The 27B numbers are those of the `qwen3_5` 27B configuration (64 layers, hidden 5120, FFN 17408,
24 query / 4 KV heads of 256, vocab 248,320); the Gated DeltaNet head counts (16 key / 48 value heads
of 128) are our assumption of the released config and are recorded in every result.
"""

from __future__ import annotations

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

SHAPES = {
    "27b": dict(
        vocab_size=248_320,
        hidden_size=5120,
        intermediate_size=17_408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
    "tiny": dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}


def build(shape: str, device: str, dtype: torch.dtype = torch.bfloat16) -> Qwen3_5ForCausalLM:
    """Random weights created directly on `device` in `dtype` (a 27B model never exists in fp32)."""
    config = Qwen3_5TextConfig(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=8192)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def device_kind(tiny: bool) -> str:
    if tiny or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def peak_memory_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
