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
from a2d.models.report import markdown_report, plot_speed_quality, text_table
from a2d.models.student import Student, base_is
from a2d.models.teacher import resolve_device
from a2d.specs import EvalSpec, HeadSpec
from a2d.stores import bundled
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.corpora import prompt_set
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import EVAL_SHARD, read_held_out, read_metrics, read_prompts
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.report import artifact_key as prefect_key
from a2d.tasks.resources import resources_from_store
from a2d.tasks.runtime import in_prefect_run, logger
from a2d.tasks.students import head_student

STAGE = "eval"
FORMAT_VERSION = 5  # 5: an unquantized base in the teacher's dtype is the teacher: ar:greedy is the reference
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"  # a2d's own lm-eval tasks (a2d_bundled)
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
    if spec.decoders is not None:
        chosen = [n for n in spec.decoders if n not in ("ar:greedy", "ar:student-base")]
        for name in chosen:
            needs = registry.describe(name).needs
            if ("vfm" in needs and not with_vfm) or ("drafter" in needs and not with_drafter):
                raise ValueError(
                    f"eval.decoders names {name}, but the eval has no {needs[-1]} artifact to run it: "
                    f"remove it from eval.decoders, or set eval.decoders: null (every decoder that can run)"
                )
        return ["ar:greedy", "ar:student-base", *dict.fromkeys(chosen)]
    names = ["ar:greedy", "ar:student-base", "ar:prompt-lookup", "spec:head", "spec:head+lookup"]
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


REFERENCE_BASE, REFERENCE_TEACHER = "ar:student-base", "ar:greedy"


def key_inputs(spec: EvalSpec, upstream: dict[str, str]) -> KeyInputs:
    """The eval key: the eval spec, the decoders it runs, every artifact it evaluates, and the
    lm-eval version when it runs lm-eval tasks (their prompts and metrics change between versions)."""
    payload = {
        **spec.model_dump(mode="json"),
        "decoders": decoder_names(spec, "vfm" in upstream, "drafter" in upstream),
    }
    if not spec.lm_eval_tasks:  # without tasks the lm-eval fields change nothing: keep older keys
        for name in ("lm_eval_tasks", "lm_eval_limit", "lm_eval_decoder"):
            payload.pop(name)
    else:
        payload["lm_eval_version"] = lm_eval_version()
    return KeyInputs(STAGE, FORMAT_VERSION, payload, upstream)


def lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        raise ValueError(
            "eval.lm_eval_tasks needs lm-evaluation-harness: pip install 'a2d-pipeline[eval]'"
        ) from None


def export_heldout(rows: list[dict], prompts: dict[str, str], path) -> None:
    """The evaluated rows as lm-eval's a2d_bundled task reads them: templated prompt, answer, kind."""
    with open(path, "w") as f:
        for r in rows:
            doc = {
                "sample_id": r["sample_id"],
                "prompt_text": prompts[r["sample_id"]],
                "answer": r["answer"],
                "kind": r["kind"],
            }
            f.write(json.dumps(doc) + "\n")


def run_lm_eval(
    store: ArtifactStore,
    spec: EvalSpec,
    head: ArtifactRef,
    student: Student,
    dspec,
    heldout,
    drafter: ArtifactRef | None = None,
) -> dict:
    """lm-eval's own evaluator over `spec.lm_eval_tasks` with the head's student (already loaded)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from a2d.tasks.harness import A2DLM

    model = A2DLM(
        store=store.root.uri,
        head=head.key,
        decoder=spec.lm_eval_decoder,  # None: the default lossless decoder
        student=student,
        dspec=dspec,
        drafter=drafter.key if drafter is not None else None,
    )
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=list(spec.lm_eval_tasks),
        limit=spec.lm_eval_limit,
        task_manager=TaskManager(
            include_path=str(TASKS_DIR),
            # lm-eval's own index of thousands of task files takes ~15 s to build: only when asked for
            include_defaults=not set(spec.lm_eval_tasks) <= {p.stem for p in Path(TASKS_DIR).glob("*.yaml")},
            metadata={"path": str(heldout)},
        ),
        gen_kwargs=f"max_gen_toks={spec.max_new_tokens}",
        log_samples=False,
    )
    return json.loads(json.dumps(results, default=str))


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
    student, teacher = res.student, res.teacher
    teacher_dir = teacher_stage.local_dir(store, refs["teacher"])
    remote = teacher_stage.trusts_remote_code(store, refs["teacher"])
    head_spec = HeadSpec.model_validate(store.manifest(refs["head"])["spec"])
    # same base, attention and scope, a fresh rank-1 adapter and mask embedding
    res.untrained = lambda: head_student(teacher_dir, head_spec, device, remote, dropout=0.0, rank=1)
    names = decoder_names(spec, "vfm" in refs, "drafter" in refs)
    built, skipped = {}, {}
    reference = REFERENCE_BASE
    if base_is(student, teacher):  # the base is the teacher (unquantized): one decode of it, not two
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
    lm_eval_doc = None
    if out is not None:
        prompts_ref = store.ref("prompts", store.manifest(refs["responses"])["upstream"]["prompts"])
        texts = {
            r["sample_id"]: r["prompt_text"] for r in read_prompts(store, prompts_ref, "eval").to_pylist()
        }
        export_heldout(rows, texts, out / "heldout.jsonl")
        if spec.lm_eval_tasks:
            lm_eval_doc = run_lm_eval(
                store, spec, refs["head"], student, dspec, out / "heldout.jsonl", refs.get("drafter")
            )
            (out / "lm_eval.json").write_text(json.dumps(lm_eval_doc, indent=2, sort_keys=True, default=str))
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
    base_outputs = results[reference]["outputs"]
    for name in names:
        if name != reference and registry.describe(name).lossless and "outputs" in results[name]:
            got = results[name]["outputs"]
            results[name]["mismatches_vs_reference"] = sum(
                a != b for a, b in zip(got, base_outputs, strict=True)
            )
    headline = registry.default_decoder(res)
    order = [n for n in (headline, "ar:greedy") if n in results] + [
        n for n in names if n not in (headline, "ar:greedy")
    ]
    sets: dict[str, Any] = {}
    for name in (headline, "ar:greedy"):  # the default decoder and its AR baseline, per prompt set
        if "_records" in results.get(name, {}):
            sets.update(per_set(name, results[name]["_records"], rows, base_outputs))
    for result in results.values():
        result.pop("_records", None)
    for name, summary in sets.items():  # speed against AR on the same set
        ar = sets.get(f"ar:greedy @{name.split(' @')[1]}", {})
        if ar.get("tokens_per_s"):
            summary["speedup_vs_ar"] = round(summary["tokens_per_s"] / ar["tokens_per_s"], 4)
    ar_rate = results.get("ar:greedy", {}).get("tokens_per_s")
    for summary in results.values():
        if ar_rate and "tokens_per_s" in summary:
            summary["speedup_vs_ar"] = round(summary["tokens_per_s"] / ar_rate, 4)
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


def lm_eval_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's per-task metrics (stderr dropped) and the a2d model's counted totals."""
    tasks = {
        task: {
            k.split(",")[0]: v for k, v in metrics.items() if "stderr" not in k and k != "alias" and "," in k
        }
        for task, metrics in doc.get("results", {}).items()
    }
    config = doc.get("config", {})
    return {
        "version": doc.get("lm_eval_version") or lm_eval_version(),
        "tasks": tasks,
        "model": {k: v for k, v in config.items() if k.startswith("a2d_")},
    }


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


def report_text(doc: dict[str, Any], refs: dict[str, ArtifactRef]) -> str:
    meta = {
        "held-out samples": doc["samples"],
        "max new tokens": doc["max_new_tokens"],
        "lossless check (≠ ref)": f"prompts whose tokens differ from {doc.get('reference', REFERENCE_BASE)}'s",
        "AUP metric": f"{doc['aup_metric']} ({doc['aup_metric_reason']})",
        "counting": doc["counting"],
        **{f"{k} key": v.key for k, v in refs.items()},
    }
    report = markdown_report({name: doc["decoders"][name] for name in doc["decoder_order"]}, doc["aup"], meta)
    if doc.get("lm_eval"):
        lm = doc["lm_eval"]
        lines = [
            "",
            f"## lm-evaluation-harness {lm['version']}",
            "",
            "| task | metric | value |",
            "|:---|:---|---:|",
        ]
        for task, metrics in lm["tasks"].items():
            lines += [f"| {task} | {m} | {v:.4f} |" for m, v in metrics.items() if isinstance(v, int | float)]
        model = lm["model"]
        lines += [
            "",
            f"Decoder {model.get('a2d_decoder')}: {model.get('a2d_tokens_per_forward')} tokens per forward, "
            f"{model.get('a2d_tokens_per_s')} tokens/s over {model.get('a2d_generations')} generations.",
        ]
        report += "\n".join(lines) + "\n"
    return report


def publish_report(doc: dict[str, Any], refs: dict[str, ArtifactRef], out: Path) -> dict[str, str]:
    """metrics.json, report.md and the plot into the shard folder; their checksums."""
    (out / "metrics.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
    (out / "report.md").write_text(report_text(doc, refs))
    plot_speed_quality(
        {n: s for n, s in doc["decoders"].items() if " @" not in n}, str(out / "speed_quality.png")
    )
    return {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    return {"aup": markers[SHARD]["aup"]}


def print_table(store: ArtifactStore, ref: ArtifactRef) -> str:
    doc = read_metrics(store, ref)
    order = doc.get("decoder_order", list(doc["decoders"]))
    return text_table({name: doc["decoders"][name] for name in order})
