"""Teacher pseudo-trajectories (d3LLM style) stored as one unmask step per token (the training views
drawn from them are in `a2d.models.views`).

A trajectory of a response of length L is `unmask_step` (int16, (L,)): position i is committed at
step unmask_step[i] (1-based). The state after step k shows the token where unmask_step <= k and
the mask token elsewhere, so step 0 is all masked. Storing one int16 per token replaces d3LLM's
full per-step snapshots, which grow as O(L * steps).
"""

from __future__ import annotations

import json
import math

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
