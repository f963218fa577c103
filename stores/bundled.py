"""Bundled demo dataset: deterministic, checkable prompts with reference answers.

Every prompt is generated from templates written here, so the dataset carries no
third-party text and needs no download. Numbers stay small because the intended
student is a ~135M-parameter instruct model. Each row is seeded from its own
``(seed, index)`` pair, which makes ``generate`` prefix-stable: asking for more rows
only appends.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

KINDS: tuple[str, ...] = (
    "arithmetic",
    "word_problem",
    "unit_conversion",
    "sorting",
    "counting",
    "comparison",
    "sequence",
)

_NUMBER_SUFFIX = "Answer with just the number."
_LIST_SUFFIX = "Answer with the numbers separated by commas."
_STEPS_SUFFIX = "Explain your reasoning step by step, then give the answer."
STYLES = ("answer", "steps")

_NAMES = (
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ravi", "he"),
    ("Mei", "she"),
    ("Lucas", "he"),
    ("Sara", "she"),
    ("Omar", "he"),
    ("Zoe", "she"),
)
_OBJECTS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "stamps", "shells")
_ITEMS = ("cat", "dog", "apple", "chair", "river", "lamp", "cup", "tree", "bird", "shoe", "pear")
_WORDS = (
    "carrot",
    "banana",
    "strawberry",
    "mississippi",
    "balloon",
    "bookkeeper",
    "coffee",
    "committee",
    "pepper",
    "cheese",
    "success",
    "parallel",
    "tomato",
    "umbrella",
    "letter",
    "grammar",
)
# (larger unit, smaller unit, how many smaller units make one larger unit)
_UNITS = (
    ("kilometres", "metres", 1000),
    ("metres", "centimetres", 100),
    ("centimetres", "millimetres", 10),
    ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("feet", "inches", 12),
    ("years", "months", 12),
)

_ARITHMETIC_TEMPLATES = (
    "What is {a} {sym} {b}?",
    "What is {a} {word} {b}?",
    "Calculate {a} {sym} {b}.",
    "Work out {a} {word} {b}.",
    "Compute {a} {sym} {b}.",
)
_OPERATORS = {"+": "plus", "-": "minus", "*": "times"}

# (template, operator); the operator decides how the two numbers are drawn.
_WORD_PROBLEM_TEMPLATES = (
    ("{name} has {a} {obj} and buys {b} more. How many {obj} does {pron} have now?", "+"),
    ("There are {a} {obj} in a box. {name} puts in {b} more. How many {obj} are in it now?", "+"),
    ("{name} picked {a} {obj} on Monday and {b} on Tuesday. How many {obj} did {pron} pick?", "+"),
    ("{name} had {a} {obj} and gave {b} to a friend. How many {obj} does {pron} have left?", "-"),
    ("{name} has {a} {obj} and loses {b} of them. How many {obj} are left?", "-"),
    ("{name} buys {a} bags of {b} {obj} each. How many {obj} does {pron} have in total?", "*"),
    ("{name} shares {a} {obj} equally among {b} friends. How many does each friend get?", "/"),
)

_UNIT_TEMPLATES = (
    "Convert {v} {src} to {dst}.",
    "How many {dst} are in {v} {src}?",
    "How many {dst} is {v} {src}?",
    "Express {v} {src} in {dst}.",
)

# (template, ascending?)
_SORTING_TEMPLATES = (
    ("Sort these numbers from smallest to largest: {nums}.", True),
    ("Put these numbers in ascending order: {nums}.", True),
    ("Arrange these numbers from lowest to highest: {nums}.", True),
    ("Sort these numbers from largest to smallest: {nums}.", False),
    ("Put these numbers in descending order: {nums}.", False),
)

_LETTER_TEMPLATES = (
    "How many times does the letter {letter} appear in '{word}'?",
    "Count how many times the letter {letter} occurs in the word '{word}'.",
    "In the word '{word}', how many times does the letter {letter} appear?",
)
_LIST_COUNT_TEMPLATE = "How many items are in this list: {items}?"

# (template, pick the larger?)
_COMPARISON_TEMPLATES = (
    ("Which is larger, {a} or {b}?", True),
    ("Which number is bigger: {a} or {b}?", True),
    ("What is the greater of {a} and {b}?", True),
    ("Which is smaller, {a} or {b}?", False),
    ("What is the smaller of {a} and {b}?", False),
)

_SEQUENCE_TEMPLATES = (
    "What number comes next: {seq}?",
    "What is the next number in the sequence {seq}?",
    "Here is a sequence: {seq}. What number comes next?",
    "Continue the pattern {seq}. Which number follows?",
)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    """Two-operand +, - or * with a non-negative result."""
    sym = rng.choice(tuple(_OPERATORS))
    if sym == "+":
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        result = a + b
    elif sym == "-":
        a = rng.randint(10, 60)
        b = rng.randint(1, a)
        result = a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        result = a * b
    template = rng.choice(_ARITHMETIC_TEMPLATES)
    return template.format(a=a, b=b, sym=sym, word=_OPERATORS[sym]), str(result)


def _word_problem(rng: random.Random) -> tuple[str, str]:
    """A one-step story problem over a named person and a countable object."""
    template, op = rng.choice(_WORD_PROBLEM_TEMPLATES)
    name, pron = rng.choice(_NAMES)
    obj = rng.choice(_OBJECTS)
    if op == "+":
        a, b = rng.randint(2, 20), rng.randint(2, 15)
        result = a + b
    elif op == "-":
        a = rng.randint(5, 20)
        b = rng.randint(1, a - 1)
        result = a - b
    elif op == "*":
        a, b = rng.randint(2, 6), rng.randint(2, 6)
        result = a * b
    else:
        # Draw the quotient first so the division is always exact.
        b, result = rng.randint(2, 5), rng.randint(2, 6)
        a = b * result
    question = template.format(name=name, pron=pron, obj=obj, a=a, b=b)
    return question, str(result)


def _unit_conversion(rng: random.Random) -> tuple[str, str]:
    """Convert between a larger and a smaller unit; results are whole numbers."""
    big, small, factor = rng.choice(_UNITS)
    template = rng.choice(_UNIT_TEMPLATES)
    # Mostly big -> small (multiply); the reverse only on exact multiples.
    if rng.random() < 0.7:
        value = rng.randint(2, 12)
        return template.format(v=value, src=big, dst=small), str(value * factor)
    result = rng.randint(2, 9)
    return template.format(v=result * factor, src=small, dst=big), str(result)


def _sorting(rng: random.Random) -> tuple[str, str]:
    """Three to five distinct numbers to sort up or down."""
    template, ascending = rng.choice(_SORTING_TEMPLATES)
    nums = rng.sample(range(1, 51), rng.randint(3, 5))
    ordered = sorted(nums, reverse=not ascending)
    question = template.format(nums=", ".join(map(str, nums)))
    return question, ", ".join(map(str, ordered))


def _counting(rng: random.Random) -> tuple[str, str]:
    """Count a letter in a word, or the items in a short list."""
    if rng.random() < 0.25:
        items = rng.sample(_ITEMS, rng.randint(3, 8))
        return _LIST_COUNT_TEMPLATE.format(items=", ".join(items)), str(len(items))
    word = rng.choice(_WORDS)
    # sorted(): set iteration order of str depends on PYTHONHASHSEED.
    letter = rng.choice(sorted(set(word)))
    template = rng.choice(_LETTER_TEMPLATES)
    return template.format(letter=letter, word=word), str(word.count(letter))


def _comparison(rng: random.Random) -> tuple[str, str]:
    """Pick the larger or smaller of two distinct two-digit numbers."""
    template, larger = rng.choice(_COMPARISON_TEMPLATES)
    a = rng.randint(10, 99)
    swapped = int(str(a)[::-1])
    # Digit-swapped pairs (48 vs 84) are the classic trap for small models.
    if rng.random() < 0.3 and swapped != a and a % 10 != 0:
        b = swapped
    else:
        b = rng.choice([x for x in range(10, 100) if x != a])
    result = max(a, b) if larger else min(a, b)
    return template.format(a=a, b=b), str(result)


def _sequence(rng: random.Random) -> tuple[str, str]:
    """Four terms of a rising, falling or doubling sequence; ask for the fifth."""
    pattern = rng.choice(("up", "down", "double"))
    if pattern == "double":
        start = rng.randint(1, 5)
        terms = [start * 2**i for i in range(5)]
    else:
        step = rng.randint(1, 9)
        if pattern == "up":
            start = rng.randint(1, 20)
        else:
            # Large enough that the fifth term is still positive.
            start = 4 * step + rng.randint(1, 20)
            step = -step
        terms = [start + step * i for i in range(5)]
    template = rng.choice(_SEQUENCE_TEMPLATES)
    return template.format(seq=", ".join(map(str, terms[:4]))), str(terms[4])


_GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "arithmetic": _arithmetic,
    "word_problem": _word_problem,
    "unit_conversion": _unit_conversion,
    "sorting": _sorting,
    "counting": _counting,
    "comparison": _comparison,
    "sequence": _sequence,
}


def generate(n: int, seed: int = 0, style: str = "answer") -> list[dict[str, str]]:
    """Return ``n`` rows; kinds cycle in ``KINDS`` order; a row depends only on (seed, index).

    `style` "steps" asks for the reasoning before the answer (responses of a few dozen tokens, where a
    drafter has room to draft); "answer" asks for the answer alone.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    rows = []
    for index in range(n):
        kind = KINDS[index % len(KINDS)]
        # A per-row string seed keeps rows independent, so growing n only appends.
        rng = random.Random(f"{seed}-{index}")
        question, answer = _GENERATORS[kind](rng)
        if style == "steps":
            reference = answer if kind == "sorting" else f"The answer is {answer}."
            prompt, response = f"{question} {_STEPS_SUFFIX}", reference
        elif kind == "sorting":
            prompt, response = f"{question} {_LIST_SUFFIX}", answer
        else:
            prompt, response = f"{question} {_NUMBER_SUFFIX}", f"The answer is {answer}."
        rows.append(
            {
                "id": f"bundled-{seed}-{index}",
                "kind": kind,
                "prompt": prompt,
                "response": response,
                "answer": answer,
            }
        )
    return rows


# Thousands groups ("1,000") must be followed by a non-digit, else "1,2345" would read as 1,234.
_NUMBER_RE = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
# Integers joined by commas and/or spaces, optionally with "and" before the last one.
_RUN_RE = re.compile(r"\d+(?:(?:\s*,\s*|\s+)(?:and\s+)?\d+)*")


def _canonical_number(token: str) -> str | None:
    """'1,000' -> '1000', '42.0' -> '42', '2.50' -> '2.5'; None when not a number."""
    try:
        value = Decimal(token.replace(",", "").strip())
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _canonical_list(run: str) -> str:
    """'2,7 and 9' -> '2, 7, 9'."""
    return ", ".join(str(int(x)) for x in re.findall(r"\d+", run))


def extract_answer(text: str, kind: str) -> str | None:
    """Pull the canonical answer out of a free-form reply; None when nothing is found.

    Numeric kinds take the LAST number, so "The answer is 12. Next: 13" gives "13":
    models tend to reason first and conclude last. Sorting takes the first run of two
    or more integers, falling back to a lone integer, so "the 3 numbers: 2, 7, 9"
    gives "2, 7, 9". Sorting ignores signs and decimals (generated numbers are 1..50).
    """
    if kind not in _GENERATORS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if kind == "sorting":
        runs = [m.group(0) for m in _RUN_RE.finditer(text)]
        if not runs:
            return None
        multi = [r for r in runs if len(re.findall(r"\d+", r)) >= 2]
        return _canonical_list(multi[0] if multi else runs[0])
    tokens = _NUMBER_RE.findall(text)
    if not tokens:
        return None
    return _canonical_number(tokens[-1])


def is_correct(text: str, answer: str, kind: str) -> bool:
    """True when the extracted answer equals the reference (numerically for numeric kinds)."""
    got = extract_answer(text, kind)
    if got is None:
        return False
    if kind == "sorting":
        return got == _canonical_list(answer)
    expected = _canonical_number(answer)
    if expected is None:
        return got == answer.strip()
    return Decimal(got) == Decimal(expected)


def write_jsonl(rows: list[dict[str, str]], path: str | os.PathLike[str]) -> None:
    """Write one JSON object per line, UTF-8, keys sorted, every line newline-terminated."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")
