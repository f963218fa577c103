"""Anchors benchmark: stage throughput vs bare forward, stored bytes vs raw bf16, int8 fidelity.

    python benchmarks/anchors.py [--model smollm2|tiny] [--samples 32] [--seq-len 128]

Writes benchmarks/results/anchors.json. Everything is measured in one run on the same model and
batches; the results are ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from a2d.models.quant import cosine_stats, dequantize_int8, from_bf16_bits, quantize_int8  # noqa: E402
from a2d.models.teacher import decoder_layers  # noqa: E402
from a2d.stores.anchors import write_shard  # noqa: E402
from a2d.stores.artifacts import hash_local_tree  # noqa: E402
from a2d.tasks.anchors import capture_shard  # noqa: E402
from benchmarks.common import teacher, token_batches, write_result  # noqa: E402


def bare_forward(model, seqs: list[list[int]], batch: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            model(torch.tensor(seqs[i : i + batch]))
    return time.perf_counter() - start


def anchors_stage(
    model, seqs, batch, layers, pad_id, out: Path, dtype: str, k: int, tokens: str
) -> tuple[float, int, object]:
    """Capture + encode + write + checksum, as the stage does for one shard; returns (seconds, bytes, capture).

    Each sequence is split in half: the first half is the prompt, the second the response.
    """
    start = time.perf_counter()
    half = len(seqs[0]) // 2
    cap = capture_shard(
        model, [s[:half] for s in seqs], [s[half:] for s in seqs], layers, tokens, pad_id, batch
    )
    hidden = quantize_int8(from_bf16_bits(cap.bits), k=k) if dtype == "int8" else cap.bits
    ids = [f"s{i}" for i in range(len(seqs))]
    write_shard(out, hidden, cap.offsets, ids, cap.positions, cap.confidence, cap.entropy, {"dtype": dtype})
    hash_local_tree(out)
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return seconds, size, cap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--outliers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    model, tok = teacher(args.model)
    seqs = token_batches(tok, args.samples, args.seq_len)
    n_layers = len(decoder_layers(model))
    layers = list(range(n_layers))
    hidden = model.config.hidden_size
    tmp = Path(tempfile.mkdtemp(prefix="a2d-bench-anchors-"))
    bare_forward(model, seqs[: args.batch], args.batch)  # warm-up
    result = {
        "model": args.model,
        "layers": n_layers,
        "hidden": hidden,
        "sequences": args.samples,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "repeats": args.repeats,
        "int8_outlier_channels": args.outliers,
        "targets": {
            "throughput_ratio": ">= 0.85",
            "bytes_ratio_bf16": "<= 1.0",
            "bytes_ratio_int8": "<= 0.52",
            "int8_cosine": ">= 0.9999",
        },
    }
    for tokens in ("response", "all"):
        bare, stage = [], []
        for r in range(args.repeats):  # interleaved so that machine noise hits both alike
            bare.append(bare_forward(model, seqs, args.batch))
            out = tmp / f"bf16-{tokens}-{r}.zarr"
            s, size_bf16, cap = anchors_stage(
                model, seqs, args.batch, layers, tok.pad_token_id, out, "bf16", 0, tokens
            )
            stage.append(s)
            shutil.rmtree(out)
        _, size_int8, _ = anchors_stage(
            model,
            seqs,
            args.batch,
            layers,
            tok.pad_token_id,
            tmp / f"int8-{tokens}.zarr",
            "int8",
            args.outliers,
            tokens,
        )
        stored = int(cap.offsets[-1])
        raw = stored * n_layers * hidden * 2
        suffix = "" if tokens == "response" else "_all_tokens"
        result[f"throughput_ratio{suffix}"] = round(float(np.median(bare) / np.median(stage)), 4)
        result[f"bytes_ratio_bf16{suffix}"] = round(size_bf16 / raw, 4)
        result[f"bytes_ratio_int8{suffix}"] = round(size_int8 / raw, 4)
        result[f"stored_tokens{suffix}"] = stored
        result[f"forward_tokens_per_s_bare{suffix}"] = round(
            args.samples * args.seq_len / float(np.median(bare)), 1
        )
        result[f"forward_tokens_per_s_anchors{suffix}"] = round(
            args.samples * args.seq_len / float(np.median(stage)), 1
        )
        if tokens == "response":
            ref = from_bf16_bits(cap.bits).float()
            cos = cosine_stats(ref, dequantize_int8(quantize_int8(ref, k=args.outliers)))
            result["int8_cosine"] = round(cos["mean_cos"], 7)
            result["int8_min_cosine"] = round(cos["min_cos"], 7)
    shutil.rmtree(tmp)
    result["tokens"] = result["stored_tokens"]
    write_result("anchors", result)


if __name__ == "__main__":
    main()
