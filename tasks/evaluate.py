"""eval stage: every sampler on held-out prompts; TPF, tokens/s, agreement, accuracy, repetition, AUP."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from prefect import task
from tqdm import tqdm

from a2d.models.generate import eos_ids, generate_batch
from a2d.models.metrics import family_aup, summarise_sampler
from a2d.models.report import markdown_report, plot_speed_quality, text_table
from a2d.models.sampler import threshold_decode
from a2d.models.student import build_student
from a2d.models.teacher import resolve_device
from a2d.models.vfm import vfm_generate
from a2d.specs import EvalSpec
from a2d.stores import bundled
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.readers import EVAL_SHARD, read_metrics, read_responses
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.report import artifact_key as prefect_key
from a2d.tasks.runtime import in_prefect_run
from a2d.tasks.students import load_flow_map, load_student, load_vfm

STAGE = "eval"
FORMAT_VERSION = 2
SHARD = EVAL_SHARD
Decoder = Callable[[list[int]], tuple[list[int], int]]  # prompt -> (tokens, forwards)


def sampler_names(spec: EvalSpec, with_vfm: bool) -> list[str]:
    """Every sampler the eval runs, in report order. The list is part of the eval key, so a sampler
    added here gives a new key without a hand-bumped FORMAT_VERSION."""
    names = ["ar:greedy", *(f"head:conf{t:g}" for t in spec.thresholds), "head:k1"]
    names += [f"d3llm:ent{e:g}" for e in spec.entropy_thresholds]
    if with_vfm:
        names += [f"vfm:k{k}" for k in spec.vfm_steps]
    if spec.untrained_baseline:
        names.append("untrained:k1")
    return names


def key_inputs(spec: EvalSpec, upstream: dict[str, str]) -> KeyInputs:
    """The eval key: the eval spec, the samplers it runs and every artifact it evaluates."""
    payload = {**spec.model_dump(mode="json"), "samplers": sampler_names(spec, "vfm" in upstream)}
    return KeyInputs(STAGE, FORMAT_VERSION, payload, upstream)


def correct(text: str, answer: str | None, kind: str | None) -> bool | None:
    """Answer check for the bundled kinds; None where the data has no checkable answer."""
    if answer is None or kind not in bundled.KINDS:
        return None
    return bundled.is_correct(text, answer, kind)


def run_sampler(name: str, decode: Decoder, rows: list[dict], tok: Any, spec: EvalSpec) -> dict[str, Any]:
    records = []
    for r in tqdm(rows, desc=name, leave=False):
        start = time.perf_counter()
        tokens, forwards = decode(r["prompt_ids"])
        seconds = time.perf_counter() - start
        text = tok.decode(tokens, skip_special_tokens=True)
        records.append(
            {
                "tokens": tokens,
                "teacher_tokens": r["response_ids"][: spec.max_new_tokens],
                "forwards": max(forwards, 1),
                "seconds": seconds,
                "correct": correct(text, r["answer"], r["kind"]),
                "text": text,
            }
        )
    return {**summarise_sampler(records), "examples": [rec["text"] for rec in records[:3]]}


def evaluate(
    store: ArtifactStore, spec: EvalSpec, refs: dict[str, ArtifactRef], device: str = "cpu"
) -> dict[str, Any]:
    """Decode the held-out prompts with every sampler; returns the metrics document."""
    rows = [r for r in read_responses(store, refs["responses"]).to_pylist() if r["split"] == "eval"][
        : spec.max_samples
    ]
    if not rows:
        raise ValueError("no held-out prompts: raise prompts.eval_fraction so the eval split is not empty")
    student, dspec = load_student(store, refs["head"], device)
    teacher_spec_dir = teacher_stage.local_dir(store, refs["teacher"])
    teacher, tok = teacher_stage.tm.load_teacher(teacher_spec_dir, device=device)
    eos = eos_ids(teacher, tok)
    attention, shifted = dspec["attention"], dspec["logit_alignment"] == "shifted"
    n, block = spec.max_new_tokens, spec.block_size

    def ar(prompt: list[int]) -> tuple[list[int], int]:
        g = generate_batch(teacher, [prompt], n, eos, tok.pad_token_id)
        return g.response_ids[0], len(g.response_ids[0])

    def diffusion(s, threshold: float, size: int, criterion: str = "confidence") -> Decoder:
        def run(prompt: list[int]) -> tuple[list[int], int]:
            d = threshold_decode(
                s, prompt, n, size, threshold, eos, attention, dspec["logit_alignment"], criterion
            )
            return d.tokens, d.forwards

        return run

    samplers: dict[str, Decoder] = {"ar:greedy": ar}
    for t in spec.thresholds:
        samplers[f"head:conf{t:g}"] = diffusion(student, t, block)
    samplers["head:k1"] = diffusion(
        student, 0.0, n
    )  # one block, every position committed by the first forward
    for e in spec.entropy_thresholds:
        samplers[f"d3llm:ent{e:g}"] = diffusion(student, e, block, "entropy")
    if "vfm" in refs:
        adapter = load_vfm(store, refs["vfm"], device)
        flow_map = load_flow_map(store, refs["vfm"], student, device)
        for k in spec.vfm_steps:
            samplers[f"vfm:k{k}"] = lambda p, k=k: vfm_generate(
                flow_map,
                adapter,
                p,
                min(n, adapter.config["max_len"]),
                k,
                eos,
                attention,
                dspec["block_size"],
                shifted,
            )
    if spec.untrained_baseline:
        linear = dspec["linear_attention"] if dspec["linear_attention"] != "n/a" else "causal"
        base = build_student(  # same base and attention, fresh LoRA (B = 0) and an untrained mask embedding
            teacher_spec_dir,
            dspec["quantization"],
            "float32",
            device,
            {"rank": 1, "alpha": 1, "dropout": 0.0, "rslora": False},
            attention,
            linear,
            dspec["block_size"],
        )
        # The same one-forward decoder as head:k1, so the speed/quality claim at high TPF compares
        # a trained and an untrained adapter under identical decoding (and costs one forward each).
        samplers["untrained:k1"] = diffusion(base, 0.0, n)
    if list(samplers) != sampler_names(spec, "vfm" in refs):
        raise RuntimeError(
            f"eval built samplers {list(samplers)}, its key names {sampler_names(spec, 'vfm' in refs)}"
        )
    results = {name: run_sampler(name, fn, rows, tok, spec) for name, fn in samplers.items()}
    # AUP needs a positive best accuracy; a random tiny teacher answers nothing right, so fall back
    # to agreement with the teacher, and to no AUP at all when even that is zero.
    metric = next(
        (
            m
            for m in ("answer_accuracy", "token_agreement")
            if max((s[m] or 0.0) for s in results.values()) > 0
        ),
        None,
    )
    aup = family_aup(results, metric) if metric else {}
    return {
        "samplers": results,
        "aup": aup,
        "aup_metric": metric,
        "samples": len(rows),
        "max_new_tokens": n,
        "diffusion_spec": dspec,
    }


@task(name="eval-run", task_run_name="eval-{ref.key}", tags=["gpu"])
def eval_run(
    store_uri: str, ref: ArtifactRef, spec: EvalSpec, refs: dict[str, ArtifactRef], device: str
) -> dict:
    """Evaluate, then publish metrics.json, speed_quality.png and report.md as the `report` shard."""
    store = ArtifactStore(store_uri)
    dev = str(resolve_device(device))
    with gpu_slot():
        doc = evaluate(store, spec, refs, dev)
    meta = {
        "held-out samples": doc["samples"],
        "max new tokens": doc["max_new_tokens"],
        "AUP metric": doc["aup_metric"],
        **{f"{k} key": v.key for k, v in refs.items()},
    }
    report = markdown_report(doc["samplers"], doc["aup"], meta)
    with store.shard_output(ref, SHARD) as out:
        out.mkdir()
        (out / "metrics.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
        (out / "report.md").write_text(report)
        plot_speed_quality(doc["samplers"], str(out / "speed_quality.png"))
        files = {f"{SHARD}/{k}": v for k, v in hash_local_tree(out).items()}
    if in_prefect_run():
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        table = [
            {"sampler": name, **{k: v for k, v in s.items() if k != "examples"}}
            for name, s in doc["samplers"].items()
        ]
        create_table_artifact(
            key=prefect_key("a2d", "eval", "samplers"), table=table, description="eval: every sampler"
        )
        create_markdown_artifact(key=prefect_key("a2d", "eval", "report"), markdown=report)
    return store.write_marker(ref, SHARD, files, {"rows": doc["samples"], "tokens": 0, "aup": doc["aup"]})


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    return {"aup": markers[SHARD]["aup"]}


def print_table(store: ArtifactStore, ref: ArtifactRef) -> str:
    return text_table(read_metrics(store, ref)["samplers"])
