"""Teacher pseudo-trajectories (d3LLM style) stored as one unmask step per token, and the curriculum views drawn from them.

A trajectory of a response of length L is `unmask_step` (int16, (L,)): position i is committed at
step unmask_step[i] (1-based). The state after step k shows the token where unmask_step <= k and
the mask token elsewhere, so step 0 is all masked. Storing one int16 per token replaces d3LLM's
full per-step snapshots, which grow as O(L * steps).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INT16_MAX = int(np.iinfo(np.int16).max)


def confidence_trajectory(
    confidence: np.ndarray, block_size: int, steps_per_block: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Simulate a semi-autoregressive confidence decode; return (unmask_step (L,), committed snapshots for k=0..K)."""
    confidence = np.asarray(confidence, dtype=np.float64)  # (L,)
    if confidence.ndim != 1:
        raise ValueError(f"confidence must be 1-D, got shape {confidence.shape}")
    if np.isnan(confidence).any():
        raise ValueError("confidence contains NaN; teacher probabilities must be finite")
    if block_size < 1 or steps_per_block < 1:
        raise ValueError(f"block_size and steps_per_block must be >= 1, got {block_size}, {steps_per_block}")
    length = confidence.shape[0]
    starts = list(range(0, length, block_size))
    per_step = [math.ceil(min(block_size, length - s) / steps_per_block) for s in starts]
    # Check the step count before simulating, so an impossible int16 encoding fails fast.
    num_steps = sum(math.ceil(min(block_size, length - s) / n) for s, n in zip(starts, per_step, strict=True))
    if num_steps > INT16_MAX:
        raise ValueError(f"trajectory needs {num_steps} steps, more than int16 can store ({INT16_MAX})")

    unmask_step = np.zeros(length, dtype=np.int16)  # (L,)
    committed = np.zeros(length, dtype=bool)  # (L,)
    snapshots = [committed.copy()]
    step = 0
    for start, n in zip(starts, per_step, strict=True):
        block = confidence[start : start + block_size]  # (block_len,)
        # Stable sort on -confidence: equal confidence commits the lower position first.
        order = start + np.argsort(-block, kind="stable")  # (block_len,)
        for i in range(0, order.shape[0], n):
            step += 1
            chosen = order[i : i + n]
            committed[chosen] = True
            unmask_step[chosen] = step
            snapshots.append(committed.copy())
    return unmask_step, snapshots


def _check_pair(response_ids: np.ndarray, unmask_step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return both arrays as 1-D numpy arrays of equal length, or raise."""
    response_ids = np.asarray(response_ids)
    unmask_step = np.asarray(unmask_step)
    if response_ids.ndim != 1 or unmask_step.ndim != 1:
        raise ValueError(f"expected 1-D arrays, got shapes {response_ids.shape} and {unmask_step.shape}")
    if response_ids.shape != unmask_step.shape:
        raise ValueError(
            f"response_ids has {response_ids.shape[0]} tokens but unmask_step has {unmask_step.shape[0]}"
        )
    return response_ids, unmask_step


def snapshot(response_ids: np.ndarray, unmask_step: np.ndarray, k: int, mask_id: int) -> np.ndarray:
    """Response token ids after step k: positions committed later than k show mask_id."""
    response_ids, unmask_step = _check_pair(response_ids, unmask_step)
    return np.where(unmask_step > k, np.asarray(mask_id, dtype=response_ids.dtype), response_ids)  # (L,)


def _json_int_widths(values: np.ndarray) -> np.ndarray:
    """Characters json.dumps spends on each integer (digits plus a minus sign)."""
    values = np.asarray(values, dtype=np.int64)
    magnitude = np.abs(values)
    digits = np.ones(values.shape, dtype=np.int64)
    bound = 10
    while (magnitude >= bound).any():
        digits += magnitude >= bound
        bound *= 10
    return digits + (values < 0)


def _json_list_bytes(count: int, digit_sum: int) -> int:
    """Size of json.dumps(list_of_ints): brackets, ", " separators and the digits."""
    return 2 + digit_sum + 2 * max(count - 1, 0)


def snapshot_json_bytes(
    response_ids: np.ndarray, unmask_step: np.ndarray, mask_id: int, prompt_ids: np.ndarray
) -> int:
    """Bytes of d3LLM's record json.dumps({"prompt_ids": P, "steps": [P + snapshot(k) for k in 1..K]})."""
    response_ids, unmask_step = _check_pair(response_ids, unmask_step)
    prompt_ids = np.asarray(prompt_ids)
    num_steps = int(unmask_step.max()) if unmask_step.size else 0
    prompt_digits = int(_json_int_widths(prompt_ids).sum())
    # Counted, not serialised: the record is O(L * K) characters and the benchmark runs it per sample.
    token_widths = _json_int_widths(response_ids)  # (L,)
    mask_width = int(_json_int_widths(np.asarray([mask_id]))[0])
    shown = np.clip(
        num_steps - unmask_step.astype(np.int64) + 1, 0, num_steps
    )  # (L,) steps with the token visible
    response_digits = int((token_widths * shown).sum() + mask_width * (num_steps - shown).sum())
    row_len = prompt_ids.shape[0] + response_ids.shape[0]
    rows = num_steps * _json_list_bytes(row_len, 0) + prompt_digits * num_steps + response_digits
    steps_bytes = 2 + rows + 2 * max(num_steps - 1, 0)
    prompt_bytes = _json_list_bytes(prompt_ids.shape[0], prompt_digits)
    return len(json.dumps({"prompt_ids": [], "steps": []})) - 4 + prompt_bytes + steps_bytes


def mask_ratio_bounds(
    step: int, total_steps: int, r_min_start: float, r_min_end: float, r_max: float
) -> tuple[float, float]:
    """(r_min, r_max) at a training step; r_min rises linearly from r_min_start to r_min_end."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    # Check both ends so a bad config fails at step 0, not mid-run.
    for name, r_min in (("r_min_start", r_min_start), ("r_min_end", r_min_end)):
        if not 0.0 <= r_min <= r_max <= 1.0:
            raise ValueError(f"need 0 <= {name} <= r_max <= 1, got {name}={r_min}, r_max={r_max}")
    frac = min(max(step / total_steps, 0.0), 1.0)
    return r_min_start + (r_min_end - r_min_start) * frac, r_max


def window_size_at(step: int, total_steps: int, sizes: tuple[int, ...]) -> int:
    """Window size for a step: sizes[i] during the i-th equal fraction of training."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be a non-empty tuple of positive ints, got {sizes}")
    clamped = min(max(step, 0), total_steps)
    return sizes[min(len(sizes) - 1, clamped * len(sizes) // total_steps)]


def view_rng(seed: int, step: int, rank: int, micro_batch: int) -> np.random.Generator:
    """Generator for one micro-batch; the same four ints give the same masks on any rerun."""
    return np.random.default_rng(np.random.SeedSequence([seed, step, rank, micro_batch]))


@dataclass(frozen=True, eq=False)  # eq=False: field-wise == on arrays has no single truth value
class MaskView:
    """Which response positions show the mask token in one training view, and its complement."""

    masked: np.ndarray  # bool (L,): True where the response position shows the mask token
    complement: np.ndarray  # bool (L,): window flipped; prefix clean; future masked
    window: tuple[int, int]  # [start, end) over response positions
    ratio: float  # target mask ratio r inside the window
    source: str  # "trajectory" or "random"


def _masked_count(width: int, ratio: float) -> int:
    """Masked positions in a window of `width`; shared by both views so they mask equally many."""
    return int(math.floor(ratio * width + 0.5))


def _draw_window(length: int, window: int, ratio: float, rng: np.random.Generator) -> tuple[int, int]:
    """Validate and draw [start, end): start uniform over [0, max(0, L - window)]."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must lie in [0, 1], got {ratio}")
    start = int(rng.integers(0, max(0, length - window) + 1))
    return start, min(length, start + window)


def _view(window_masked: np.ndarray, length: int, start: int, ratio: float, source: str) -> MaskView:
    """Place a window's mask in the full response: prefix clean, future masked."""
    end = start + window_masked.shape[0]
    masked = np.zeros(length, dtype=bool)  # (L,)
    masked[start:end] = window_masked
    masked[end:] = True
    complement = masked.copy()  # (L,)
    complement[start:end] = ~window_masked
    return MaskView(masked=masked, complement=complement, window=(start, end), ratio=ratio, source=source)


def trajectory_view(unmask_step: np.ndarray, window: int, ratio: float, rng: np.random.Generator) -> MaskView:
    """Teacher state inside a random window when about (1 - ratio) of the window was committed."""
    unmask_step = np.asarray(unmask_step)
    length = unmask_step.shape[0]
    start, end = _draw_window(length, window, ratio, rng)
    width = end - start
    # Stable sort by unmask step: positions committed in the same step go left to right.
    order = np.argsort(unmask_step[start:end], kind="stable")  # (w,)
    window_masked = np.zeros(width, dtype=bool)  # (w,)
    window_masked[order[width - _masked_count(width, ratio) :]] = True
    return _view(window_masked, length, start, ratio, "trajectory")


def random_view(length: int, window: int, ratio: float, rng: np.random.Generator) -> MaskView:
    """Same window logic as trajectory_view, with a uniformly random masked subset."""
    start, end = _draw_window(length, window, ratio, rng)
    width = end - start
    window_masked = np.zeros(width, dtype=bool)  # (w,)
    window_masked[rng.permutation(width)[: _masked_count(width, ratio)]] = True
    return _view(window_masked, length, start, ratio, "random")


def check_pairing(
    traj_sample_id: str | None,
    traj_response_ids: np.ndarray | None,
    traj_unmask_step: np.ndarray | None,
    sample_id: str,
    response_ids: np.ndarray,
) -> str | None:
    """None when the trajectory was recorded for exactly this response, else why not."""
    if traj_sample_id is None or traj_response_ids is None or traj_unmask_step is None:
        return "missing"
    if traj_sample_id != sample_id:
        return "sample_id_mismatch"
    length = np.asarray(response_ids).shape[0]
    if np.asarray(traj_response_ids).shape[0] != length or np.asarray(traj_unmask_step).shape[0] != length:
        return "length_mismatch"
    if not np.array_equal(traj_response_ids, response_ids):
        return "ids_mismatch"
    return None


@dataclass
class ViewSampler:
    """Curriculum views per sample: trajectory masks when paired, random masks (counted) otherwise."""

    seed: int
    total_steps: int
    r_min_start: float = 0.0
    r_min_end: float = 0.8
    r_max: float = 0.8
    window_sizes: tuple[int, ...] = (16, 24, 32)
    fallbacks: Counter[str] = field(default_factory=Counter, init=False)

    def __post_init__(self) -> None:
        """Validate the schedules once, at construction."""
        mask_ratio_bounds(0, self.total_steps, self.r_min_start, self.r_min_end, self.r_max)
        window_size_at(0, self.total_steps, self.window_sizes)

    def view(
        self,
        step: int,
        rank: int,
        micro_batch: int,
        index_in_batch: int,
        sample_id: str,
        response_ids: np.ndarray,
        trajectory: dict[str, Any] | None,
    ) -> MaskView:
        """Draw r and the window, then mask from the trajectory if it belongs to this response."""
        # The index_in_batch-th child of view_rng's seed sequence: samples in one micro-batch differ.
        seq = np.random.SeedSequence([self.seed, step, rank, micro_batch], spawn_key=(index_in_batch,))
        rng = np.random.default_rng(seq)
        r_min, r_max = mask_ratio_bounds(step, self.total_steps, self.r_min_start, self.r_min_end, self.r_max)
        ratio = float(rng.uniform(r_min, r_max))
        window = window_size_at(step, self.total_steps, self.window_sizes)
        traj = trajectory or {}
        reason = check_pairing(
            traj.get("sample_id"), traj.get("response_ids"), traj.get("unmask_step"), sample_id, response_ids
        )
        if reason is None:
            return trajectory_view(np.asarray(traj["unmask_step"]), window, ratio, rng)
        self.fallbacks[reason] += 1
        return random_view(np.asarray(response_ids).shape[0], window, ratio, rng)
