"""`a2d plan`: what a config will store, stage by stage, before anything runs.

The teacher's shape comes from its spec or config.json (meta-device models, no weights); sample
lengths are measured on the prompts when the data and the tokenizer are at hand (bundled prompts
and a random teacher's byte tokenizer), else they are the config's bounds. The arithmetic is
`a2d.stores.plan`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from a2d.models import shapes
from a2d.models.shapes import TeacherShape
from a2d.specs import PipelineConfig
from a2d.stores.plan import BPE_CHARS, BYTE_TOKENIZER_CHARS, Lengths, Plan, project

DEFAULT_ROWS = 1000  # rows assumed where the config does not say (a hub dataset)
SAMPLE_ROWS = 2000  # rows tokenised to measure lengths


def teacher_shape(config: PipelineConfig) -> TeacherShape:
    """The teacher's shape from its spec, its config.json or the table of known teachers."""
    spec = config.teacher
    if spec.source == "random":
        return shapes.random_shape(spec.architecture, spec.layers, spec.hidden)
    if spec.source == "local":
        return shapes.local_shape(Path(spec.path or "").expanduser(), spec.trust_remote_code)
    if spec.source == "smollm2":
        return shapes.shape_from_config(shapes.KNOWN_SHAPES["smollm2"], "the known shape of SmolLM2-135M")
    found = shapes.hub_shape(spec.repo_id or "", spec.revision)
    if found is None:
        raise ValueError(
            f"teacher {spec.repo_id}: its shape is not known offline (not in a2d.models.shapes.KNOWN_SHAPES "
            "and no config.json in the HF cache); download its config.json once, or add it to the table"
        )
    return found


def _tokenizer(config: PipelineConfig) -> Any | None:
    """The teacher's tokenizer when it can be had without weights or network."""
    spec = config.teacher
    if spec.source == "random":
        from a2d.models.teacher import byte_tokenizer

        return byte_tokenizer()
    if spec.source == "local":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(Path(spec.path or "").expanduser()))
    return None


def _response_tokens(config: PipelineConfig, reference_tokens: float | None) -> float:
    if config.responses.source == "dataset" and reference_tokens is not None:
        return reference_tokens
    return float(config.responses.max_new_tokens)  # the budget: an upper bound of a teacher's answer


def lengths(config: PipelineConfig, rows: int | None = None) -> Lengths:
    """Rows and mean lengths: tokenised from the prompts where they and the tokenizer are at hand."""
    spec, tok = config.prompts, None
    if spec.source != "hub":
        tok = _tokenizer(config)
    if tok is not None:
        from a2d.tasks.prompts import source_rows, tokenise_rows

        every = source_rows(spec)[0]
        sample = every[:SAMPLE_ROWS]  # a big file is tokenised in full once, by its own stage
        cols, _ = tokenise_rows(sample, spec, tok)
        kept = len(cols["prompt_ids"]) or 1
        tokens = sum(len(ids) for ids in cols["prompt_ids"])
        chars = sum(len(t) for t in cols["prompt_text"])
        refs = [
            (r or "") + (a or "") for r, a in zip(cols["reference_response"], cols["answer"], strict=True)
        ]
        ref_chars = sum(len(t) for t in refs) / kept
        cpt = chars / max(tokens, 1)
        return Lengths(
            rows=rows or round(len(every) * len(cols["prompt_ids"]) / max(len(sample), 1)),
            prompt_tokens=tokens / kept,
            response_tokens=_response_tokens(config, ref_chars / cpt),
            chars_per_token=cpt,
            reference_chars=ref_chars,
            origin=f"prompts measured on {len(sample)} rows; responses at their budget",
        )
    cpt = BYTE_TOKENIZER_CHARS if config.teacher.source == "random" else BPE_CHARS
    configured = {"bundled": spec.bundled_rows, "mixture": sum(p.rows for p in spec.mixture)}
    given = rows or configured.get(spec.source)
    reference = (spec.response_column is not None) * config.responses.max_new_tokens * cpt
    return Lengths(
        rows=given or DEFAULT_ROWS,
        prompt_tokens=float(spec.max_prompt_tokens),
        response_tokens=_response_tokens(config, None),
        chars_per_token=cpt,
        reference_chars=reference,
        origin="bounds: max_prompt_tokens + max_new_tokens"
        + ("" if given else f", {DEFAULT_ROWS} rows assumed (--rows N)"),
    )


def plan_config(config: PipelineConfig, stages: tuple[str, ...], rows: int | None = None) -> Plan:
    """The projection of `stages` for `config` (`rows` overrides the row count)."""
    return project(config, teacher_shape(config), lengths(config, rows), stages)


def decimal(n: float) -> str:
    """Bytes in decimal units (1 MB = 10^6 B), as storage is billed."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def format_plan(plan: Plan) -> str:
    """The plan as a short table with a total, and the assumptions under it."""
    rows = [
        {
            "stage": s.stage,
            "rows": s.rows,
            "tokens": s.tokens,
            "bytes": decimal(s.bytes),
            "raw": decimal(s.raw_bytes),
            "note": s.note,
        }
        for s in plan.stages
    ]
    raw = sum(s.raw_bytes for s in plan.stages)
    rows.append(
        {"stage": "total", "rows": "", "tokens": "", "bytes": decimal(plan.total), "raw": decimal(raw)}
    )
    rows[-1]["note"] = "bytes: expected after zstd; raw: the uncompressed layout"
    cols = ["stage", "rows", "tokens", "bytes", "raw", "note"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = [
        f"plan {plan.name}: projected bytes per stage ({plan.lengths.origin}; shape: {plan.shape_origin})"
    ]
    lines.append("  ".join(c.ljust(widths[c]) for c in cols).rstrip())
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols).rstrip() for r in rows]
    return "\n".join(lines)
