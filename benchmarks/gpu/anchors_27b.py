"""GPU benchmark (a): anchors at Qwen3.6-27B shape in bf16.

    python benchmarks/gpu/anchors_27b.py [--tiny] [--batch 2] [--seq-len 1024]

Measures, in one run on the same batches: tokens/s of the anchors capture (all 64 layers' residual
stream to host memory as bf16 bits, then written to Zarr) vs a bare forward, and the bare forward's
achieved FLOP/s vs the bf16 bound (2 × parameters per token; H200 dense bf16 peak 989 TFLOP/s).
Writes benchmarks/results/gpu_anchors_27b.json (or gpu_anchors_tiny.json with --tiny).
JSON fields: shape, params, tokens, bare_tokens_per_s, anchors_tokens_per_s, anchors_vs_bare,
bare_tflops, mfu_vs_bf16_peak, peak_memory_gb.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from a2d.stores.anchors import write_shard  # noqa: E402
from a2d.tasks.anchors import capture_shard  # noqa: E402
from benchmarks.gpu.shapes import arguments, peak_memory_gb, report, setup, sync  # noqa: E402

H200_BF16_PEAK = 989e12


def main() -> None:
    ap = arguments()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run = setup(args)
    shape, seq, device, model, n_params = run.shape, run.seq, run.device, run.model, run.params
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, model.config.vocab_size, (args.batch, seq), generator=gen).tolist()
    tokens = args.batch * seq
    layers = list(range(model.config.num_hidden_layers))
    with torch.no_grad():
        model(torch.tensor(seqs, device=device))  # warm-up
    bare, anchors = [], []
    out = Path(tempfile.mkdtemp(prefix="a2d-gpu-anchors-"))
    for r in range(args.repeats):
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(torch.tensor(seqs, device=device))
        sync(device)
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        half = seq // 2
        cap = capture_shard(
            model, [s[:half] for s in seqs], [s[half:] for s in seqs], layers, "all", 0, args.batch
        )
        write_shard(
            out / f"r{r}.zarr",
            cap.bits,
            cap.offsets,
            [str(i) for i in range(args.batch)],
            cap.positions,
            cap.confidence,
            cap.entropy,
            {"dtype": "bf16"},
        )
        sync(device)
        anchors.append(time.perf_counter() - t0)
    bare_s, anchors_s = float(np.median(bare)), float(np.median(anchors))
    achieved = 2 * n_params * tokens / bare_s
    result = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "params": n_params,
        "tokens": tokens,
        "bare_tokens_per_s": round(tokens / bare_s, 1),
        "anchors_tokens_per_s": round(tokens / anchors_s, 1),
        "anchors_vs_bare": round(bare_s / anchors_s, 4),
        "bare_tflops": round(achieved / 1e12, 2),
        "mfu_vs_bf16_peak": round(achieved / H200_BF16_PEAK, 4) if device == "cuda" else None,
        "peak_memory_gb": peak_memory_gb(device),
    }
    report("anchors", result, args.out)


if __name__ == "__main__":
    main()
