"""prompts stage: read a dataset through `datasets`, template and tokenise, count every rejected row."""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
from jinja2 import TemplateError
from prefect import task

from a2d.specs import PromptSpec, TeacherSpec
from a2d.stores import bundled, corpora
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.keys import KeyInputs, sha256_file_cached
from a2d.stores.parquet import TOKENS, write_shard
from a2d.tasks import teacher as teacher_stage

STAGE = "prompts"
# 2: prompts deduplicated by normalised text before the split
# 3: sample ids unique within the artifact (same-named files in different folders no longer collide)
FORMAT_VERSION = 3
REJECT_REASONS = ("empty", "too_long", "undecodable", "missing_column", "duplicate", "malformed")
SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("split", pa.string()),
        ("prompt_text", pa.string()),
        ("prompt_ids", TOKENS),
        ("reference_response", pa.string()),
        ("answer", pa.string()),
        ("kind", pa.string()),
    ]
)
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def validated_files(spec: PromptSpec) -> list[Path]:
    """Local dataset paths: they must exist, be files, and have a supported extension."""
    out = []
    for f in spec.files:
        p = Path(f).expanduser().resolve()
        if p.suffix.lower() not in FILE_FORMATS:
            raise ValueError(
                f"prompts.files: {f} has an unsupported extension; use .jsonl, .json, .parquet or .csv"
            )
        if not p.is_file():
            raise ValueError(f"prompts.files: {f} does not exist (resolved to {p})")
        out.append(p)
    return out


def source_identity(spec: PromptSpec) -> dict[str, Any]:
    """Content hashes of local files, so an edited file gives a new key even under the same name."""
    if spec.source == "files":
        return {"file_sha256": [sha256_file_cached(p) for p in validated_files(spec)]}
    if spec.source == "mixture":  # the text itself: another Python's stdlib or docs give another key
        used = sorted({p.source for p in spec.mixture} & set(corpora.SOURCES))
        return {"source_sha256": {s: corpora.fingerprint(s) for s in used}}
    return {}


def key_inputs(spec: PromptSpec, teacher_key: str) -> KeyInputs:
    """The prompts key: the dataset spec, local files by name and content hash, the teacher (its tokenizer)."""
    payload = {**spec.model_dump(mode="json"), **source_identity(spec)}
    payload["files"] = [Path(f).name for f in spec.files]  # the content hash, not the path, matters
    if spec.bundled_style == "answer":  # the style before there was a choice: older keys stay valid
        payload.pop("bundled_style")
    if not spec.mixture:  # nor did the mixture exist
        payload.pop("mixture")
    return KeyInputs(STAGE, FORMAT_VERSION, payload, {"teacher": teacher_key})


def _decoded_lines(path: Path, rejected: Counter) -> list[tuple[int, str]]:
    """(record number, text) of every line that is UTF-8; the others are counted as undecodable."""
    out = []
    for n, raw in enumerate(path.read_bytes().splitlines()):
        try:
            out.append((n, raw.decode("utf-8")))
        except UnicodeDecodeError:
            rejected["undecodable"] += 1
    return out


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return isinstance(value, list) and any(_has_nul(v) for v in value)


def _keep(record: Any, n: int, records: list[dict[str, Any]], rejected: Counter) -> None:
    """Keep a row (with its record number) when it is an object whose text holds no NUL character
    (a NUL means a damaged or binary file); count it as malformed otherwise."""
    if isinstance(record, dict) and not _has_nul(record):
        records.append({**record, "__line__": n})
    else:
        rejected["malformed"] += 1


def _clean_copy(path: Path, fmt: str, out: Path, rejected: Counter) -> Path:
    """A copy of a JSON/JSON-lines/CSV file holding only its well-formed rows, each with its record
    number in `__line__`; bad rows are counted by reason. A file that cannot be parsed at all (a
    broken JSON array) is an error naming the file and the line."""
    records: list[dict[str, Any]] = []
    text = path.read_bytes()
    if fmt == "json" and text.lstrip().startswith(b"["):  # one JSON array of row objects
        try:
            items = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            where = (
                f"line {e.lineno}, column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else e
            )
            raise ValueError(
                f"prompts.files: {path} is not a valid JSON array ({where}); fix it, or write one object "
                "per line (.jsonl), where a bad line is only counted as rejected"
            ) from None
        for n, item in enumerate(items):
            _keep(item, n, records, rejected)
    elif fmt == "json":  # JSON lines
        for n, line in _decoded_lines(path, rejected):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                item = None
            _keep(item, n, records, rejected)
    else:  # CSV: a row with another number of fields than the header is malformed
        lines = [line for _, line in _decoded_lines(path, rejected)]
        reader = csv.reader(io.StringIO("\n".join(lines)))
        header = next(reader, None) or []
        for n, fields in enumerate(reader):
            if not fields:
                continue
            item = dict(zip(header, fields, strict=True)) if len(fields) == len(header) else None
            _keep(item, n, records, rejected)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return out


def _load(fmt: str, path: Path, shown: Path) -> Any:
    """`datasets.load_dataset` of one local file, its errors naming the file (`shown`)."""
    from datasets import load_dataset

    try:
        return load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # datasets wraps arrow/pandas errors in several types
        cause = e.__cause__ or e
        raise ValueError(
            f"prompts.files: cannot read {shown} as {fmt} ({type(cause).__name__}: {cause}); "
            "check that every row has the same columns with the same types"
        ) from None


def _row_names(paths: list[Path]) -> list[str]:
    """The prefix of generated sample ids per file: its name, or name and position when two files
    share a name (data.jsonl in two folders must not give the same ids)."""
    stems = [p.stem for p in paths]
    return [s if stems.count(s) == 1 else f"{s}-f{i}" for i, s in enumerate(stems)]


@functools.lru_cache(maxsize=4)
def _source_rows_cached(spec_json: str, identity_json: str) -> tuple[tuple[dict[str, Any], ...], tuple]:
    from datasets import load_dataset

    spec = PromptSpec.model_validate_json(spec_json)
    rejected: Counter = Counter()
    if spec.source == "bundled":
        return tuple(bundled.generate(spec.bundled_rows, spec.bundled_seed, spec.bundled_style)), ()
    if spec.source == "mixture":
        return tuple(mixture_rows(spec)), ()
    if spec.source == "hub":
        ds = load_dataset(spec.hub_id, revision=spec.hub_revision, split=spec.split)
        return tuple({"__row__": f"row-{i:06d}", **row} for i, row in enumerate(ds)), ()
    rows: list[dict[str, Any]] = []
    paths = validated_files(spec)
    with tempfile.TemporaryDirectory() as tmp:
        for index, (path, name) in enumerate(zip(paths, _row_names(paths), strict=True)):
            fmt = FILE_FORMATS[path.suffix.lower()]
            if fmt == "parquet":
                for i, row in enumerate(_load(fmt, path, path)):
                    rows.append({"__row__": f"{name}-{i:06d}", **row})
                continue
            clean = _clean_copy(path, fmt, Path(tmp) / f"{index}.jsonl", rejected)
            if clean.stat().st_size == 0:
                continue  # every row was rejected (and counted)
            for row in _load("json", clean, path):
                line = row.pop("__line__")
                rows.append({"__row__": f"{name}-{line:06d}", **row})
    return tuple(rows), tuple(sorted(rejected.items()))


def mixture_rows(spec: PromptSpec) -> list[dict[str, Any]]:
    """Every part's rows, in the mixture's order. Code and docs rows carry their split (`__split__`:
    held out by module or topic); bundled rows are split by id, at their part's fraction."""
    rows: list[dict[str, Any]] = []
    for part in spec.mixture:
        if part.source == "bundled":
            for r in bundled.generate(part.rows, spec.bundled_seed, spec.bundled_style):
                rows.append({**r, "__split__": split_of(r["id"], part.eval_fraction)})
        else:
            rows.extend(corpora.sample(part.source, part.rows, part.eval_fraction, spec.bundled_seed))
    return rows


def sample_id(row: dict[str, Any]) -> str:
    """A row's sample id: its `id` column, else its file and record number (or dataset row)."""
    return str(row.get("id") or row["__row__"])


def check_unique_ids(rows: list[dict[str, Any]]) -> None:
    """Sample ids must be unique within an artifact: duplicates are refused, naming them."""
    counts = Counter(sample_id(r) for r in rows)
    dups = {i: n for i, n in counts.items() if n > 1}
    if dups:
        shown = ", ".join(f"{i!r} ({n} rows)" for i, n in sorted(dups.items())[:5])
        raise ValueError(
            f"prompts: sample ids must be unique, but {len(dups)} repeat: {shown}{' …' if len(dups) > 5 else ''}; "
            "fix the dataset's `id` column, or drop it (rows are then named by file and record)"
        )


def normalised_prompt(prompt: Any) -> str:
    """The text two prompts are compared by: case and whitespace do not make a prompt new."""
    if isinstance(prompt, list):  # chat messages
        return json.dumps([normalised_prompt(m.get("content")) if isinstance(m, dict) else m for m in prompt])
    return " ".join(str(prompt).lower().split())


def deduplicate(rows: list[dict[str, Any]], column: str) -> tuple[list[dict[str, Any]], int]:
    """Keep the first row of every normalised prompt text; returns (rows, duplicates dropped).

    Done over the whole dataset before the held-out split, so no eval prompt is also a training prompt.
    """
    seen: set[str] = set()
    kept = []
    for row in rows:
        prompt = row.get(column)
        text = normalised_prompt(prompt) if prompt is not None else ""
        if text in seen:
            continue
        if text and text != "[]":  # empty prompts are rejected as empty, not as duplicates
            seen.add(text)
        kept.append(row)
    return kept, len(rows) - len(kept)


def source_rows(spec: PromptSpec) -> tuple[list[dict[str, Any]], Counter]:
    """Every distinct source row (as dicts) and rejections found while reading (non-UTF-8 lines, duplicates)."""
    ident = json.dumps(source_identity(spec), sort_keys=True)
    rows, pre = _source_rows_cached(spec.model_dump_json(), ident)
    if spec.source not in ("bundled", "mixture") and rows and spec.prompt_column not in rows[0]:
        cols = sorted(k for k in rows[0] if k != "__row__")
        raise ValueError(
            f"prompts.prompt_column={spec.prompt_column!r} is not a column of the dataset; columns are {cols}"
        )
    column = "prompt" if spec.source in ("bundled", "mixture") else spec.prompt_column
    kept, duplicates = deduplicate(list(rows), column)
    check_unique_ids(kept)
    return kept, Counter({**dict(pre), "duplicate": duplicates})


def split_of(sample_id: str, eval_fraction: float) -> str:
    """Held-out assignment by a hash of the id: stable when the dataset grows or is reordered."""
    h = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if h < eval_fraction else "train"


def _chat_messages(prompt: Any) -> bool:
    """Whether a non-string prompt is a list of chat messages: objects with string role and content."""
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def tokenise_rows(rows: list[dict[str, Any]], spec: PromptSpec, tok: Any) -> tuple[dict[str, list], Counter]:
    """Template and tokenise; returns the shard's columns and rejections counted by reason."""
    cols: dict[str, list] = {f.name: [] for f in SCHEMA}
    rejected: Counter = Counter()
    for row in rows:
        prompt = row.get(spec.prompt_column)
        if prompt is None:
            rejected["missing_column"] += 1
            continue
        if isinstance(prompt, str) and "\ufffd" in prompt:
            rejected["undecodable"] += 1
            continue
        if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
            rejected["empty"] += 1
            continue
        if not isinstance(prompt, str) and not _chat_messages(prompt):
            rejected["malformed"] += 1
            continue
        if spec.chat_template and getattr(tok, "chat_template", None):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if spec.system_prompt:
                messages = [{"role": "system", "content": spec.system_prompt}, *messages]
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except (TemplateError, ValueError, TypeError, KeyError):  # e.g. roles the template refuses
                rejected["malformed"] += 1
                continue
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = prompt if isinstance(prompt, str) else json.dumps(prompt)
            ids = tok(text)["input_ids"]
        if len(ids) > spec.max_prompt_tokens:
            rejected["too_long"] += 1
            continue
        sid = sample_id(row)
        cols["sample_id"].append(sid)
        cols["split"].append(row.get("__split__") or split_of(sid, spec.eval_fraction))
        cols["prompt_text"].append(text)
        cols["prompt_ids"].append(ids)
        cols["reference_response"].append(
            _text(row.get(spec.response_column)) if spec.response_column else None
        )
        cols["answer"].append(_text(row.get(spec.answer_column)) if spec.answer_column else None)
        cols["kind"].append(_text(row.get(spec.kind_column)) if spec.kind_column else None)
    return cols, rejected


def shard_names(spec: PromptSpec) -> list[str]:
    n = len(source_rows(spec)[0])
    if n == 0:
        raise ValueError("the prompts dataset has no rows at all: check prompts.files / prompts.hub_id")
    return [f"part-{i:05d}" for i in range((n + spec.rows_per_shard - 1) // spec.rows_per_shard)]


@task(name="prompts-shard", task_run_name="prompts-{shard}")
def prompts_shard(
    store_uri: str,
    ref: ArtifactRef,
    shard: str,
    spec: PromptSpec,
    teacher: ArtifactRef,
    teacher_spec: TeacherSpec,
) -> dict:
    """Tokenise one slice of rows into `part-NNNNN.parquet` and mark it finished."""
    from transformers import AutoTokenizer

    store = ArtifactStore(store_uri)
    index = int(shard.split("-")[1])
    rows, pre_rejected = source_rows(spec)
    chunk = rows[index * spec.rows_per_shard : (index + 1) * spec.rows_per_shard]
    tok = AutoTokenizer.from_pretrained(
        str(teacher_stage.local_dir(store, teacher)), trust_remote_code=teacher_spec.trust_remote_code
    )
    cols, rejected = tokenise_rows(chunk, spec, tok)
    if index == 0:
        rejected.update(pre_rejected)  # read-time rejections are counted once, on the first shard
    name = f"{shard}.parquet"
    with store.shard_output(ref, name) as out:
        rows_written = write_shard(out, cols, SCHEMA)
        sha = hash_local_tree(out)[""]
    stats = {
        "rows": rows_written,
        "tokens": int(sum(len(x) for x in cols["prompt_ids"])),
        "eval_rows": cols["split"].count("eval"),
        "rejected": {r: int(rejected.get(r, 0)) for r in REJECT_REASONS},
    }
    return store.write_marker(ref, shard, {name: sha}, stats)


def summarise(markers: dict[str, dict]) -> dict[str, Any]:
    """Stage metrics; zero usable rows is an error naming every rejection reason."""
    rejected = Counter()
    for m in markers.values():
        rejected.update(m["rejected"])
    rows = sum(m["rows"] for m in markers.values())
    if rows == 0:
        raise ValueError(f"the prompts dataset has zero usable rows; rejected by reason: {dict(rejected)}")
    return {
        "rows": rows,
        "eval_rows": sum(m["eval_rows"] for m in markers.values()),
        "rejected": {r: int(rejected.get(r, 0)) for r in REJECT_REASONS},
        "rejected_total": int(sum(rejected.values())),
    }
