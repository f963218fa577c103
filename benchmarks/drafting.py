"""Drafting benchmark: the DFlash drafter against the AR teacher, spec:head and prompt lookup, in one run.

    python benchmarks/drafting.py [--config configs/demo.yaml] [--store ./a2d-store] [--samples N]

Needs the demo's drafter and head artifacts (`make demo`). On the held-out prompts it decodes with
`ar:greedy` (the teacher with its KV cache), `spec:drafter`, `spec:head`, `ar:prompt-lookup` (a2d's
loop) and `hf:prompt-lookup` (transformers'), interleaved prompt by prompt so machine load hits each
alike. Writes benchmarks/results/drafting.json:

- `lossless_mismatches`: decoder -> prompts whose tokens differ from the student's base (greedy).
- `tau`: spec:drafter's tokens per verify forward, the verify's own token included.
- `tpf_base_forwards` / `tpf_all_forwards`: tokens per base (verify) forward / per model call
  (the drafter's forwards count in the second).
- `acceptance_by_offset[k]`: of the verify forwards whose drafts reached offset k (a tree: its
  depth), the share where drafts 1..k all held (held-out, decode time).
- `tree_nodes` / `drafts_per_verify`: the drafts spec:drafter feeds a verify forward as a tree (the
  device profile's budget; 0 = one chain) and how many it fed on average.
- `drafter_cost_vs_base_forward`: mean seconds of one drafter forward ÷ mean seconds of one verify
  forward in the same decodes.
- `*_speedup_vs_ar`: tokens/s ÷ ar:greedy's, with a 95 % bootstrap interval over prompts.
- `tau_teacher_forced` / `tau_teacher_forced_decode_chain`: every held-out row's τ with the teacher's
  own continuation (from the anchors), over every block start / over the starts a greedy decode meets
  (each block where the last one stopped: right after a rejection, where drafting is hardest).
- `training_seconds` and `tau_curve_teacher_forced`: from the drafter artifact: held-out τ with the
  teacher's own continuation at three training budgets (steps and seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DECODERS = [
    "ar:greedy",
    "ar:student-base",
    "spec:drafter",
    "spec:head",
    "ar:prompt-lookup",
    "hf:prompt-lookup",
]


def bootstrap_ratio(num_tokens, num_secs, den_tokens, den_secs, reps: int = 2000) -> list[float]:
    """95 % interval of (Σ tokens / Σ seconds) ratios, resampling prompts."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = len(num_tokens)
    nt, ns, dt, ds = map(np.asarray, (num_tokens, num_secs, den_tokens, den_secs))
    idx = rng.integers(0, n, (reps, n))
    ratios = (nt[idx].sum(1) / ns[idx].sum(1)) / (dt[idx].sum(1) / ds[idx].sum(1))
    return [round(float(np.percentile(ratios, 2.5)), 4), round(float(np.percentile(ratios, 97.5)), 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--store", default=None)
    ap.add_argument("--samples", type=int, default=0, help="held-out prompts (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    import torch
    from tqdm.auto import tqdm

    from a2d.models import decoders as registry
    from a2d.models.generate import eos_ids
    from a2d.models.speculative import DFlashDraft
    from a2d.stores.readers import read_held_out
    from a2d.tasks import teacher as teacher_stage
    from a2d.tasks.students import load_drafter, load_student
    from benchmarks.common import built, write_result

    cfg, refs, store = built(args.config, args.store, "head")
    if "drafter" not in refs or not store.is_complete(refs["drafter"]):
        raise SystemExit(f"no complete drafter artifact: run `a2d run {args.config} --until drafter` first")
    rows = read_held_out(store, refs["responses"])
    rows = rows[: args.samples] if args.samples else rows
    teacher, tok = teacher_stage.tm.load_teacher(
        teacher_stage.local_dir(store, refs["teacher"]), device="cpu"
    )
    student, dspec = load_student(store, refs["head"])
    drafter = load_drafter(store, refs["drafter"], refs["teacher"])
    eos, n = eos_ids(teacher, tok), args.max_new_tokens
    res = registry.Resources(
        student,
        eos,
        n,
        teacher=teacher,
        drafter=drafter,
        pad_id=tok.pad_token_id,
        logit_alignment=dspec.logit_alignment,
    )
    names = [m for m in DECODERS if not registry.missing(registry.describe(m), res)]
    decoders = {m: registry.build(m, res) for m in names}
    drafts: list[DFlashDraft] = []  # the spec:drafter decodes' drafters (their own forward seconds)
    original_init = DFlashDraft.__init__

    def keep(self, *a, **k):
        original_init(self, *a, **k)
        drafts.append(self)

    stats = {m: {"tokens": [], "seconds": [], "outputs": [], "records": []} for m in names}
    with torch.no_grad():
        decoders["ar:greedy"](rows[0]["prompt_ids"])  # warm-up
        DFlashDraft.__init__ = keep
        try:
            for r in tqdm(rows, desc="drafting benchmark", unit="prompt"):
                for m in names:
                    start = time.perf_counter()
                    out = decoders[m](r["prompt_ids"])
                    st = stats[m]
                    st["seconds"].append(time.perf_counter() - start)
                    st["tokens"].append(len(out.tokens))
                    st["outputs"].append(out.tokens)
                    st["records"].append(out)
        finally:
            DFlashDraft.__init__ = original_init
    base = stats["ar:student-base"]["outputs"]
    ar = stats["ar:greedy"]
    ar_rate = sum(ar["tokens"]) / sum(ar["seconds"])
    summary, speedup, interval = {}, {}, {}
    for m, st in stats.items():
        tokens, forwards = sum(st["tokens"]), sum(o.forwards for o in st["records"])
        rate = tokens / sum(st["seconds"])
        speedup[m] = round(rate / ar_rate, 4)
        interval[m] = bootstrap_ratio(st["tokens"], st["seconds"], ar["tokens"], ar["seconds"])
        summary[m] = {"tokens": tokens, "forwards": forwards, "tokens_per_s": round(rate, 3)}
    lossless = [
        m for m in names if registry.describe(m).lossless and m not in ("ar:greedy", "ar:student-base")
    ]
    mismatches = {m: sum(a != b for a, b in zip(stats[m]["outputs"], base, strict=True)) for m in lossless}

    recs = stats["spec:drafter"]["records"]
    verifies = sum(len(o.drafted) for o in recs)
    drafter_forwards = sum(d.forwards for d in drafts)
    tokens = sum(len(o.tokens) for o in recs)
    block = drafter.config.block_size
    reached, held = [0] * (block - 1), [0] * (block - 1)
    for o in recs:
        for depth, a in zip(o.reach, o.accepted, strict=True):  # a tree's depth, a chain's length
            for k in range(depth):
                reached[k] += 1
                held[k] += a > k
    drafter_seconds = sum(d.seconds for d in drafts)
    verify_seconds = sum(stats["spec:drafter"]["seconds"]) - drafter_seconds
    # the same held-out rows with the teacher's own continuation: every block start, and the starts a
    # greedy decode meets (right after its rejections), from the stored anchors
    from a2d.stores.anchors import AnchorReader
    from a2d.tasks.drafter import frozen_parts, load_sequences, teacher_forced

    seqs = load_sequences(
        AnchorReader(store, refs["anchors"]), rows, list(drafter.config.target_layer_ids), torch.float32
    )
    forced = teacher_forced(
        drafter,
        frozen_parts(teacher, drafter.draft_vocab, "cpu"),
        seqs,
        block,
        drafter.config.mask_token_id,
        "cpu",
    )
    manifest = store.manifest(refs["drafter"])
    marker = manifest["shards"]["drafter"]
    spec = manifest["spec"]
    per_step = marker["train_seconds"] / spec["steps"]
    write_result(
        "drafting",
        {
            "config": Path(args.config).name,
            "drafter_key": refs["drafter"].key,
            "head_key": refs["head"].key,
            "samples": len(rows),
            "max_new_tokens": n,
            "block_size": block,
            "target_layer_ids": list(drafter.config.target_layer_ids),
            "draft_vocab": None if drafter.draft_vocab is None else len(drafter.draft_vocab),
            "lossless_mismatches": mismatches,
            "tau": round(tokens / verifies, 4),
            "tree_nodes": registry.profile_for("cpu").tree_nodes,
            "drafts_per_verify": round(sum(sum(o.drafted) for o in recs) / verifies, 3),
            "tau_teacher_forced": forced["tau"],
            "tau_teacher_forced_decode_chain": forced["tau_decode_chain"],
            "teacher_forced_rows": len(seqs),
            "tpf_base_forwards": round(tokens / verifies, 4),
            "tpf_all_forwards": round(tokens / (verifies + drafter_forwards), 4),
            "acceptance_by_offset": [
                round(h / r, 4) if r else None for h, r in zip(held, reached, strict=True)
            ],
            "drafter_cost_vs_base_forward": round(
                (drafter_seconds / max(drafter_forwards, 1)) / (verify_seconds / max(verifies, 1)), 4
            ),
            "drafter_speedup_vs_ar": speedup["spec:drafter"],
            "spec_head_speedup_vs_ar": speedup.get("spec:head"),
            "prompt_lookup_speedup_vs_ar": speedup.get("ar:prompt-lookup"),
            "hf_prompt_lookup_speedup_vs_ar": speedup.get("hf:prompt-lookup"),
            "speedup_vs_ar": speedup,
            "speedup_vs_ar_ci95": interval,
            "training_seconds": marker["train_seconds"],
            "training_steps": spec["steps"],
            "tau_curve_teacher_forced": [
                {**p, "seconds": round(p["step"] * per_step, 1)} for p in marker.get("curve", [])
            ],
            "decoders": summary,
            "rules": (
                "tokens are response tokens incl. EOS; tau = spec:drafter tokens / verify forwards (the verify's own "
                "token included); a forward is every model call (drafter forwards count in tpf_all_forwards); "
                "speed-ups are tokens/s ÷ ar:greedy (the teacher with its KV cache) in this run, interleaved per "
                "prompt, with 95% bootstrap intervals over prompts; prompt_lookup is a2d's ar:prompt-lookup "
                "(hf_prompt_lookup is transformers')"
            ),
        },
    )


if __name__ == "__main__":
    main()
