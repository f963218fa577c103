"""Decode benchmark: the demo head's samplers against the AR teacher with its KV cache, in one run.

    python benchmarks/decode.py [--config configs/demo.yaml] [--store ./a2d-store] [--samples N]

Needs the demo's head artifact (`make demo`, or `a2d run configs/demo.yaml --until head`). On the
held-out prompts it times, interleaved prompt by prompt so machine load hits every sampler alike:
AR greedy (the teacher, KV cache), transformers' prompt-lookup decoding, lossless self-speculative
decoding with the head (alone, and with n-gram lookup drafts where the context repeats), and threshold decoding with and without the exact prefix cache. Writes
benchmarks/results/decode.json with ratios (speed-ups are tokens/s ratios measured in this run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--store", default=None)
    ap.add_argument("--samples", type=int, default=0, help="held-out prompts (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threshold", type=float, default=0.9)
    args = ap.parse_args()
    import torch
    from tqdm.auto import tqdm

    from a2d.models.block_decode import ar_decode, speculative_decode, threshold_decode
    from a2d.models.generate import eos_ids
    from a2d.stores.readers import read_held_out
    from a2d.tasks import teacher as teacher_stage
    from a2d.tasks.students import load_student
    from benchmarks.common import built, write_result

    cfg, refs, store = built(args.config, args.store, "head")
    rows = read_held_out(store, refs["responses"])
    rows = rows[: args.samples] if args.samples else rows
    teacher, tok = teacher_stage.tm.load_teacher(
        teacher_stage.local_dir(store, refs["teacher"]), device="cpu"
    )
    student, dspec = load_student(store, refs["head"])
    eos, n = eos_ids(teacher, tok), args.max_new_tokens

    def base_generate(prompt, lookup=0):
        with student.base() as model:
            return ar_decode(model, prompt, n, eos, tok.pad_token_id, lookup)

    alignment = dspec["logit_alignment"]
    samplers = {  # prompt -> Decoded
        "ar:greedy": lambda p: ar_decode(teacher, p, n, eos, tok.pad_token_id),
        "ar:student-base": base_generate,
        "ar:prompt-lookup": lambda p: base_generate(p, lookup=10),
        "spec:head": lambda p: speculative_decode(student, p, n, eos),
        "spec:head+lookup": lambda p: speculative_decode(student, p, n, eos, lookup=3),
        # fewer masks per forward: cheaper forwards where cost grows with tokens (a CPU), shorter drafts
        "spec:head(draft_len=1)": lambda p: speculative_decode(student, p, n, eos, draft_len=1),
        "spec:head+lookup(draft_len=2)": lambda p: speculative_decode(
            student, p, n, eos, lookup=3, draft_len=2
        ),
        "threshold:cached": lambda p: threshold_decode(
            student, p, n, args.threshold, eos, alignment, cached=True
        ),
        "threshold:uncached": lambda p: threshold_decode(
            student, p, n, args.threshold, eos, alignment, cached=False
        ),
    }
    stats = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0, "outputs": []} for name in samplers}
    with torch.no_grad():
        samplers["ar:greedy"](rows[0]["prompt_ids"])  # warm-up, not timed
        for r in tqdm(rows, desc="decode benchmark", unit="prompt"):
            for name, fn in samplers.items():
                start = time.perf_counter()
                out = fn(r["prompt_ids"])
                st = stats[name]
                st["seconds"] += time.perf_counter() - start
                st["tokens"] += len(out.tokens)
                st["forwards"] += out.forwards
                st["outputs"].append(out.tokens)
    # What a forward costs as it is fed more tokens (the base, over a 64-token cache): a speculative
    # forward pays this for its drafts and masks, so its tokens per forward must beat the ratio.
    from transformers import DynamicCache

    cost = {}
    with torch.no_grad(), student.base() as model:
        context = torch.tensor([rows[0]["prompt_ids"][:64]])
        for fed in (1, 2, 4, 8, 16):
            times = []
            for _ in range(5):
                cache = DynamicCache()
                model(context, past_key_values=cache, use_cache=True)
                start = time.perf_counter()
                model(context[:, :fed], past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - start)
            cost[fed] = sorted(times)[len(times) // 2]
    forward_cost_vs_one_token = {str(k): round(v / cost[1], 3) for k, v in cost.items()}
    for st in stats.values():
        st["tpf"] = round(st["tokens"] / max(st["forwards"], 1), 4)
        st["tokens_per_s"] = round(st["tokens"] / st["seconds"], 3)
    base = stats["ar:student-base"]["outputs"]
    mismatches = {
        name: sum(a != b for a, b in zip(stats[name]["outputs"], base, strict=True))
        for name in stats
        if name.startswith("spec:") or name == "ar:prompt-lookup"
    }
    ar = stats["ar:greedy"]["tokens_per_s"]
    write_result(
        "decode",
        {
            "config": Path(args.config).name,
            "head_key": refs["head"].key,
            "samples": len(rows),
            "max_new_tokens": n,
            "threshold": args.threshold,
            "spec_tpf": stats["spec:head"]["tpf"],
            "spec_speedup_vs_ar": round(stats["spec:head"]["tokens_per_s"] / ar, 4),
            "spec_lookup_tpf": stats["spec:head+lookup"]["tpf"],
            "spec_lookup_speedup_vs_ar": round(stats["spec:head+lookup"]["tokens_per_s"] / ar, 4),
            "best_spec_speedup_vs_ar": max(
                round(st["tokens_per_s"] / ar, 4) for name, st in stats.items() if name.startswith("spec:")
            ),
            "prompt_lookup_speedup_vs_ar": round(stats["ar:prompt-lookup"]["tokens_per_s"] / ar, 4),
            "cached_speedup_vs_uncached": round(
                stats["threshold:cached"]["tokens_per_s"] / stats["threshold:uncached"]["tokens_per_s"], 4
            ),
            "lossless_mismatches": mismatches,
            "forward_cost_vs_one_token": forward_cost_vs_one_token,
            "samplers": {k: {f: v for f, v in s.items() if f != "outputs"} for k, s in stats.items()},
            "rules": "a forward is one model call (draft+verify counts once); tokens are response tokens incl. EOS",
        },
    )


if __name__ == "__main__":
    main()
