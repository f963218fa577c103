"""Decode metrics, d3LLM's AUP against hand arithmetic, and the report renderers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from a2d.models.metrics import (
    aup,
    exact_match,
    family_aup,
    family_of,
    repetition_rate,
    summarise_decoder,
    token_agreement,
)
from a2d.models.report import markdown_report, plot_speed_quality, text_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_token_agreement_counts_reference_positions() -> None:
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == pytest.approx(0.75)
    # A short prediction loses the positions it never reached.
    assert token_agreement([1, 2], [1, 2, 3, 4]) == pytest.approx(0.5)
    # Extra predicted tokens past the reference are ignored.
    assert token_agreement([1, 2, 3, 4, 5, 6], [1, 2, 3]) == 1.0
    assert token_agreement([], [1, 2]) == 0.0


def test_token_agreement_empty_reference() -> None:
    assert token_agreement([], []) == 1.0
    assert token_agreement([7], []) == 0.0


def test_exact_match_needs_equal_length() -> None:
    assert exact_match([1, 2, 3], [1, 2, 3])
    assert not exact_match([1, 2, 3], [1, 2])
    assert not exact_match([1, 2], [1, 2, 3])
    assert exact_match((4, 5), [4, 5])
    assert exact_match([], [])


def test_repetition_rate() -> None:
    assert repetition_rate([]) == 0.0
    assert repetition_rate([5]) == 0.0
    assert repetition_rate([5, 5]) == 1.0
    assert repetition_rate([1, 2, 3, 4]) == 0.0
    # Pairs (1,1) (1,2) (2,2) (2,2): three repeats over four pairs.
    assert repetition_rate([1, 1, 2, 2, 2]) == pytest.approx(3 / 4)
    # Non-adjacent repeats are not loops.
    assert repetition_rate([1, 2, 1, 2]) == 0.0


def test_aup_hand_computed_table() -> None:
    # Sorted by rho: (1, 80) (2, 78) (3, 76) (4, 70). y1 = 80, so the cut is 75: 70 is dropped,
    # 76 and 78 are kept. With y_max = 82 and alpha = 3:
    #   W(80) = exp(-3 * 2/82) = 0.929442   80 W(80) = 74.355370
    #   W(78) = exp(-3 * 4/82) = 0.863863   78 W(78) = 67.381289
    #   W(76) = exp(-3 * 6/82) = 0.802910   76 W(76) = 61.021188
    # AUP = 1 * 80 + 0.5 * (2 - 1) * (67.381289 + 74.355370) + 0.5 * (3 - 2) * (61.021188 + 67.381289)
    #     = 80 + 70.868330 + 64.201238 = 215.069568
    points = [(1.0, 80.0), (2.0, 78.0), (4.0, 70.0), (3.0, 76.0)]
    expected = (
        1 * 80
        + 0.5 * 1 * (78 * math.exp(-3 * 4 / 82) + 80 * math.exp(-3 * 2 / 82))
        + 0.5 * 1 * (76 * math.exp(-3 * 6 / 82) + 78 * math.exp(-3 * 4 / 82))
    )
    assert expected == pytest.approx(215.069568, abs=1e-5)
    assert aup(points, y_max=82.0) == pytest.approx(expected, rel=1e-12)
    # The dropped point really is ignored, and input order does not matter.
    assert aup(points[:2] + points[3:], y_max=82.0) == pytest.approx(expected, rel=1e-12)
    assert aup(list(reversed(points)), y_max=82.0) == pytest.approx(expected, rel=1e-12)
    # Widening the cut to 10 keeps (4, 70) and adds 0.5 * (4 - 3) * (76 W(76) + 70 W(70)) = 53.073870.
    extra = 0.5 * 1 * (76 * math.exp(-3 * 6 / 82) + 70 * math.exp(-3 * 12 / 82))
    assert extra == pytest.approx(53.073870, abs=1e-5)
    assert aup(points, y_max=82.0, drop_below=10.0) == pytest.approx(expected + extra, rel=1e-12)


@pytest.mark.parametrize("y", [0.0, 37.5, 82.0, 100.0])
def test_aup_single_ar_point_is_its_accuracy(y: float) -> None:
    assert aup([(1.0, y)], y_max=100.0) == pytest.approx(y)


def test_aup_at_full_accuracy_is_plain_area() -> None:
    # With every y at y_max, W = 1 and AUP is the trapezoid area: 1 * 50 + 0.5 * 3 * (50 + 50) = 200.
    assert aup([(1.0, 50.0), (4.0, 50.0)], y_max=50.0) == pytest.approx(200.0)


def test_aup_monotonic() -> None:
    base = [(1.0, 80.0), (2.0, 79.0)]
    score = aup(base, y_max=80.0)
    # A faster setting that keeps accuracy adds area.
    assert aup([*base, (3.0, 78.0)], y_max=80.0) > score
    # Higher accuracy at the same speed scores higher.
    assert aup([(1.0, 80.0), (2.0, 79.5)], y_max=80.0) > score
    # A stronger best method elsewhere (higher y_max) discounts everyone else.
    assert aup(base, y_max=90.0) < score
    # Weights never exceed 1, so an accuracy above y_max is not inflated.
    assert aup([(1.0, 80.0), (2.0, 80.0)], y_max=60.0) == pytest.approx(80 + 0.5 * (80 + 80))


@pytest.mark.parametrize(
    ("points", "y_max"),
    [
        ([], 80.0),
        ([(1.0, 80.0)], 0.0),
        ([(1.0, 80.0)], -1.0),
        ([(0.0, 80.0)], 80.0),
        ([(1.0, math.nan)], 80.0),
    ],
)
def test_aup_rejects_bad_input(points: list[tuple[float, float]], y_max: float) -> None:
    with pytest.raises(ValueError):
        aup(points, y_max=y_max)


def _records() -> list[dict[str, Any]]:
    return [
        {
            "tokens": [1, 2, 3, 3],
            "teacher_tokens": [1, 2, 4, 3],
            "forwards": 2,
            "seconds": 0.5,
            "correct": True,
        },
        {"tokens": [5, 6], "teacher_tokens": [5, 6], "forwards": 2, "seconds": 1.5, "correct": None},
    ]


def test_summarise_decoder_two_records() -> None:
    summary = summarise_decoder(_records())
    assert summary["tpf"] == pytest.approx(6 / 4)  # 6 tokens over 4 forwards
    assert summary["tokens_per_s"] == pytest.approx(6 / 2.0)  # 6 tokens over 2 s
    assert summary["token_agreement"] == pytest.approx((3 / 4 + 1.0) / 2)
    assert summary["exact_match"] == pytest.approx(0.5)
    assert summary["answer_accuracy"] == pytest.approx(1.0)  # only the first record was judged
    assert summary["repetition_rate"] == pytest.approx((1 / 3 + 0.0) / 2)
    assert summary["samples"] == 2


def test_summarise_decoder_edge_cases() -> None:
    unjudged = [{**r, "correct": None} for r in _records()]
    assert summarise_decoder(unjudged)["answer_accuracy"] is None
    wrong = [{**r, "correct": False} for r in _records()]
    assert summarise_decoder(wrong)["answer_accuracy"] == 0.0
    untimed = [{**r, "seconds": 0.0} for r in _records()]
    assert summarise_decoder(untimed)["tokens_per_s"] is None
    with pytest.raises(ValueError):
        summarise_decoder([])
    with pytest.raises(ValueError):
        summarise_decoder([{**r, "forwards": 0} for r in _records()])


def _decoders() -> dict[str, dict[str, Any]]:
    def s(tpf: float, agree: float, acc: float | None) -> dict[str, Any]:
        return {
            "tpf": tpf,
            "tokens_per_s": 10.0 * tpf,
            "token_agreement": agree,
            "exact_match": agree / 2,
            "answer_accuracy": acc,
            "repetition_rate": 0.01,
            "samples": 8,
        }

    return {
        "ar": s(1.0, 0.9, 0.5),
        "threshold:0.9": s(2.0, 0.88, 0.45),
        "threshold:0.5": s(4.0, 0.8, None),
        "entropy:0.4": s(3.0, 0.85, None),
    }


def test_family_aup() -> None:
    decoders = _decoders()
    assert family_of("threshold:0.9") == "threshold"
    assert family_of("ar") == "ar"
    scores = family_aup(decoders)
    assert set(scores) == {"ar", "threshold", "entropy"}
    assert scores["ar"] == pytest.approx(90.0)  # single AR point scores its accuracy
    # threshold: y1 = 88 at rho 2, 80 is dropped (80 < 83), so only the rectangle 2 * 88 remains.
    assert scores["threshold"] == pytest.approx(2 * 88.0)
    by_accuracy = family_aup(decoders, metric="answer_accuracy")
    assert set(by_accuracy) == {"ar", "threshold"}  # entropy has no judged samples


def test_plot_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "plots" / "speed_quality.png"
    plot_speed_quality(_decoders(), str(path))
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000


def test_markdown_report_lists_everything() -> None:
    decoders = _decoders()
    text = markdown_report(decoders, family_aup(decoders), {"teacher": "smollm2", "prompts": 8})
    for name in decoders:
        assert f"| {name} |" in text
    assert "- **teacher**: smollm2" in text
    assert "| threshold | 176.00 |" in text
    assert "—" in text  # missing answer accuracy
    assert "AUP" in text and "y_max" in text


def test_text_table_is_fixed_width() -> None:
    table = text_table(_decoders())
    lines = table.splitlines()
    assert lines[0].split()[0] == "decoder"
    assert len(lines) == 2 + len(_decoders())
    # Every row ends at the same column, since numbers are right-aligned to the header width.
    assert len({len(line) for line in lines}) == 1
    head_row = next(line for line in lines if line.startswith("threshold:0.5"))
    assert "4.00" in head_row and "—" in head_row
