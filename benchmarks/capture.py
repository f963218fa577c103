"""Capture benchmark: anchors kept in generation (`anchors.source: generation`) against a forward.

    python benchmarks/capture.py [--model smollm2|tiny] [--samples 30] [--max-new-tokens 64] [--repeats 2]

On one batch of chat-templated bundled prompts, greedy, interleaved `--repeats` times in one run:
transformers' `generate`, a2d's own loop (`generate_batch`) without and with the capture of the
demo's anchor layers, and the anchors stage's forward (`capture_shard`) over the same prompts and
responses. Writes benchmarks/results/capture.json: every time as a ratio to a2d's loop without the
capture, the share of generation + forward the capture saves, and whether tokens and states agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from a2d.models.generate import eos_ids, generate_batch, left_pad  # noqa: E402
from a2d.models.quant import from_bf16_bits  # noqa: E402
from a2d.models.teacher import decoder_layers  # noqa: E402
from a2d.stores import bundled  # noqa: E402
from a2d.tasks.anchors import capture_shard, captured_in_generation  # noqa: E402
from benchmarks.common import teacher, write_result  # noqa: E402

DEMO_LAYERS = [1, 10, 18, 23, 25, 27, 29]  # configs/demo.yaml's anchors.layers (SmolLM2: 30 layers)


def prompts(tok, n: int) -> list[list[int]]:
    rows = bundled.generate(n, seed=3, style="steps")
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--samples", type=int, default=30, help="one batch, as the demo's run.batch_size")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = teacher(args.model)
    n_layers = len(decoder_layers(model))
    layers = (
        [i for i in DEMO_LAYERS if i < n_layers]
        if args.model == "smollm2"
        else [0, n_layers // 2, n_layers - 1]
    )
    batch = prompts(tok, args.samples)
    eos, pad = eos_ids(model, tok), tok.pad_token_id
    ids, mask = left_pad(batch, pad, torch.device("cpu"))

    def hf():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
            eos_token_id=eos, pad_token_id=pad, temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    seconds: dict[str, list[float]] = {"hf_generate": [], "a2d": [], "a2d_capture": [], "forward": []}
    with torch.no_grad():
        generate_batch(model, batch[:2], 4, eos, pad)  # warm-up
        for _ in range(args.repeats):
            t, hf_rows = timed(hf)
            seconds["hf_generate"].append(t)
            t, plain = timed(lambda: generate_batch(model, batch, args.max_new_tokens, eos, pad))
            seconds["a2d"].append(t)
            t, got = timed(
                lambda: generate_batch(model, batch, args.max_new_tokens, eos, pad, capture=layers)
            )
            seconds["a2d_capture"].append(t)
            responses = got.response_ids
            t, ref = timed(lambda r=responses: capture_shard(model, batch, r, layers, "all", pad, len(batch)))
            seconds["forward"].append(t)
    cap = captured_in_generation(batch, got.response_ids, [(list(range(len(batch))), got.states)], "all")
    a, b = from_bf16_bits(cap.bits).float(), from_bf16_bits(ref.bits).float()
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).max().item()
    same_tokens = (
        all(row[: len(resp)] == resp for row, resp in zip(hf_rows, plain.response_ids, strict=True))
        and got.response_ids == plain.response_ids
    )
    med = {k: statistics.median(v) for k, v in seconds.items()}
    base = med["a2d"]
    result = {
        "model": args.model,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "response_tokens": sum(len(r) for r in plain.response_ids),
        "prompt_tokens": sum(len(p) for p in batch),
        "layers": layers,
        "repeats": args.repeats,
        "seconds_median": {k: round(v, 3) for k, v in med.items()},
        "vs_a2d_loop": {k: round(v / base, 4) for k, v in med.items()},
        # generation + anchors forward (source: forward) against generation with the capture
        "capture_time_vs_generate_then_forward": round(med["a2d_capture"] / (base + med["forward"]), 4),
        "tokens_equal_hf_generate": same_tokens,
        "states_max_rel_err_vs_forward": round(rel, 6),
    }
    write_result("capture", result)


if __name__ == "__main__":
    main()
