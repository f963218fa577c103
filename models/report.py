"""Render decoder summaries (from `models.metrics.summarise_decoder`) as a plot, Markdown and a text table.

The plot is drawn on a bare matplotlib `Figure` with the Agg canvas rather than through pyplot, so
rendering sets no global backend and leaks no open figures in long-running workers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from a2d.models.metrics import group_families

NONE_MARK = "—"

# (header, summary key, format); the single source of the decoder table for Markdown and text.
# A key "ci95.<metric>" is that metric's bootstrap 95 % interval, shown as lo–hi.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("TPF", "tpf", "{:.2f}"),
    ("tokens/s", "tokens_per_s", "{:.2f}"),
    ("× AR", "speedup_vs_ar", "{:.2f}"),
    ("token agreement", "token_agreement", "{:.3f}"),
    ("95% CI", "ci95.token_agreement", "{:.2f}"),
    ("exact match", "exact_match", "{:.3f}"),
    ("answer accuracy", "answer_accuracy", "{:.3f}"),
    ("95% CI", "ci95.answer_accuracy", "{:.2f}"),
    ("repetition", "repetition_rate", "{:.3f}"),
    ("accepted/fwd", "mean_accepted", "{:.2f}"),
    ("≠ ref", "mismatches_vs_reference", "{:d}"),
    ("samples", "samples", "{:d}"),
)

AUP_NOTE = (
    "AUP (area under parallelism, d3LLM) scores a family of decoder settings as one curve: points are "
    "(ρ = tokens per forward, y = accuracy %), sorted by ρ; points more than 5 below the accuracy y₁ "
    "of the lowest-ρ point are dropped; AUP = ρ₁y₁ + Σᵢ≥₂ ½(ρᵢ − ρᵢ₋₁)(yᵢW(yᵢ) + yᵢ₋₁W(yᵢ₋₁)) with "
    "W(y) = min(exp(−3(1 − y/y_max)), 1) and y_max the best accuracy of any decoder. An autoregressive "
    "decoder (a single point at ρ = 1) scores exactly its accuracy, so higher is better and speed only "
    "counts while accuracy holds."
)


def _fmt(value: Any, spec: str) -> str:
    """Format one table cell; None (a metric that does not apply) becomes a dash."""
    if value is None:
        return NONE_MARK
    return spec.format(int(value) if spec == "{:d}" else float(value))


def _cell(summary: Mapping[str, Any], key: str, spec: str) -> str:
    if key.startswith("ci95."):
        ci = (summary.get("ci95") or {}).get(key.split(".", 1)[1])
        return NONE_MARK if ci is None else f"{_fmt(ci[0], spec)}–{_fmt(ci[1], spec)}"
    return _fmt(summary.get(key), spec)


def ran(decoders: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The decoders that ran (a skipped one carries only the reason it was skipped)."""
    return {name: s for name, s in decoders.items() if "tpf" in s}


def _rows(decoders: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The decoder table as strings: one row per decoder that ran, name first, then COLUMNS."""
    return [[name, *(_cell(s, key, spec) for _, key, spec in COLUMNS)] for name, s in ran(decoders).items()]


def _md_cell(text: str) -> str:
    """Escape pipes so a decoder name cannot split a Markdown table cell."""
    return text.replace("|", "\\|")


def _md_table(header: list[str], rows: list[list[str]], text_columns: tuple[int, ...] = (0,)) -> list[str]:
    """Markdown table lines: `text_columns` left-aligned, the rest (numbers) right-aligned."""
    align = [":---" if i in text_columns else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


def text_table(decoders: Mapping[str, Mapping[str, Any]]) -> str:
    """The decoder table as fixed-width plain text for a terminal."""
    header = ["decoder", *(h for h, _, _ in COLUMNS)]
    rows = _rows(decoders)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def markdown_report(
    decoders: Mapping[str, Mapping[str, Any]], aup: Mapping[str, float], meta: Mapping[str, Any]
) -> str:
    """A Markdown evaluation report: meta bullets, the decoder table, AUP per family and how AUP is computed.

    `aup` maps a family name (the decoder-name prefix before ':') to its AUP, as returned by
    `models.metrics.family_aup`.
    """
    families = group_families(decoders)
    lines = ["# Decoder evaluation", "", "## Run", ""]
    lines += [f"- **{key}**: {value}" for key, value in meta.items()] or ["- (no metadata)"]
    lines += ["", "## Decoders", ""]
    lines += _md_table(["decoder", *(h for h, _, _ in COLUMNS)], _rows(decoders))
    skipped = [f"- {name}: skipped ({s['skipped']})" for name, s in decoders.items() if "skipped" in s]
    lines += ["", *skipped] if skipped else []
    lines += ["", "## AUP by family", ""]
    aup_rows = [
        [family, _fmt(value, "{:.2f}"), ", ".join(families.get(family, [])) or NONE_MARK]
        for family, value in sorted(aup.items(), key=lambda kv: -kv[1])
    ]
    if aup_rows:
        lines += _md_table(["family", "AUP", "decoders"], aup_rows, text_columns=(0, 2))
    else:
        lines.append("No family has an AUP (no accuracy values).")
    lines += ["", AUP_NOTE, ""]
    return "\n".join(lines)


def plot_speed_quality(decoders: Mapping[str, Mapping[str, Any]], path: str) -> None:
    """Save a PNG of quality against tokens per forward, one labelled point per decoder, families joined.

    Circles are token agreement with the teacher; squares are answer accuracy where a decoder has it.
    A family's points are joined in order of TPF so each line is that family's speed-quality curve.
    """
    # matplotlib is imported here, not with the module: ~1.8 s that every process importing the
    # flows (each served run, each CLI call) would pay for a plot only the eval stage draws.
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    decoders = ran(decoders)
    fig = Figure(figsize=(7.5, 5.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # One colour per family, shared by its agreement and accuracy series, so the pair reads as one.
    cycle = rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (family, names) in enumerate(group_families(decoders).items()):
        colour = cycle[index % len(cycle)]
        ordered = sorted(names, key=lambda n: float(decoders[n]["tpf"]))
        xs = [float(decoders[n]["tpf"]) for n in ordered]
        agree = [float(decoders[n]["token_agreement"]) for n in ordered]
        ax.plot(xs, agree, marker="o", color=colour, label=f"{family}: token agreement")
        judged = [n for n in ordered if decoders[n].get("answer_accuracy") is not None]
        if judged:
            ax.plot(
                [float(decoders[n]["tpf"]) for n in judged],
                [float(decoders[n]["answer_accuracy"]) for n in judged],
                marker="s",
                linestyle="--",
                color=colour,
                label=f"{family}: answer accuracy",
            )
        for name, x, y in zip(ordered, xs, agree, strict=True):
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("share (token agreement / answer accuracy)")
    ax.set_title("Speed vs quality")
    ax.grid(True, alpha=0.3)
    if decoders:
        ax.legend(fontsize=7, loc="best")
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png")
