"""eval stage: every decoder on held-out prompts; TPF, tokens/s, agreement, accuracy, repetition, AUP."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from tqdm import tqdm

from a2d.models import decoders as registry
from a2d.models.block_decode import Decoded
from a2d.models.metrics import family_aup, summarise_decoder
from a2d.models.student import DiffusionSpec, Student, base_is
from a2d.models.teacher import resolve_device
from a2d.specs import EvalSpec, HeadSpec
from a2d.stores import bundled
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.stores.corpora import prompt_set
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import EVAL_SHARD, read_held_out, read_prompts
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.eval_report import REFERENCE_BASE, publish_report, report_text
from a2d.tasks.lm_eval_run import export_heldout, lm_eval_summary, lm_eval_version, run_lm_eval
from a2d.tasks.report import artifact_key as prefect_key
from a2d.tasks.resources import resources_from_store
from a2d.tasks.runtime import in_prefect_run, logger
from a2d.tasks.students import head_student

STAGE = "eval"
FORMAT_VERSION = 5  # 5: an unquantized base in the teacher's dtype is the teacher: ar:greedy is the reference
COUNTING_RULES = (
    "a forward is every model call over whatever it is fed (a verify+draft forward once; flow-map, prompt and "
    "drafter forwards count); tokens are generated response tokens up to and including EOS; prompt tokens are "
    "not counted; accepted counts drafted tokens only"
)
SHARD = EVAL_SHARD
Decoder = Callable[[list[int]], Decoded]  # prompt -> tokens and counts
MIN_CORRECT_TO_RANK = 10  # fewer correct answers than this by the best decoder: AUP uses agreement


def decoder_names(spec: EvalSpec, with_vfm: bool, with_drafter: bool = False) -> list[str]:
    """Every decoder the eval runs (names from `a2d.models.decoders`), in report order. The list is
    part of the eval key, so a decoder added here gives a new key without a hand-bumped FORMAT_VERSION."""
    if spec.decoders is not None:  # as the registry names them (a former name read as its decoder)
        chosen = [
            registry.describe(n).name for n in spec.decoders if n not in ("ar:greedy", "ar:student-base")
        ]
        for name in chosen:
            needs = registry.describe(name).needs
            if ("vfm" in needs and not with_vfm) or ("drafter" in needs and not with_drafter):
                raise ValueError(
                    f"eval.decoders names {name}, but the eval has no {needs[-1]} artifact to run it: "
                    f"remove it from eval.decoders, or set eval.decoders: null (every decoder that can run)"
                )
        return ["ar:greedy", "ar:student-base", *dict.fromkeys(chosen)]
    names = ["ar:greedy", "ar:student-base", "spec:lookup", "spec:head", "spec:head+lookup"]
    if with_drafter:
        names[2:2] = ["spec:drafter+lookup", "spec:drafter"]  # the default decoder, then its drafter alone
    names += [f"threshold:{t:g}" for t in spec.thresholds]
    names += [f"entropy:{e:g}" for e in spec.entropy_thresholds]
    names.append("head:k1")
    if with_vfm:
        names += [f"vfm:k{k}" for k in spec.vfm_steps]
        names.append("spec:vfm")
    if spec.untrained_baseline:
        names.append("untrained:k1")
    return names


# Decoders the eval key spells by the name they had when keys began listing decoders, so that a
# rename keeps every eval artifact's key (spec:lookup was ar:prompt-lookup).
KEY_SPELLING = {"spec:lookup": "ar:prompt-lookup"}
REFERENCE_TEACHER = "ar:greedy"  # the reference where the student's base is the teacher


def key_inputs(spec: EvalSpec, upstream: dict[str, str]) -> KeyInputs:
    """The eval key: the eval spec, the decoders it runs (in KEY_SPELLING), every artifact it
    evaluates, and the lm-eval version when it runs lm-eval tasks (their prompts and metrics change
    between versions)."""
    payload = {
        **spec.model_dump(mode="json"),
        "decoders": [
            KEY_SPELLING.get(n, n) for n in decoder_names(spec, "vfm" in upstream, "drafter" in upstream)
        ],
    }
    if not spec.lm_eval_tasks:  # without tasks the lm-eval fields change nothing: keep older keys
        for name in ("lm_eval_tasks", "lm_eval_limit", "lm_eval_decoder"):
            payload.pop(name)
    else:
        payload["lm_eval_version"] = lm_eval_version()
    return KeyInputs(STAGE, FORMAT_VERSION, payload, upstream)


def balanced(rows: list[dict], limit: int | None) -> list[dict]:
    """Up to `limit` held-out rows taken in turn from each prompt set (bundled, code, docs, ...), each
    set in stored order: a small eval of a mixture measures every set, not the first part alone."""
    sets: dict[str, list[dict]] = {}
    for r in rows:
        sets.setdefault(prompt_set(r["kind"]), []).append(r)
    turns = [r for group in itertools.zip_longest(*sets.values()) for r in group if r is not None]
    return turns[:limit] if limit else turns


def per_set(
    name: str, records: list[dict], rows: list[dict], reference: list[list[int]]
) -> dict[str, dict[str, Any]]:
    """A decoder's summary on each prompt set of the rows (only where there are several sets), with
    its mismatches against the reference's tokens on that set."""
    sets: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        sets.setdefault(prompt_set(r["kind"]), []).append(i)
    if len(sets) < 2:
        return {}
    out = {}
    for s, index in sets.items():
        summary = summarise_decoder([records[i] for i in index])
        summary["mismatches_vs_reference"] = sum(records[i]["tokens"] != reference[i] for i in index)
        out[f"{name} @{s}"] = summary
    return out


def correct(text: str, answer: str | None, kind: str | None) -> bool | None:
    """Answer check for the bundled kinds; None where the data has no checkable answer."""
    if answer is None or kind not in bundled.KINDS:
        return None
    return bundled.is_correct(text, answer, kind)


def run_decoder(name: str, decode: Decoder, rows: list[dict], tok: Any, spec: EvalSpec) -> dict[str, Any]:
    records = []
    for r in tqdm(rows, desc=name, leave=False):
        start = time.perf_counter()
        out = decode(r["prompt_ids"])
        seconds = time.perf_counter() - start
        text = tok.decode(out.tokens, skip_special_tokens=True)
        records.append(
            {
                "tokens": out.tokens,
                "teacher_tokens": r["response_ids"][: spec.max_new_tokens],
                "forwards": out.forwards,
                "seconds": seconds,
                "correct": correct(text, r["answer"], r["kind"]),
                "accepted": out.accepted,
                "drafted": out.drafted,
                "draftable": out.draftable,
                "text": text,
            }
        )
    summary = summarise_decoder(records)
    return {
        **summary,
        "outputs": [rec["tokens"] for rec in records],
        "examples": [rec["text"] for rec in records[:3]],
        "_records": records,
    }


def evaluate(
    store: ArtifactStore,
    spec: EvalSpec,
    refs: dict[str, ArtifactRef],
    device: str = "cpu",
    out: Path | None = None,
) -> dict[str, Any]:
    """Decode the held-out prompts with every decoder; returns the metrics document.

    With `out`, the evaluated rows are exported there (heldout.jsonl, lm-eval's a2d_bundled task
    format), and lm-eval's results (lm_eval.json) when `spec.lm_eval_tasks` asks for tasks.
    """
    rows = balanced(read_held_out(store, refs["responses"]), spec.max_samples)
    if not rows:
        raise ValueError("no held-out prompts: raise prompts.eval_fraction so the eval split is not empty")
    res, dspec, tok = resources_from_store(store, refs, spec.max_new_tokens, device)
    res.untrained = untrained_student(store, refs, device)
    names = decoder_names(spec, "vfm" in refs, "drafter" in refs)
    reference, built, skipped = build_decoders(names, res)
    lm_eval_doc = None
    if out is not None:
        lm_eval_doc = export_and_run_lm_eval(store, spec, refs, rows, res.student, dspec, out)
    results = run_decoders(names, built, skipped, rows, tok, spec)
    base_outputs = results[reference]["outputs"]
    count_mismatches(results, names, reference)
    headline = registry.default_decoder(res)
    order = [n for n in (headline, "ar:greedy") if n in results] + [
        n for n in names if n not in (headline, "ar:greedy")
    ]
    sets = per_set_rows(results, headline, rows, base_outputs)
    add_speedups(results, sets)
    metric, why = aup_metric(results)
    ranked = {k: v for k, v in results.items() if "tpf" in v}
    aup = family_aup(ranked, metric) if metric else {}
    return {
        "decoder_order": order[:1] + [s for s in sets if s.startswith(f"{headline} @")] + order[1:],
        "default_decoder": headline,
        "reference": reference,
        "decoders": {**results, **{s: v for s, v in sets.items() if s.startswith(f"{headline} @")}},
        "sets": sets,
        "aup": aup,
        "aup_metric": metric,
        "aup_metric_reason": why,
        "samples": len(rows),
        "max_new_tokens": spec.max_new_tokens,
        "diffusion_spec": dspec.to_json(),
        "decode_profile": dataclasses.asdict(res.profile or registry.profile_for(device)),
        "counting": COUNTING_RULES,
        "lm_eval": lm_eval_summary(lm_eval_doc) if lm_eval_doc else None,
    }


def untrained_student(
    store: ArtifactStore, refs: dict[str, ArtifactRef], device: str
) -> Callable[[], Student]:
    """The untrained baseline's student, built when first decoded: the head's base, attention and
    scope with a fresh rank-1 adapter and mask embedding."""
    teacher_dir = teacher_stage.local_dir(store, refs["teacher"])
    remote = teacher_stage.trusts_remote_code(store, refs["teacher"])
    head_spec = HeadSpec.model_validate(store.manifest(refs["head"])["spec"])
    return lambda: head_student(teacher_dir, head_spec, device, remote, dropout=0.0, rank=1)


def build_decoders(
    names: list[str], res: registry.Resources
) -> tuple[str, dict[str, Decoder], dict[str, str]]:
    """(the lossless decoders' reference, the decoders built, why each other one is skipped)."""
    built, skipped = {}, {}
    reference = REFERENCE_BASE
    if base_is(res.student, res.teacher):  # the base is the teacher (unquantized): one decode of it, not two
        reference = REFERENCE_TEACHER
        skipped[REFERENCE_BASE] = (
            "the student's base is the teacher (unquantized, in the teacher's dtype): ar:greedy's tokens "
            "are the base's, and the lossless decoders are checked against them"
        )
    for name in names:
        why = skipped.get(name) or registry.missing(registry.describe(name), res)
        if why:
            skipped[name] = why
        else:
            built[name] = registry.build(name, res)
    return reference, built, skipped


def export_and_run_lm_eval(
    store: ArtifactStore,
    spec: EvalSpec,
    refs: dict[str, ArtifactRef],
    rows: list[dict],
    student: Student,
    dspec: DiffusionSpec,
    out: Path,
) -> dict | None:
    """The evaluated rows to `out`/heldout.jsonl, and lm-eval's results (`out`/lm_eval.json) when
    the spec names lm-eval tasks; those results, or None."""
    prompts_ref = store.ref("prompts", store.manifest(refs["responses"])["upstream"]["prompts"])
    texts = {r["sample_id"]: r["prompt_text"] for r in read_prompts(store, prompts_ref, "eval").to_pylist()}
    export_heldout(rows, texts, out / "heldout.jsonl")
    if not spec.lm_eval_tasks:
        return None
    doc = run_lm_eval(store, spec, refs["head"], student, dspec, out / "heldout.jsonl", refs.get("drafter"))
    (out / "lm_eval.json").write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
    return doc


def run_decoders(
    names: list[str],
    built: dict[str, Decoder],
    skipped: dict[str, str],
    rows: list[dict],
    tok: Any,
    spec: EvalSpec,
) -> dict[str, Any]:
    """Every decoder's summary over the rows, in `names` order (a skipped one: why)."""
    results: dict[str, Any] = {}
    for name in names:
        if name in skipped:
            results[name] = {"skipped": skipped[name]}
            continue
        results[name] = run_decoder(name, built[name], rows, tok, spec)
        results[name]["lossless"] = registry.describe(name).lossless
        r = results[name]
        logger().info(
            "eval %s: %.2f tokens/s, %.2f tokens per forward over %d prompts",
            name,
            r["tokens_per_s"],
            r["tpf"],
            len(rows),
        )
    return results


def count_mismatches(results: dict[str, Any], names: list[str], reference: str) -> None:
    """Each lossless decoder's prompts whose tokens differ from the reference's (0 when lossless)."""
    base_outputs = results[reference]["outputs"]
    for name in names:
        if name != reference and registry.describe(name).lossless and "outputs" in results[name]:
            got = results[name]["outputs"]
            results[name]["mismatches_vs_reference"] = sum(
                a != b for a, b in zip(got, base_outputs, strict=True)
            )


def per_set_rows(
    results: dict[str, Any], headline: str, rows: list[dict], base_outputs: list[list[int]]
) -> dict[str, Any]:
    """The default decoder and its AR baseline on each prompt set; the per-prompt records are
    dropped from every result here (they were kept for this)."""
    sets: dict[str, Any] = {}
    for name in (headline, "ar:greedy"):
        if "_records" in results.get(name, {}):
            sets.update(per_set(name, results[name]["_records"], rows, base_outputs))
    for result in results.values():
        result.pop("_records", None)
    return sets


def add_speedups(results: dict[str, Any], sets: dict[str, Any]) -> None:
    """speedup_vs_ar: tokens/s over AR's, per prompt set against AR on the same set."""
    for name, summary in sets.items():
        ar = sets.get(f"ar:greedy @{name.split(' @')[1]}", {})
        if ar.get("tokens_per_s"):
            summary["speedup_vs_ar"] = round(summary["tokens_per_s"] / ar["tokens_per_s"], 4)
    ar_rate = results.get("ar:greedy", {}).get("tokens_per_s")
    for summary in results.values():
        if ar_rate and "tokens_per_s" in summary:
            summary["speedup_vs_ar"] = round(summary["tokens_per_s"] / ar_rate, 4)


def aup_metric(results: dict[str, Any]) -> tuple[str | None, str]:
    """Answer accuracy when enough answers are right to rank decoders by it, else agreement with the teacher."""
    scored = [s for s in results.values() if s.get("answer_accuracy") is not None]
    best_correct = max((round(s["answer_accuracy"] * s["samples"]) for s in scored), default=0)
    if best_correct >= MIN_CORRECT_TO_RANK:
        return "answer_accuracy", f"the best decoder answers {best_correct} prompts right"
    if max((s.get("token_agreement") or 0.0) for s in results.values()) > 0:
        return "token_agreement", (
            f"the best decoder answers only {best_correct} prompts right (< {MIN_CORRECT_TO_RANK}): "
            "too few to rank decoders, so AUP uses token agreement with the teacher"
        )
    return None, "no decoder agrees with the teacher at all"


@task(name="eval-run", task_run_name="eval-{ref.key}", tags=["gpu"])
def eval_run(
    store_uri: str, ref: ArtifactRef, spec: EvalSpec, refs: dict[str, ArtifactRef], device: str
) -> dict:
    """Evaluate, then publish metrics.json, speed_quality.png and report.md as the `report` shard."""
    store = ArtifactStore(store_uri)
    dev = str(resolve_device(device))
    with store.shard_output(ref, SHARD) as out:
        out.mkdir()
        with gpu_slot():
            doc = evaluate(store, spec, refs, dev, out)
        files = publish_report(doc, refs, out)
    if in_prefect_run():
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        table = [
            {"decoder": name, **{k: v for k, v in s.items() if k not in ("examples", "outputs", "ci95")}}
            for name, s in doc["decoders"].items()
        ]
        create_table_artifact(
            key=prefect_key("a2d", "eval", "decoders"), table=table, description="eval: every decoder"
        )
        create_markdown_artifact(
            key=prefect_key("a2d", "eval", "report"),
            markdown=report_text(doc, refs),
            description=f"eval {ref.key}: every decoder's speed and quality on {doc['samples']} held-out prompts",
        )
    return store.write_marker(ref, SHARD, files, {"rows": doc["samples"], "tokens": 0, "aup": doc["aup"]})


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    return {"aup": markers[SHARD]["aup"]}
