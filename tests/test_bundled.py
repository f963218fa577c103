"""Tests for the bundled demo dataset: determinism, answer correctness, extraction, JSONL."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from a2d.stores.bundled import KINDS, extract_answer, generate, is_correct, write_jsonl

ROWS = generate(300)
FIELDS = {"id", "kind", "prompt", "response", "answer"}


def _rows_of(kind: str) -> list[dict[str, str]]:
    rows = [r for r in ROWS if r["kind"] == kind]
    assert rows, f"no rows of kind {kind}"
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def test_deterministic_and_seed_sensitive() -> None:
    assert generate(50, seed=3) == generate(50, seed=3)
    assert generate(50, seed=3) != generate(50, seed=4)


def test_prefix_stable() -> None:
    big = generate(120, seed=7)
    for m in (1, 7, 33, 119):
        assert generate(m, seed=7) == big[:m]


def test_every_kind_present_and_cycling() -> None:
    rows = generate(len(KINDS))
    assert [r["kind"] for r in rows] == list(KINDS)
    assert [r["kind"] for r in ROWS[: 2 * len(KINDS)]] == list(KINDS) * 2


def test_row_shape_and_unique_ids() -> None:
    for i, row in enumerate(ROWS):
        assert set(row) == FIELDS
        assert all(isinstance(v, str) and v for v in row.values())
        assert row["id"] == f"bundled-0-{i}"
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    assert generate(1, seed=5)[0]["id"] == "bundled-5-0"


def test_templates_are_varied() -> None:
    # Strip numbers and quoted words so only the phrasing is left.
    for kind in KINDS:
        shapes = {re.sub(r"\d+|'[^']*'|\b[A-Z][a-z]+\b", "#", r["prompt"]) for r in _rows_of(kind)}
        assert len(shapes) >= 3, kind


@pytest.mark.parametrize("n", [0, -1])
def test_n_must_be_positive(n: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        generate(n)


def test_arithmetic_answers() -> None:
    ops = {"+": int.__add__, "plus": int.__add__, "-": int.__sub__, "minus": int.__sub__}
    ops |= {"*": int.__mul__, "times": int.__mul__}
    for row in _rows_of("arithmetic"):
        m = re.search(r"(\d+) (\+|-|\*|plus|minus|times) (\d+)", row["prompt"])
        assert m, row["prompt"]
        expected = ops[m.group(2)](int(m.group(1)), int(m.group(3)))
        assert row["answer"] == str(expected) and expected >= 0


def test_sorting_answers() -> None:
    for row in _rows_of("sorting"):
        nums = _ints(row["prompt"])
        descending = "largest to smallest" in row["prompt"] or "descending" in row["prompt"]
        assert row["answer"] == ", ".join(map(str, sorted(nums, reverse=descending)))
        assert row["response"] == row["answer"]


def test_counting_answers() -> None:
    for row in _rows_of("counting"):
        prompt = row["prompt"]
        letter = re.search(r"letter (\w) .*'(\w+)'|'(\w+)'.*letter (\w) ", prompt)
        if letter:
            ch = letter.group(1) or letter.group(4)
            word = letter.group(2) or letter.group(3)
            assert row["answer"] == str(word.count(ch)) and int(row["answer"]) >= 1
        else:
            items = prompt.split(": ", 1)[1].split("?")[0].split(", ")
            assert row["answer"] == str(len(items))


def test_comparison_answers() -> None:
    for row in _rows_of("comparison"):
        a, b = _ints(row["prompt"])
        wants_max = any(w in row["prompt"] for w in ("larger", "bigger", "greater"))
        assert a != b
        assert row["answer"] == str(max(a, b) if wants_max else min(a, b))


def test_sequence_answers() -> None:
    for row in _rows_of("sequence"):
        terms = _ints(row["prompt"])
        assert len(terms) == 4
        diffs = {b - a for a, b in zip(terms, terms[1:], strict=False)}
        if len(diffs) == 1:
            expected = terms[-1] + diffs.pop()
        else:
            assert all(b == 2 * a for a, b in zip(terms, terms[1:], strict=False))
            expected = terms[-1] * 2
        assert row["answer"] == str(expected) and expected > 0


def test_unit_and_word_problem_answers_are_small_naturals() -> None:
    factors = {1000, 100, 10, 60, 24, 7, 12}
    for row in _rows_of("unit_conversion"):
        (value,) = _ints(row["prompt"])
        answer = int(row["answer"])
        assert answer > 0
        assert max(value, answer) // min(value, answer) in factors
        assert max(value, answer) % min(value, answer) == 0
    for row in _rows_of("word_problem"):
        assert row["answer"].isdigit() and 0 < int(row["answer"]) <= 40


def test_reference_responses_are_correct() -> None:
    for row in ROWS:
        assert is_correct(row["response"], row["answer"], row["kind"]), row


def test_corrupted_responses_are_wrong() -> None:
    for row in ROWS:
        if row["kind"] == "sorting":
            bad = ", ".join(reversed(row["answer"].split(", ")))
        else:
            bad = f"The answer is {int(row['answer']) + 1}."
        assert not is_correct(bad, row["answer"], row["kind"]), row
        assert not is_correct("I don't know.", row["answer"], row["kind"])


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        ("I am not sure.", "arithmetic", None),
        ("", "sorting", None),
        ("The answer is 12. Next: 13", "sequence", "13"),  # last number wins, by design
        ("First 5 - 3 = 2, so 2", "arithmetic", "2"),
        ("That is 3,000 metres.", "unit_conversion", "3000"),
        ("42.0", "comparison", "42"),
        ("about 2.50 apples", "word_problem", "2.5"),
        ("It is -4.", "arithmetic", "-4"),
        ("The 3 numbers sorted: 2, 7, and 9.", "sorting", "2, 7, 9"),
        ("2,7,9", "sorting", "2, 7, 9"),
        ("9 2 7", "sorting", "9, 2, 7"),
        ("Only 5.", "sorting", "5"),
    ],
)
def test_extract_answer(text: str, kind: str, expected: str | None) -> None:
    assert extract_answer(text, kind) == expected


def test_extract_answer_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        extract_answer("1", "poetry")


def test_is_correct_numeric_comparison() -> None:
    assert is_correct("It is 42.0", "42", "arithmetic")
    assert is_correct("The answer is 1,000.", "1000", "unit_conversion")
    assert not is_correct("42.5", "42", "arithmetic")
    assert is_correct("Sorted: 2,7,9", "2, 7, 9", "sorting")
    assert not is_correct("Sorted: 2, 9, 7", "2, 7, 9", "sorting")


def test_write_jsonl_round_trip(tmp_path: Path) -> None:
    rows = generate(20, seed=1)
    rows[0] = {**rows[0], "prompt": "Café? ü"}
    path = tmp_path / "bundled.jsonl"
    write_jsonl(rows, str(path))
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and "Café".encode() in raw
    lines = raw.decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == len(rows) + 1
    assert [json.loads(line) for line in lines[:-1]] == rows
    assert lines[0] == json.dumps(rows[0], sort_keys=True, ensure_ascii=False)
