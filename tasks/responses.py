"""responses stage: teacher AR generation (KV cache, greedy by default) or the dataset's own responses."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from prefect import task
from tqdm import tqdm

from a2d.models.capture import resolve_layers
from a2d.models.generate import eos_ids, generate_batch, sample_seed
from a2d.models.teacher import decoder_layers
from a2d.specs import AnchorSpec, LoadSpec, ResponseSpec, RunOptions, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, Timer, hash_local_tree
from a2d.stores.keys import KeyInputs
from a2d.stores.parquet import TOKENS, read_shard, write_shard
from a2d.tasks import anchors as anchor_stage
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.report import Progress

STAGE = "responses"
# 2: a2d's own batched loop (`generate_batch`), not transformers' `generate`: the same tokens on the
#    teachers tested, but the key says which loop made them
FORMAT_VERSION = 2
SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("split", pa.string()),
        ("prompt_ids", TOKENS),
        ("response_ids", TOKENS),
        ("response_text", pa.string()),
        ("finish_reason", pa.string()),
        ("answer", pa.string()),
        ("kind", pa.string()),
    ]
)


def key_inputs(spec: ResponseSpec, load: LoadSpec, prompts_key: str, teacher_key: str) -> KeyInputs:
    """The responses key: the decoding spec, plus how the teacher is loaded when it generates."""
    data = spec.model_dump(mode="json")
    if spec.source == "teacher":
        data["load"] = load.model_dump(mode="json")
    if spec.source == "teacher" and spec.do_sample:
        # Sampled responses before this were drawn from torch's global RNG (timing-dependent).
        data["sampler"] = "gumbel-per-sample"
    return KeyInputs(STAGE, FORMAT_VERSION, data, {"prompts": prompts_key, "teacher": teacher_key})


@task(name="responses-shard", task_run_name="responses-{shard}", tags=["gpu"])
def responses_shard(
    store_uri: str,
    ref: ArtifactRef,
    shard: str,
    spec: ResponseSpec,
    prompts: ArtifactRef,
    teacher: ArtifactRef,
    teacher_spec: TeacherSpec,
    opts: RunOptions,
    anchors: ArtifactRef | None = None,
    anchor_spec: AnchorSpec | None = None,
) -> dict:
    """Answer every prompt of one prompts shard; writes `part-NNNNN.parquet` and its marker. With
    `anchors` (an anchors artifact of `anchor_spec.source: generation`), the generation keeps the
    anchor layers' states and this task writes that artifact's shard too, after its own."""
    store = ArtifactStore(store_uri)
    timer = Timer()
    rows = read_shard(store.loc(prompts), f"{shard}.parquet").to_pylist()
    batches: list = []
    with gpu_slot():  # the device is held from model load to the last generated token
        model, tok = teacher_stage.load(store, teacher, teacher_spec, teacher_spec.load, opts.device)
        num_layers = len(decoder_layers(model))
        layers = resolve_layers(anchor_spec.layers, num_layers) if anchors is not None else None
        forwards = 0
        if spec.source == "dataset":
            generated = _references(model, tok, rows)
            layers = None  # nothing generated, nothing captured: the anchors stage runs its forward
        else:
            generated, forwards, batches = _generate(model, tok, rows, spec, opts, shard, layers)
    out: dict[str, list] = {f.name: [] for f in SCHEMA}
    for r, (ids, reason) in zip(rows, generated, strict=True):
        out["sample_id"].append(r["sample_id"])
        out["split"].append(r["split"])
        out["prompt_ids"].append(r["prompt_ids"])
        out["response_ids"].append(ids)
        out["response_text"].append(tok.decode(ids, skip_special_tokens=True))
        out["finish_reason"].append(reason)
        out["answer"].append(r["answer"])
        out["kind"].append(r["kind"])
    name = f"{shard}.parquet"
    with store.shard_output(ref, name) as path:
        n = write_shard(path, out, SCHEMA)
        sha = hash_local_tree(path)[""]
    tokens = int(sum(len(x) for x in out["response_ids"]))
    stats = {
        "rows": n,
        "tokens": tokens,
        "eos": out["finish_reason"].count("eos"),
        "forwards": forwards,
        "seconds": round(timer.seconds, 3),
    }
    marker = store.write_marker(ref, shard, {name: sha}, stats)
    if layers is not None:  # after the responses shard: its checksum is what the anchors record
        cap = anchor_stage.captured_in_generation(
            out["prompt_ids"], out["response_ids"], batches, anchor_spec.tokens
        )
        anchor_stage.write_anchor_shard(
            store,
            anchors,
            shard,
            out["sample_id"],
            cap,
            anchor_spec,
            layers,
            num_layers,
            teacher,
            teacher_spec,
            ref.key,
            marker["sha256"],
            precision="none",
            captured_in="generation",
            forward_seconds=0.0,
            timer=Timer(),
        )
    return marker


def _references(model, tok, rows: list[dict]) -> list[tuple[list[int], str]]:
    """The dataset's own answers, tokenized and closed with EOS."""
    eos = eos_ids(model, tok)[0]
    for r in rows:
        if r["reference_response"] is None:
            raise ValueError(
                f"responses.source=dataset but sample {r['sample_id']} has no reference response; "
                "set prompts.response_column or use responses.source=teacher"
            )
    return [
        (tok(r["reference_response"], add_special_tokens=False)["input_ids"] + [eos], "dataset") for r in rows
    ]


def _generate(model, tok, rows: list[dict], spec: ResponseSpec, opts: RunOptions, shard: str, capture):
    """Greedy or sampled answers to `rows` in batches of similar prompt lengths: (response ids,
    finish reason) per row in row order, the forwards, and each batch's (row indices, kept states)."""
    generated: list = [None] * len(rows)
    batches, forwards = [], 0
    progress = Progress(len(rows), f"responses {shard}", every=opts.batch_size)
    bar = tqdm(total=len(rows), desc=f"responses {shard}", disable=not opts.progress, leave=False)
    # Batches of similar prompt lengths: the prefill pads each batch to its longest prompt
    # (on the demo's shards 1.37x the real prompt tokens in row order, 1.21x sorted). A
    # sample's response does not depend on its batch; rows keep their order in the shard.
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]))
    for start in range(0, len(order), opts.batch_size):
        index = order[start : start + opts.batch_size]
        batch = [rows[i] for i in index]
        g = generate_batch(
            model,
            [r["prompt_ids"] for r in batch],
            spec.max_new_tokens,
            eos_ids(model, tok),
            tok.pad_token_id,
            spec.do_sample,
            spec.temperature,
            spec.top_p,
            seeds=[sample_seed(spec.seed, r["sample_id"]) for r in batch],
            capture=capture,
        )
        forwards += g.forwards
        for i, item in zip(index, zip(g.response_ids, g.finish_reason, strict=True), strict=True):
            generated[i] = item
        if g.states is not None:
            batches.append((index, g.states))
        bar.update(len(batch))
        progress.advance(len(batch))
    bar.close()
    return generated, forwards, batches


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    rows = sum(m["rows"] for m in markers.values())
    tokens = sum(m["tokens"] for m in markers.values())
    seconds = sum(m["seconds"] for m in markers.values())
    return {
        "responses": rows,
        "mean_response_tokens": round(tokens / max(rows, 1), 2),
        "eos_fraction": round(sum(m["eos"] for m in markers.values()) / max(rows, 1), 4),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
    }
