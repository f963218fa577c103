"""Held-out prompts grouped by prompt set, the way every decode benchmark reports speed.

The sets are the prompts stage's own groups (`a2d.stores.corpora.prompt_set`): `bundled` (the
checkable generator's held-out rows), `code` (functions of held-out standard-library modules) and
`docs` (passages of held-out documentation topics). No training row shares a module or a topic with
the `code` and `docs` rows, so their figures are transfer, not memory.
"""

from __future__ import annotations

from typing import Any

from a2d.stores.corpora import prompt_set


def by_set(rows: list[dict[str, Any]], per_set: int) -> dict[str, list[dict[str, Any]]]:
    """Up to `per_set` rows of each set (0: all), each set in stored order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        group = out.setdefault(prompt_set(r["kind"]), [])
        if not per_set or len(group) < per_set:
            group.append(r)
    return out


def bootstrap_ratio(num_tokens, num_secs, den_tokens, den_secs, reps: int = 2000) -> list[float]:
    """95 % interval of (Σ tokens / Σ seconds) ratios, resampling prompts."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = len(num_tokens)
    nt, ns, dt, ds = map(np.asarray, (num_tokens, num_secs, den_tokens, den_secs))
    idx = rng.integers(0, n, (reps, n))
    ratios = (nt[idx].sum(1) / ns[idx].sum(1)) / (dt[idx].sum(1) / ds[idx].sum(1))
    return [round(float(np.percentile(ratios, 2.5)), 4), round(float(np.percentile(ratios, 97.5)), 4)]


def speed(stats: dict[str, dict[str, list]], name: str, ar: str = "ar:greedy") -> dict[str, Any]:
    """A decoder's tokens/s over AR's on the same prompts, with its 95 % bootstrap interval."""
    st, base = stats[name], stats[ar]
    rate = sum(st["tokens"]) / sum(st["seconds"])
    ar_rate = sum(base["tokens"]) / sum(base["seconds"])
    return {
        "speedup_vs_ar": round(rate / ar_rate, 4),
        "speedup_vs_ar_ci95": bootstrap_ratio(st["tokens"], st["seconds"], base["tokens"], base["seconds"]),
        "tokens_per_s": round(rate, 3),
    }
