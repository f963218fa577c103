"""The eval's report: metrics.json, report.md and the speed/quality plot in the report shard, and
the table `a2d run` prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from a2d.models.report import markdown_report, plot_speed_quality, text_table
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, hash_local_tree
from a2d.stores.readers import EVAL_SHARD, read_metrics

REFERENCE_BASE = "ar:student-base"  # the lossless decoders' reference unless the base is the teacher


def report_text(doc: dict[str, Any], refs: dict[str, ArtifactRef]) -> str:
    """The Markdown report: every decoder's row in report order, the run's facts, lm-eval's tasks."""
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
    return {f"{EVAL_SHARD}/{k}": v for k, v in hash_local_tree(out).items()}


def print_table(store: ArtifactStore, ref: ArtifactRef) -> str:
    """The eval artifact's decoders as a text table, in report order."""
    doc = read_metrics(store, ref)
    order = doc.get("decoder_order", list(doc["decoders"]))
    return text_table({name: doc["decoders"][name] for name in order})
