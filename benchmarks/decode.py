"""Decode benchmark: registry decoders against the AR teacher with its KV cache, in one run.

    python benchmarks/decode.py [--config configs/demo.yaml] [--store ./a2d-store] [--samples N]

Needs the demo's head artifact (`make demo`, or `a2d run configs/demo.yaml --until head`); uses its
VFM and the drafter too when there are. On up to --per-set held-out prompts of each prompt set
(bundled, code, docs: `benchmarks/sets.py`) it decodes with every lossless decoder, interleaved prompt
by prompt so machine load hits each alike, and reports each set apart (`sets`), plus transformers' own greedy `generate` (the library
baseline a2d's AR loop must match, on the model as transformers builds it: no packed oneDNN linears,
`a2d.models.cpu_kernels`). Then it times single forwards: a speculative forward of n fed
tokens (newest + drafts + mask runs, the LM head over the rows a decoder reads) against a bare base
forward of the same n tokens (transformers' forward with its cache, logits for every row).
Writes benchmarks/results/decode.json; speed-ups are tokens/s ratios measured in this run.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DECODERS = [
    "ar:greedy",
    "ar:student-base",
    "ar:prompt-lookup",
    "hf:prompt-lookup",
    "spec:head",
    "spec:head+lookup",
    "spec:vfm",
    "spec:drafter",
    "spec:drafter+lookup",
]
FED = (2, 4, 9, 17)  # tokens fed to one forward in the overhead measurement
ROUNDS = 7  # interleaved rounds per fed size (the median ratio is reported: a shared VM's load drifts)


def spec_layout(n: int) -> tuple[int, list[int]]:
    """(drafts, masks per run) of a speculative forward fed n tokens: newest + drafts + one run per
    acceptance length, the masks spread evenly."""
    k = {1: 0, 2: 0, 4: 1, 9: 2}.get(n, 4)
    masks = n - 1 - k
    return k, [masks // (k + 1) + (i < masks % (k + 1)) for i in range(k + 1)]


def paired_ar_vs_generate(ar, generate, prompts: list[list[int]], rounds: int) -> dict:
    """a2d's AR decoder against transformers' `generate`, prompt by prompt: each prompt decoded
    `rounds` times by both, back to back in alternating order, and each side's fastest time kept
    (the cost without a neighbour's interference on a shared VM); the ratio is of tokens/s summed
    over the prompts. Both must emit the same tokens (counted where they do not)."""
    best_ar, best_gen, tokens, differ = 0.0, 0.0, 0, 0
    for i, prompt in enumerate(prompts):
        times = {"ar": [], "gen": []}
        outs = {}
        for r in range(rounds):
            for side in ("ar", "gen") if (i + r) % 2 == 0 else ("gen", "ar"):
                start = time.perf_counter()
                outs[side] = (ar if side == "ar" else generate)(prompt)
                times[side].append(time.perf_counter() - start)
        best_ar, best_gen = best_ar + min(times["ar"]), best_gen + min(times["gen"])
        tokens += len(outs["ar"])
        differ += outs["ar"] != outs["gen"]
    return {
        "ratio": round(best_gen / best_ar, 4),
        "ar_tokens_per_s": round(tokens / best_ar, 3),
        "generate_tokens_per_s": round(tokens / best_gen, 3),
        "prompts": len(prompts),
        "rounds": rounds,
        "token_sequences_differing": differ,
    }


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def forward_overhead(
    student, teacher, context: list[int], reps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """n -> (speculative forward of n fed tokens) / (bare base forward of n tokens), same cached
    context; and n -> bare forward of n tokens / bare forward of one token (what feeding costs)."""
    import torch
    from transformers import DynamicCache

    from a2d.models.canvas import Canvas, truncate_attention
    from a2d.models.student import lm_head

    mask, head = student.info.mask_id, lm_head(student)
    canvas = Canvas(student, context, cached=True)
    canvas.forward([], [])
    canvas.keep(-1)  # the cache holds the context but its newest token, which every forward feeds
    cache = DynamicCache(config=teacher.config)
    teacher(torch.tensor([context[:-1]]), cache=cache, use_cache=True)
    out, bare = {}, {}
    for n in (1, *FED):
        k, runs = spec_layout(n)
        drafts = context[-k - 1 : -1] if k else []
        region = [mask] * sum(runs)
        layout = [(a, m) for a, m in enumerate(runs) if m]

        def spec_step(drafts=drafts, region=region, layout=layout, rows=k + 1 + runs[0]):
            hidden = canvas.forward(drafts, region, layout)
            head(hidden[:rows])  # the verify rows and one run's drafts
            canvas.keep(-1)

        def bare_step(ids=torch.tensor([context[-1:] + drafts + context[: n - 1 - k]])):
            teacher(ids, cache=cache, use_cache=True)
            truncate_attention(cache, len(context) - 1)

        spec_step() if n > 1 else None, bare_step()  # warm-up
        ratios, bare_t = [], []
        for _ in range(ROUNDS):  # interleaved rounds: each ratio pairs two medians taken side by side
            spec = median_time(spec_step, reps) if n > 1 else 0.0
            bare_t.append(median_time(bare_step, reps))
            ratios.append(spec / bare_t[-1])
        bare[n] = sorted(bare_t)[len(bare_t) // 2]
        if n > 1:
            out[str(n)] = round(sorted(ratios)[len(ratios) // 2], 4)
    return out, {str(n): round(t / bare[1], 4) for n, t in bare.items()}


def summarise(stats: dict, index: list[int]) -> dict[str, dict]:
    """Each decoder's totals over the prompts `index`: tokens, forwards, TPF, tokens/s, drafts."""
    out = {}
    for name, st in stats.items():
        recs = [st["records"][i] for i in index if st["records"][i] is not None]
        fed = [d for o in recs for d, ok in zip(o.drafted, o.draftable, strict=True) if ok]
        tokens = sum(st["tokens"][i] for i in index)
        forwards = sum(st["forwards"][i] for i in index)
        seconds = sum(st["seconds"][i] for i in index)
        out[name] = {
            "tokens": tokens,
            "forwards": forwards,
            "seconds": round(seconds, 3),
            "tpf": round(tokens / max(forwards, 1), 4),
            "tokens_per_s": round(tokens / seconds, 3),
            "mean_accepted_drafts": round(sum(a for o in recs for a in o.accepted) / len(fed), 4)
            if fed
            else None,
        }
        if fed:
            out[name]["no_draft_share"] = round(sum(d == 0 for d in fed) / len(fed), 4)
    return out


def set_figures(stats: dict, index: list[int], lossless: list[str], default: str | None) -> dict:
    """One prompt set's figures: every decoder's TPF and tokens/s x AR (95 % bootstrap interval over
    its prompts), mismatches of every lossless decoder, and the default decoder's headline."""
    from benchmarks.sets import speed

    sub = {n: {k: [v[i] for i in index] for k, v in st.items()} for n, st in stats.items()}
    summary = summarise(stats, index)
    base = sub["ar:greedy"]["outputs"]
    speeds = {n: speed(sub, n) for n in sub}
    for n in summary:
        summary[n].update(speeds[n])
    doc = {
        "prompts": len(index),
        "lossless_mismatches": {
            m: sum(a != b for a, b in zip(sub[m]["outputs"], base, strict=True)) for m in lossless
        },
        "decoders": summary,
        "hf_prompt_lookup_speedup_vs_ar": speeds.get("hf:prompt-lookup", {}).get("speedup_vs_ar"),
        "transformers_generate_speedup_vs_ar": speeds["transformers:generate"]["speedup_vs_ar"],
    }
    if default is not None:
        doc.update(
            default_decoder=default,
            default_speedup_vs_ar=speeds[default]["speedup_vs_ar"],
            default_speedup_vs_ar_ci95=speeds[default]["speedup_vs_ar_ci95"],
            default_tpf=summary[default]["tpf"],
        )
    if "spec:drafter" in summary:
        recs = sub["spec:drafter"]["records"]
        doc["tau"] = round(sum(len(o.tokens) for o in recs) / sum(len(o.drafted) for o in recs), 4)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--store", default=None)
    ap.add_argument(
        "--name", default="decode", help="results/NAME.json (another host's run beside the committed one)"
    )
    ap.add_argument("--per-set", type=int, default=6, help="held-out prompts per prompt set (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--pair-rounds", type=int, default=2, help="paired AR vs generate decodes per prompt")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per forward size")
    args = ap.parse_args()
    import torch
    from tqdm.auto import tqdm

    from a2d.models import decoders as registry
    from a2d.models.ar import hf_generate
    from a2d.stores.readers import read_held_out
    from a2d.tasks import teacher as teacher_stage
    from a2d.tasks.resources import newest_vfm, resources_from_store
    from benchmarks.common import built, write_result
    from benchmarks.sets import by_set

    cfg, refs, store = built(args.config, args.store, "head")
    sets = by_set(read_held_out(store, refs["responses"]), args.per_set)
    rows = [r for group in sets.values() for r in group]
    # transformers' generate runs on the model as transformers builds it (no packed oneDNN linears)
    library, _ = teacher_stage.tm.load_teacher(
        teacher_stage.local_dir(store, refs["teacher"]), device="cpu", packed=False
    )
    wanted = {"head": refs["head"], "teacher": refs["teacher"]}
    with suppress(ValueError):  # no vfm of this head: the benchmark runs without spec:vfm
        wanted["vfm"] = newest_vfm(store, refs["head"])
    if "drafter" in refs and store.is_complete(refs["drafter"]):
        wanted["drafter"] = refs["drafter"]
    n = args.max_new_tokens
    res, _, tok = resources_from_store(store, wanted, n)
    teacher, student, eos = res.teacher, res.student, res.eos
    decoders = {
        name: registry.build(name, res)
        for name in DECODERS
        if not registry.missing(registry.describe(name), res)
    }

    names = [*decoders, "transformers:generate"]
    stats = {
        name: {"tokens": [], "forwards": [], "seconds": [], "outputs": [], "records": []} for name in names
    }
    with torch.no_grad():
        # warm-up (kernels, caches; spec:drafter+lookup timed its verify forwards when it was built)
        for name in decoders:
            decoders[name](rows[0]["prompt_ids"][:8])
        hf_generate(library, rows[0]["prompt_ids"], n, eos, tok.pad_token_id)
        for r in tqdm(rows, desc="decode benchmark", unit="prompt"):
            for name in names:
                start = time.perf_counter()
                if name == "transformers:generate":
                    out = hf_generate(library, r["prompt_ids"], n, eos, tok.pad_token_id)
                    tokens, out = out.tokens, None
                else:
                    out = decoders[name](r["prompt_ids"])
                    tokens = out.tokens
                st = stats[name]
                st["seconds"].append(time.perf_counter() - start)
                st["tokens"].append(len(tokens))
                st["forwards"].append(out.forwards if out else len(tokens))
                st["outputs"].append(tokens)
                st["records"].append(out)
        paired = paired_ar_vs_generate(
            lambda p: decoders["ar:greedy"](p).tokens,
            lambda p: hf_generate(library, p, n, eos, tok.pad_token_id).tokens,
            [r["prompt_ids"] for r in rows],
            args.pair_rounds,
        )
        overhead, feeding = forward_overhead(
            student, teacher, rows[0]["prompt_ids"] + rows[0]["response_ids"], args.reps
        )
    lossless = [
        m for m in decoders if registry.describe(m).lossless and m not in ("ar:greedy", "ar:student-base")
    ]
    default = registry.default_decoder(res)
    everything = list(range(len(rows)))
    summary = summarise(stats, everything)
    overall = set_figures(stats, everything, lossless, default)
    ar = summary["ar:greedy"]["tokens_per_s"]
    speedup = {m: round(summary[m]["tokens_per_s"] / ar, 4) for m in summary}
    best = max((m for m in lossless if m.startswith("spec:") or m == "ar:prompt-lookup"), key=speedup.get)
    first, per_set = 0, {}
    for name, group in sets.items():
        per_set[name] = set_figures(stats, list(range(first, first + len(group))), lossless, default)
        first += len(group)
    write_result(
        args.name,
        {
            "config": Path(args.config).name,
            "head_key": refs["head"].key,
            "drafter_key": refs["drafter"].key if res.drafter is not None else None,
            "samples": len(rows),
            "max_new_tokens": n,
            "decode_profile": registry.profile_for("cpu").__dict__,
            "default_decoder": default,
            "sets": per_set,
            "lossless_mismatches": overall["lossless_mismatches"],
            "no_draft_share": {m: s["no_draft_share"] for m, s in summary.items() if "no_draft_share" in s},
            "spec_forward_overhead": overhead,
            "forward_cost_vs_one_token": feeding,
            "ar_vs_transformers_generate": paired["ratio"],
            "ar_vs_transformers_generate_paired": paired,
            "ar_vs_transformers_generate_in_decoder_loop": round(
                ar / summary["transformers:generate"]["tokens_per_s"], 4
            ),
            "spec_tpf": summary["spec:head"]["tpf"],
            "spec_head_speedup_vs_ar": speedup["spec:head"],
            "spec_lookup_tpf": summary["spec:head+lookup"]["tpf"],
            "spec_lookup_speedup_vs_ar": speedup["spec:head+lookup"],
            "best_lossless": best,
            "best_lossless_speedup_vs_ar": speedup[best],
            "prompt_lookup_speedup_vs_ar": speedup.get("hf:prompt-lookup"),
            "a2d_prompt_lookup_speedup_vs_ar": speedup["ar:prompt-lookup"],
            "speedup_vs_ar": speedup,
            "decoders": summary,
            "rules": (
                "a forward is every model call (verify, flow-map and drafter forwards); tokens are response tokens "
                "incl. EOS; speed-ups are tokens/s ÷ ar:greedy (the teacher, KV cache) on the same prompts in this "
                "run, every decoder interleaved prompt by prompt; sets[name] holds each prompt set's figures "
                "(bundled: the generator's held-out rows; code: functions of held-out stdlib modules; docs: "
                "passages of held-out pydoc topics; no training row shares a module or topic with them), each "
                "speed-up with a 95 % bootstrap interval over that set's prompts, mismatches against ar:greedy's "
                "tokens; tau is spec:drafter's tokens per verify forward; no_draft_share "
                "is over verify forwards that could carry drafts (not a prompt's first forward, not a 1-token "
                "budget); ar_vs_transformers_generate = tokens/s of ar:greedy ÷ transformers' greedy generate, each "
                "prompt decoded by both back to back in alternating order, pair_rounds times, the fastest time of "
                "each summed over the prompts (the single-pass ratio inside the decoder loop is kept beside it); "
                f"spec_forward_overhead[n] = median over {ROUNDS} interleaved rounds of (median time of one "
                "speculative forward fed n tokens, its LM head over the verify rows and one run) ÷ (median time of a "
                "bare forward of the base over n tokens on the same cache, logits for every row)"
            ),
        },
    )


if __name__ == "__main__":
    main()
