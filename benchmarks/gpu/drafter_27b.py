"""GPU benchmark (d): the DFlash drafter at the Qwen3.6-27B shape (configs/qwen3.6-27b.yaml's drafter section).

    python benchmarks/gpu/drafter_27b.py [--tiny] [--seq-len 1024] [--batch 4]

Builds random weights of the 27B target (bf16) and of the drafter (5 layers, hidden 5120, block 16,
5 target layers), then measures in one run:
- a training step from stored-anchor-shaped inputs (no target forward in the loop): seconds and
  peak memory, with the target's frozen embedding and full 248k-row head in the loss;
- one drafter forward (a block of 16 over a cached context) vs one target verify forward of the
  same 16 tokens over the same context (the drafter's cost as a fraction of a target forward).
Writes benchmarks/results/gpu_drafter_27b.json (gpu_drafter_tiny.json with --tiny).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from a2d.models.drafter import DFlashDraftModel, position_weights  # noqa: E402
from a2d.models.objectives.drafter import Frozen, drafter_loss  # noqa: E402
from a2d.specs import DrafterSpec  # noqa: E402
from a2d.tasks.drafter import build_config, target_layers  # noqa: E402
from benchmarks.gpu.shapes import arguments, peak_memory_gb, report, setup, sync  # noqa: E402


def timed(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = arguments()
    ap.add_argument("--batch", type=int, default=4, help="responses per training step")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run = setup(args)
    model, device, seq = run.model, run.device, run.seq
    text = model.config
    block = 4 if args.tiny else 16
    spec = DrafterSpec(
        layers=1 if args.tiny else 5,
        feature_layers=2 if args.tiny else 5,
        block_size=block,
        blocks_per_sample=8 if args.tiny else 32,
        gamma=7.0,
        dtype="bfloat16",
    )
    layers = target_layers(spec, text.num_hidden_layers)
    cfg = build_config(spec, text, layers, mask_id=text.vocab_size - 1)  # the stage's own config builder
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg).to(device=device, dtype=torch.bfloat16)
    frozen = Frozen(
        model.get_input_embeddings().weight.detach(),
        model.get_output_embeddings().weight.detach(),
        None,
        None,
    )
    b, m, width = args.batch, spec.blocks_per_sample, seq
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn((b, width, len(layers) * text.hidden_size), generator=gen).to(device, torch.bfloat16)
    ctx_len = torch.full((b,), width, device=device)
    starts = torch.sort(torch.randint(width // 4, width - block, (b, m), generator=gen), 1).values.to(device)
    ids = torch.randint(0, text.vocab_size, (b, m, block), generator=gen).to(device)
    ids[:, :, 1:] = cfg.mask_token_id
    targets = torch.randint(0, text.vocab_size, (b, m, block - 1), generator=gen).to(device)
    weights = position_weights(block, spec.gamma)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    def train_step() -> None:
        loss, _ = drafter_loss(drafter, frozen, (feats, ctx_len, starts, ids, targets, None, None), weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_s = timed(train_step, device, args.repeats)
    train_peak = peak_memory_gb(device)

    # decode: the drafter's block over a cached context vs the target's verify of the same block
    drafter.eval()
    from transformers import DynamicCache

    context = torch.randint(0, text.vocab_size, (1, seq), generator=gen).to(device)
    verify_ids = torch.randint(0, text.vocab_size, (1, block), generator=gen).to(device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(context, cache=cache, use_cache=True, logits_to_keep=1)
        kv = drafter.context_kv(drafter.fuse(feats[:1]), torch.arange(width, device=device)[None])
        block_ids = torch.full((1, block), cfg.mask_token_id, device=device)
        positions = torch.arange(width, width + block, device=device)[None]
        import copy

        def draft_forward() -> None:
            states = drafter(frozen.embed[block_ids], positions, kv)[0, 1:]
            (states @ frozen.head.T).argmax(-1)

        def verify_forward() -> None:
            c = copy.deepcopy(cache)  # the same context every repeat (deep copy is outside the ratio below)
            model(verify_ids, cache=c, use_cache=True)

        def copy_only() -> None:
            copy.deepcopy(cache)

        draft_s = timed(draft_forward, device, args.repeats)
        verify_s = max(
            timed(verify_forward, device, args.repeats) - timed(copy_only, device, args.repeats), 1e-9
        )
    result = {
        "shape": run.shape,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "target_params": run.params,
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "drafter_layers": spec.layers,
        "target_layer_ids": layers,
        "block": block,
        "seq_len": seq,
        "train_batch": b,
        "train_blocks_per_step": b * m,
        "train_step_seconds": round(step_s, 4),
        "train_peak_memory_gb": round(train_peak, 2) if train_peak is not None else None,
        "drafter_forward_seconds": round(draft_s, 5),
        "target_verify_seconds": round(verify_s, 5),
        "drafter_vs_target_forward": round(draft_s / verify_s, 4),
    }
    report("drafter", result, args.out)


if __name__ == "__main__":
    main()
