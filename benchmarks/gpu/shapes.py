"""Random-weight models of the real Qwen3.6-27B shape (nothing downloaded), and a tiny flavour for CPU.

The 27B numbers are those of the `qwen3_5` 27B configuration (64 layers, hidden 5120, FFN 17408,
24 query / 4 KV heads of 256, vocab 248,320); the Gated DeltaNet head counts (16 key / 48 value heads
of 128) are our assumption of the released config and are recorded in every result.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def arguments() -> argparse.ArgumentParser:
    """The options every GPU script takes: --tiny, --out, --seq-len."""
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU (keeps the script from rotting)"
    )
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "results"),
        help="folder for the JSON result",
    )
    ap.add_argument("--seq-len", type=int, default=1024)
    return ap


@dataclass
class Setup:
    shape: str  # "27b" or "tiny"
    seq: int
    device: str
    model: Qwen3_5ForCausalLM
    params: int


def setup(args: argparse.Namespace) -> Setup:
    """The model and sequence length the parsed `arguments()` ask for, built on the device."""
    shape = "tiny" if args.tiny else "27b"
    device = device_kind(args.tiny)
    model = build(shape, device)
    return Setup(shape, 64 if args.tiny else args.seq_len, device, model, params(model))


def report(name: str, result: dict[str, Any], out: str) -> Path:
    """Write `<out>/gpu_<name>_<shape>.json` and print the result as a short table."""
    path = Path(out) / f"gpu_{name}_{result['shape']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print("\n".join(f"{k:>22}  {v}" for k, v in result.items()))
    return path
