"""Drafting benchmark: the DFlash drafter on each prompt set, against AR and prompt lookup, in one run.

    python benchmarks/drafting.py [--config configs/demo.yaml] [--store ./a2d-store] [--per-set N]

Needs the demo's drafter and head artifacts (`make demo`). On up to --per-set held-out prompts of
each prompt set (bundled, code, docs: `benchmarks/sets.py`) it decodes with `ar:greedy` (the
teacher with its KV cache), `spec:drafter+lookup` (the default), `spec:drafter`, `ar:prompt-lookup`
and `hf:prompt-lookup`, interleaved prompt by prompt, and `spec:drafter` again with the drafter's
head over the full vocabulary. Writes benchmarks/results/drafting.json:

- `sets[name]`: τ (decode and teacher-forced, training vocabulary and full vocabulary), mismatches,
  tokens/s × AR with 95 % bootstrap intervals;
- `tau_vs_rows`: teacher-forced τ per set of drafters trained on fewer responses (and the stage's);
- `training_seconds`, `tau_curve_teacher_forced`: from the drafter artifact (held-out τ at three
  training budgets).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DECODERS = ["ar:greedy", "spec:drafter+lookup", "spec:drafter", "ar:prompt-lookup", "hf:prompt-lookup"]


def drafter_tau(recs) -> float:
    """Tokens per verify forward (the verify's own token included)."""
    return round(sum(len(o.tokens) for o in recs) / max(sum(len(o.drafted) for o in recs), 1), 4)


def forced_by_set(drafter, teacher, seqs_by_set: dict, vocab) -> dict[str, dict]:
    """Teacher-forced τ of each set's held-out rows with the drafter's head restricted to `vocab`
    (None: the full vocabulary, as engines draft)."""
    from a2d.models.objectives.drafter import frozen_parts, teacher_forced

    frozen = frozen_parts(teacher, vocab, "cpu")
    cfg = drafter.config
    return {
        name: teacher_forced(drafter, frozen, seqs, cfg.block_size, cfg.mask_token_id, "cpu")
        for name, seqs in seqs_by_set.items()
    }


def tau_vs_rows(store, refs, spec, seqs_by_set, teacher, rows_grid, steps, precision="auto") -> list[dict]:
    """Drafters trained on fewer training responses (`rows_grid`, `steps` each), teacher-forced τ per
    set; each is a throwaway training run in a temporary folder, as the stage trains (train_drafter,
    at the config's `train.mixed_precision`)."""
    import tempfile

    from a2d.models.drafter import DFlashDraftModel
    from a2d.specs import TrainOptions
    from a2d.stores import checkpoints
    from a2d.tasks.drafter import train_drafter

    curve = []
    for rows in rows_grid:
        with tempfile.TemporaryDirectory() as tmp:
            sub = spec.model_copy(update={"steps": steps})
            train = TrainOptions(checkpoint_every=steps, keep_checkpoints=1, mixed_precision=precision)
            result = train_drafter(store, refs, sub, train, Path(tmp), "cpu", max_train_rows=rows)
            last = checkpoints.latest(Path(tmp) / "checkpoints")
            drafter = DFlashDraftModel.load(last / "adapter").eval()
            forced = forced_by_set(drafter, teacher, seqs_by_set, drafter.draft_vocab)
        curve.append(
            {
                "rows": result["rows"],
                "steps": steps,
                "train_seconds": result["train_seconds"],
                **{f"tau_{name}": f["tau"] for name, f in forced.items()},
            }
        )
        print(curve[-1], flush=True)
    return curve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--store", default=None)
    ap.add_argument(
        "--name", default="drafting", help="results/NAME.json (another host's run beside the committed one)"
    )
    ap.add_argument(
        "--per-set", type=int, default=6, help="held-out prompts decoded per prompt set (0 = all)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--curve-steps", type=int, default=250, help="steps of each smaller-data drafter")
    ap.add_argument("--curve-rows", default="0.25,0.5", help="shares of the training rows for the τ curve")
    args = ap.parse_args()
    import torch
    from tqdm.auto import tqdm

    from a2d.models import decoders as registry
    from a2d.models.dflash_drafter import DFlashDrafter
    from a2d.specs import DrafterSpec
    from a2d.stores.anchors import AnchorReader
    from a2d.stores.readers import read_held_out
    from a2d.tasks.drafter import load_sequences
    from a2d.tasks.resources import resources_from_store
    from benchmarks.common import built, write_result
    from benchmarks.sets import by_set, speed

    cfg, refs, store = built(args.config, args.store, "head")
    if "drafter" not in refs or not store.is_complete(refs["drafter"]):
        raise SystemExit(f"no complete drafter artifact: run `a2d run {args.config} --until drafter` first")
    held = read_held_out(store, refs["responses"])
    sets = by_set(held, args.per_set)
    n = args.max_new_tokens
    wanted = {s: refs[s] for s in ("head", "teacher", "drafter")}
    res, _, tok = resources_from_store(store, wanted, n)
    teacher, drafter = res.teacher, res.drafter
    names = [m for m in DECODERS if not registry.missing(registry.describe(m), res)]
    decoders = {m: registry.build(m, res) for m in names}
    drafts: list[DFlashDrafter] = []  # every decode's drafter object (its own forwards and seconds)
    original_init = DFlashDrafter.__init__

    def keep(self, *a, **k):
        original_init(self, *a, **k)
        drafts.append(self)

    rows = [r for group in sets.values() for r in group]
    stats = {m: {"tokens": [], "seconds": [], "outputs": [], "records": []} for m in names}
    full_vocab: list = []  # spec:drafter decoded with the drafter's head over the whole vocabulary
    with torch.no_grad():
        for m in names:
            decoders[m](rows[0]["prompt_ids"][:8])  # warm-up
        DFlashDrafter.__init__ = keep
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
                vocab, drafter.draft_vocab = drafter.draft_vocab, None
                full_vocab.append(decoders["spec:drafter"](r["prompt_ids"]))
                drafter.draft_vocab = vocab
        finally:
            DFlashDrafter.__init__ = original_init
    base = stats["ar:greedy"]["outputs"]
    lossless = [m for m in names if m != "ar:greedy"]
    block = drafter.config.block_size
    layers = list(drafter.config.target_layer_ids)
    reader = AnchorReader(store, refs["anchors"])
    seqs_by_set = {
        name: load_sequences(reader, group, layers, torch.float32) for name, group in by_set(held, 0).items()
    }
    forced = forced_by_set(drafter, teacher, seqs_by_set, drafter.draft_vocab)
    forced_full = forced_by_set(drafter, teacher, seqs_by_set, None)
    per_set, first = {}, 0
    for name, group in sets.items():
        index = list(range(first, first + len(group)))
        first += len(group)
        sub = {m: {k: [v[i] for i in index] for k, v in st.items()} for m, st in stats.items()}
        speeds = {m: speed(sub, m) for m in names}
        per_set[name] = {
            "prompts": len(index),
            "tau": drafter_tau(sub["spec:drafter"]["records"]),
            "tau_full_vocab": drafter_tau([full_vocab[i] for i in index]),
            "tau_teacher_forced": forced[name]["tau"],
            "tau_teacher_forced_full_vocab": forced_full[name]["tau"],
            "tau_teacher_forced_decode_chain": forced[name]["tau_decode_chain"],
            "teacher_forced_rows": len(seqs_by_set[name]),
            "tpf_drafter_lookup": round(
                sum(sub["spec:drafter+lookup"]["tokens"])
                / max(sum(o.forwards for o in sub["spec:drafter+lookup"]["records"]), 1),
                4,
            ),
            "lossless_mismatches": {
                m: sum(a != b for a, b in zip(sub[m]["outputs"], [base[i] for i in index], strict=True))
                for m in lossless
            },
            "full_vocab_mismatches": sum(full_vocab[i].tokens != base[i] for i in index),
            "speedup_vs_ar": {m: s["speedup_vs_ar"] for m, s in speeds.items()},
            "speedup_vs_ar_ci95": {m: s["speedup_vs_ar_ci95"] for m, s in speeds.items()},
        }
    manifest = store.manifest(refs["drafter"])
    marker = manifest["shards"]["drafter"]
    spec = DrafterSpec.model_validate(manifest["spec"])
    train_rows = marker["rows"]
    grid = [max(8, round(float(f) * train_rows)) for f in args.curve_rows.split(",") if f]
    curve = tau_vs_rows(
        store, refs, spec, seqs_by_set, teacher, grid, args.curve_steps, cfg.train.mixed_precision
    )
    full = {"rows": train_rows, "steps": spec.steps, "train_seconds": marker["train_seconds"]}
    curve.append({**full, **{f"tau_{name}": f["tau"] for name, f in forced.items()}})
    recs = stats["spec:drafter"]["records"]
    verifies = sum(len(o.drafted) for o in recs)
    drafter_seconds = sum(d.seconds for d in drafts)
    reached, held_at = [0] * (block - 1), [0] * (block - 1)
    for o in recs:
        for depth, a in zip(o.reach, o.accepted, strict=True):  # a tree's depth, a chain's length
            for k in range(min(depth, block - 1)):
                reached[k] += 1
                held_at[k] += a > k
    write_result(
        args.name,
        {
            "config": Path(args.config).name,
            "drafter_key": refs["drafter"].key,
            "head_key": refs["head"].key,
            "samples": len(rows),
            "max_new_tokens": n,
            "block_size": block,
            "target_layer_ids": layers,
            "draft_vocab": None if drafter.draft_vocab is None else len(drafter.draft_vocab),
            "sets": per_set,
            "tau_vs_rows": curve,
            "tau": drafter_tau(recs),
            "tree_nodes": registry.profile_for("cpu").tree_nodes,
            "drafts_per_verify": round(sum(sum(o.drafted) for o in recs) / verifies, 3),
            "acceptance_by_offset": [
                round(h / r, 4) if r else None for h, r in zip(held_at, reached, strict=True)
            ],
            "drafter_seconds_share": round(
                drafter_seconds
                / sum(sum(st["seconds"]) for m, st in stats.items() if m.startswith("spec:drafter")),
                4,
            ),
            "training_seconds": marker["train_seconds"],
            "training_steps": spec.steps,
            "training_rows": train_rows,
            "tau_curve_teacher_forced": marker.get("curve", []),
            "rules": (
                "sets[name]: the held-out rows of one prompt set (bundled generator; code: functions of held-out "
                "stdlib modules; docs: passages of held-out pydoc topics; no training row shares a module or "
                "topic with them). tau = spec:drafter's tokens / verify forwards in decodes of --per-set prompts "
                "(the verify's own token included); tau_full_vocab: the same decodes with the drafter's head over "
                "the whole vocabulary (as vLLM and SGLang draft) instead of the training vocabulary; "
                "tau_teacher_forced*: every held-out row of the set with the teacher's own continuation from the "
                "anchors (restricted head / full head; decode_chain: the block starts a greedy decode meets); "
                "speed-ups are tokens/s ÷ ar:greedy (the teacher with its KV cache) on the same prompts, "
                "interleaved per prompt, with 95% bootstrap intervals over prompts; tau_vs_rows: drafters trained "
                "on shares of the training rows for curve_steps steps (and the stage's own drafter), teacher-forced "
                "tau per set"
            ),
        },
    )


if __name__ == "__main__":
    main()
