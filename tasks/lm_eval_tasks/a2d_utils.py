"""Data loading and scoring of the `a2d_bundled` lm-eval task: the eval stage's own answer check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load_rows(path: str | None = None, **_: Any):
    """The task's test split from a JSONL of {prompt or prompt_text, answer, kind} rows."""
    import datasets

    source = Path(path) if path else HERE / "bundled.jsonl"
    if not source.is_file():
        raise FileNotFoundError(
            f'a2d_bundled: no rows at {source}; pass --metadata \'{{"path": "rows.jsonl"}}\''
        )
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    keys = ("sample_id", "prompt", "prompt_text", "answer", "kind")
    columns = {k: [r.get(k) for r in rows] for k in keys}
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict(columns)})


def doc_to_text(doc: dict[str, Any]) -> str:
    """The templated prompt when the row has one (the eval stage's export), else the raw prompt."""
    return doc.get("prompt_text") or doc["prompt"]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    from a2d.stores.bundled import is_correct

    return {"exact_match": float(is_correct(results[0], doc["answer"], doc["kind"]))}
