"""responses stage: teacher AR generation (KV cache, greedy by default) or the dataset's own responses."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from prefect import task
from tqdm import tqdm

from flows.config import LoadSpec, ResponseSpec, RunOptions, TeacherSpec
from models.generate import generate_batch
from stores.artifacts import ArtifactRef, ArtifactStore, Timer, hash_local_tree
from stores.keys import artifact_key
from stores.parquet import TOKENS, read_shard, write_shard
from tasks import teacher as teacher_stage
from tasks.concurrency import gpu_slot
from tasks.report import Progress

STAGE = "responses"
FORMAT_VERSION = 1
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


def key_spec(spec: ResponseSpec, load: LoadSpec) -> dict[str, Any]:
    """The key-determining spec: loading matters only when the teacher generates."""
    data = spec.model_dump(mode="json")
    if spec.source == "teacher":
        data["load"] = load.model_dump(mode="json")
    return data


def key_for(spec: ResponseSpec, load: LoadSpec, prompts_key: str, teacher_key: str) -> str:
    return artifact_key(
        STAGE, FORMAT_VERSION, key_spec(spec, load), {"prompts": prompts_key, "teacher": teacher_key}
    )


def eos_ids(model: Any, tok: Any) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    if not ids:
        raise ValueError("the teacher has no EOS token: set eos_token_id in its generation_config")
    return ids


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
) -> dict:
    """Answer every prompt of one prompts shard; writes `part-NNNNN.parquet` and its marker."""
    store = ArtifactStore(store_uri)
    timer = Timer()
    rows = read_shard(store.loc(prompts), f"{shard}.parquet").to_pylist()
    with gpu_slot():  # the device is held from model load to the last generated token
        model, tok = teacher_stage.load(store, teacher, teacher_spec, teacher_spec.load, opts.device)
        out: dict[str, list] = {f.name: [] for f in SCHEMA}
        forwards = 0
        if spec.source == "dataset":
            eos = eos_ids(model, tok)[0]
            for r in rows:
                if r["reference_response"] is None:
                    raise ValueError(
                        f"responses.source=dataset but sample {r['sample_id']} has no reference response; "
                        "set prompts.response_column or use responses.source=teacher"
                    )
            generated = [
                (tok(r["reference_response"], add_special_tokens=False)["input_ids"] + [eos], "dataset")
                for r in rows
            ]
        else:
            generated = []
            progress = Progress(len(rows), f"responses {shard}", every=opts.batch_size)
            bar = tqdm(total=len(rows), desc=f"responses {shard}", disable=not opts.progress, leave=False)
            for start in range(0, len(rows), opts.batch_size):
                batch = rows[start : start + opts.batch_size]
                g = generate_batch(
                    model,
                    [r["prompt_ids"] for r in batch],
                    spec.max_new_tokens,
                    eos_ids(model, tok),
                    tok.pad_token_id,
                    spec.do_sample,
                    spec.temperature,
                    spec.top_p,
                    seed=spec.seed + start if spec.do_sample else None,
                )
                forwards += g.forwards
                generated.extend(zip(g.response_ids, g.finish_reason, strict=True))
                bar.update(len(batch))
                progress.advance(len(batch))
            bar.close()
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
    return store.write_marker(ref, shard, {name: sha}, stats)


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


def read_responses(store: ArtifactStore, ref: ArtifactRef, shard: str | None = None) -> pa.Table:
    manifest = store.manifest(ref)
    shards = [shard] if shard else list(manifest["shards"])
    return pa.concat_tables([read_shard(store.loc(ref), f"{s}.parquet") for s in shards])
