"""One verify+draft forward of self-speculative decoding against one AR step, at the Qwen3.6-27B shape.

    python benchmarks/gpu/decode_27b.py [--tiny] [--out DIR] [--seq-len 1024] [--block 16]

Random weights, so no draft is ever right and the speed-up itself means nothing here; what this
measures is the cost side of the trade: after a prefill of `--seq-len` prompt tokens into the
exact cache, the seconds of one AR step (1 new token) and of one speculative forward (the newest
token + `block` drafts + `block` masks, the Gated DeltaNet states saved after every draft for the
rollback). A lossless decoder's speed-up is accepted tokens per forward / (spec forward / AR step).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from a2d.models.canvas import Canvas  # noqa: E402
from a2d.models.student_build import make_student  # noqa: E402
from a2d.models.teacher import byte_tokenizer  # noqa: E402
from benchmarks.gpu.shapes import arguments, peak_memory_gb, report, setup, sync  # noqa: E402


def timed(device: str, prepare, step, repeats: int) -> float:
    """Median seconds of `step(prepare())` over `repeats` runs after one warm-up; `prepare` is not timed."""
    step(prepare())
    times = []
    for _ in range(repeats):
        state = prepare()
        sync(device)
        t0 = time.perf_counter()
        step(state)
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = arguments()
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    run = setup(args)
    device, block = run.device, (4 if args.tiny else args.block)
    student = make_student(
        run.model,
        byte_tokenizer(),
        "none",
        {"rank": 16, "alpha": 32, "dropout": 0.0, "rslora": False},
        "block",
        "bidirectional",
        block,
        "masked",
    )
    student.model.eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 250, (run.seq,), generator=gen).tolist()
    mask = student.info.mask_id
    drafts = torch.randint(3, 250, (block,), generator=gen).tolist()

    def prefilled() -> Canvas:
        canvas = Canvas(student, prompt, cached=True)
        with torch.no_grad():
            canvas.forward([], [])
            canvas.keep(-1)
        return canvas

    def ar_step(canvas: Canvas) -> None:
        with torch.no_grad():  # one new token: the base model, no open positions
            canvas.forward([], [])

    def spec_forward(canvas: Canvas) -> None:
        with torch.no_grad():
            canvas.forward(drafts, [mask] * block)
            canvas.keep(block // 2)  # roll back past a rejected draft

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ar = timed(device, prefilled, ar_step, args.repeats)
    spec = timed(device, prefilled, spec_forward, args.repeats)
    result = {
        "shape": run.shape,
        "device": device,
        "params": run.params,
        "prompt_tokens": run.seq,
        "block": block,
        "ar_step_seconds": round(ar, 5),
        "spec_forward_seconds": round(spec, 5),
        "spec_forward_vs_ar_step": round(spec / ar, 3),
        "break_even_tokens_per_forward": round(spec / ar, 3),
        "peak_memory_gb": peak_memory_gb(device),
    }
    report("decode", result, args.out)


if __name__ == "__main__":
    main()
