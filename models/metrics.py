"""Decode-quality metrics for decoders: token agreement with the teacher, repetition, and d3LLM's AUP.

Everything here is plain Python over token lists and small tables, so evaluation code can be tested
without torch. Accuracies passed to `aup` are percentages (0-100), as in the d3LLM paper; the
per-sample metrics return shares (0-1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

FAMILY_SEP = ":"


def token_agreement(pred: Sequence[int], ref: Sequence[int]) -> float:
    """Share of reference positions where `pred` holds the same token.

    Positions of `ref` beyond the end of `pred` count as wrong, and extra tokens in `pred` past the
    end of `ref` are ignored: the reference defines what there was to get right. An empty reference
    scores 1.0 against an empty prediction and 0.0 against anything else, so that a decoder that
    emits tokens where the teacher stopped at once is not rewarded.
    """
    if not ref:
        return 1.0 if not pred else 0.0
    same = sum(1 for p, r in zip(pred, ref, strict=False) if p == r)
    return same / len(ref)


def exact_match(pred: Sequence[int], ref: Sequence[int]) -> bool:
    """True when `pred` and `ref` are the same token sequence, length included."""
    return list(pred) == list(ref)


def repetition_rate(tokens: Sequence[int]) -> float:
    """Share of tokens equal to the token before them (denominator len - 1); 0.0 below two tokens.

    Degenerate diffusion decodes loop on one token; this catches the cheapest form of that loop.
    """
    if len(tokens) < 2:
        return 0.0
    repeats = sum(1 for prev, cur in zip(tokens[:-1], tokens[1:], strict=True) if prev == cur)
    return repeats / (len(tokens) - 1)


def _weight(y: float, y_max: float, alpha: float) -> float:
    """d3LLM's accuracy weight W(y) = min(exp(-alpha * (1 - y / y_max)), 1)."""
    return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)


def aup(
    points: Sequence[tuple[float, float]],
    y_max: float,
    alpha: float = 3.0,
    drop_below: float = 5.0,
) -> float:
    """d3LLM's Area Under Parallelism curve over (rho = tokens per forward, y = accuracy %) points.

    Points are sorted by rho (ties: higher accuracy first, so y1 is the best setting at the lowest
    parallelism); points more than `drop_below` under y1 are dropped, because a speed-up bought with
    that much accuracy is not counted. The first point contributes the rectangle rho1 * y1; each
    later segment a trapezoid of accuracy weighted by W(y), which discounts accuracy below `y_max`
    (the best accuracy of any method on the task). A single AR point (rho = 1) scores y.
    """
    if not points:
        raise ValueError("aup needs at least one (rho, accuracy) point")
    if not (math.isfinite(y_max) and y_max > 0):
        raise ValueError(f"y_max must be a positive finite number, got {y_max}")
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a non-negative finite number, got {alpha}")
    if not math.isfinite(drop_below) or drop_below < 0:
        raise ValueError(f"drop_below must be a non-negative finite number, got {drop_below}")
    for rho, y in points:
        if not (math.isfinite(rho) and rho > 0):
            raise ValueError(f"rho (tokens per forward) must be positive and finite, got {rho}")
        if not (math.isfinite(y) and y >= 0):
            raise ValueError(f"accuracy must be a non-negative finite percentage, got {y}")

    ordered = sorted(((float(r), float(y)) for r, y in points), key=lambda p: (p[0], -p[1]))
    y1 = ordered[0][1]
    kept = [p for p in ordered if p[1] >= y1 - drop_below]

    rho1 = kept[0][0]
    area = rho1 * y1
    for (rho_prev, y_prev), (rho_cur, y_cur) in zip(kept[:-1], kept[1:], strict=True):
        weighted = y_cur * _weight(y_cur, y_max, alpha) + y_prev * _weight(y_prev, y_max, alpha)
        area += 0.5 * (rho_cur - rho_prev) * weighted
    return area


def family_of(decoder: str) -> str:
    """The family of a decoder name: the part before the first ':' ("threshold:0.9" -> "threshold")."""
    return decoder.split(FAMILY_SEP, 1)[0]


def group_families(decoders: Mapping[str, Any]) -> dict[str, list[str]]:
    """Decoder names grouped by family, in first-seen order, so one family is one AUP curve."""
    groups: dict[str, list[str]] = {}
    for name in decoders:
        groups.setdefault(family_of(name), []).append(name)
    return groups


def family_aup(
    decoders: Mapping[str, Mapping[str, Any]],
    metric: str = "token_agreement",
    y_max: float | None = None,
    alpha: float = 3.0,
    drop_below: float = 5.0,
) -> dict[str, float]:
    """AUP per family from `summarise_decoder` results, using `metric` (a share) as accuracy in percent.

    `y_max` defaults to the best value of `metric` over all decoders, as d3LLM uses the best
    accuracy of any method on the task. Decoders whose metric is None are skipped, and families left
    without points are omitted.
    """
    values = {name: s[metric] for name, s in decoders.items() if s.get(metric) is not None}
    if not values:
        return {}
    top = y_max if y_max is not None else 100.0 * max(values.values())
    if top <= 0:
        raise ValueError(f"y_max must be positive; best {metric} is {top}")
    result: dict[str, float] = {}
    for family, names in group_families(decoders).items():
        points = [(float(decoders[n]["tpf"]), 100.0 * float(values[n])) for n in names if n in values]
        if points:
            result[family] = aup(points, top, alpha=alpha, drop_below=drop_below)
    return result


def _mean(values: Sequence[float]) -> float:
    """Arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)


BOOTSTRAP_RESAMPLES = 1000


def bootstrap_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[float]:
    """Percentile bootstrap 95 % interval of the mean of per-sample `values` (fixed seed: reproducible)."""
    import random

    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return [means[int(0.025 * (resamples - 1))], means[int(math.ceil(0.975 * (resamples - 1)))]]


def summarise_decoder(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate per-sample decode records of one decoder into speed and quality numbers.

    Each record has `tokens`, `teacher_tokens`, `forwards`, `seconds` and `correct` (bool or None
    when the task has no checkable answer). TPF and tokens/s are ratios of totals, not means of
    ratios, so long samples weigh by their length as in d3LLM; the quality metrics are means over
    samples, each with a bootstrap 95 % interval (`ci95`). tokens_per_s is None when no time was
    recorded. Speculative decoders' records also carry, per verify forward, `accepted` (drafts that
    held), `drafted` (drafts fed) and `draftable` (whether the forward could have carried drafts: not
    a prompt's first forward, not a one-token budget): `mean_accepted` is drafted tokens accepted per
    verify forward (the base's own correction token is not counted), `acceptance_by_offset[i]` the
    share of fed drafts at offset i + 1 that held, `no_draft_share` the share of draftable verify
    forwards fed no drafts.
    """
    if not records:
        raise ValueError("summarise_decoder needs at least one record")
    total_tokens = sum(len(r["tokens"]) for r in records)
    total_forwards = sum(int(r["forwards"]) for r in records)
    total_seconds = sum(float(r["seconds"]) for r in records)
    if total_forwards <= 0:
        raise ValueError(f"records report {total_forwards} forwards in total; TPF is undefined")
    judged = [float(bool(r["correct"])) for r in records if r.get("correct") is not None]
    agreement = [token_agreement(r["tokens"], r["teacher_tokens"]) for r in records]
    exact = [float(exact_match(r["tokens"], r["teacher_tokens"])) for r in records]
    rounds = [a for r in records for a in r.get("accepted") or []]
    fed = [d for r in records for d in r.get("drafted") or []]
    could = [
        d for r in records for d, c in zip(r.get("drafted") or [], r.get("draftable") or [], strict=True) if c
    ]
    offsets = max(fed, default=0)
    by_offset = [
        round(sum(a >= i for a, d in zip(rounds, fed, strict=True) if d >= i) / sum(d >= i for d in fed), 4)
        for i in range(1, offsets + 1)
    ]
    ci = {"token_agreement": bootstrap_ci(agreement), "exact_match": bootstrap_ci(exact)}
    if judged:
        ci["answer_accuracy"] = bootstrap_ci(judged)
    return {
        "tpf": total_tokens / total_forwards,
        "tokens_per_s": total_tokens / total_seconds if total_seconds > 0 else None,
        "token_agreement": _mean(agreement),
        "exact_match": _mean(exact),
        "answer_accuracy": _mean(judged) if judged else None,
        "repetition_rate": _mean([repetition_rate(r["tokens"]) for r in records]),
        "mean_accepted": _mean(rounds) if rounds else None,
        "acceptance_by_offset": by_offset if rounds else None,
        "no_draft_share": round(sum(d == 0 for d in could) / len(could), 4) if could else None,
        "samples": len(records),
        "ci95": ci,
    }
