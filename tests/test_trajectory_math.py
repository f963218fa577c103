"""Pseudo-trajectory math: decode simulation round trip, snapshot sizes, the curriculum schedule and pairing."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from a2d.models.trajectory import (
    check_pairing,
    confidence_trajectory,
    mask_ratio_bounds,
    snapshot,
    snapshot_json_bytes,
)
from a2d.models.views import ViewSampler

CASES = [(1, 1, 1), (7, 3, 2), (37, 8, 3), (64, 32, 8), (50, 16, 16), (33, 64, 5), (20, 20, 7), (100, 256, 4)]


@pytest.mark.parametrize(("length", "block_size", "steps_per_block"), CASES)
def test_round_trip_and_block_order(length: int, block_size: int, steps_per_block: int) -> None:
    rng = np.random.default_rng(length * 1000 + block_size)
    unmask_step, snaps = confidence_trajectory(rng.random(length), block_size, steps_per_block)
    assert unmask_step.dtype == np.int16
    assert len(snaps) == int(unmask_step.max()) + 1
    assert not snaps[0].any() and snaps[-1].all()
    for k, snap in enumerate(snaps):
        np.testing.assert_array_equal(unmask_step <= k, snap)

    block_of = np.arange(length) // block_size  # (L,)
    for k in range(1, len(snaps)):
        new = np.flatnonzero(snaps[k] & ~snaps[k - 1])
        blocks = np.unique(block_of[new])
        assert blocks.size == 1, f"step {k} commits across blocks {blocks}"
        b = int(blocks[0])
        block_len = min(block_size, length - b * block_size)
        per_step = math.ceil(block_len / steps_per_block)
        block_done = snaps[k][block_of == b].all()
        assert new.size == per_step or (block_done and 0 < new.size < per_step)
    # Left to right: every step of block b precedes every step of block b + 1.
    for b in range(int(block_of.max())):
        assert unmask_step[block_of == b].max() < unmask_step[block_of == b + 1].min()


def test_within_block_commits_by_descending_confidence() -> None:
    confidence = np.array([0.1, 0.9, 0.5, 0.7])
    unmask_step, _ = confidence_trajectory(confidence, block_size=4, steps_per_block=4)
    np.testing.assert_array_equal(unmask_step, [4, 1, 3, 2])


def test_equal_confidence_breaks_ties_by_position() -> None:
    confidence = np.array([0.5, 0.5, 0.9, 0.5, 0.5, 0.5])
    unmask_step, _ = confidence_trajectory(confidence, block_size=6, steps_per_block=6)
    np.testing.assert_array_equal(unmask_step, [2, 3, 1, 4, 5, 6])
    again, _ = confidence_trajectory(confidence.copy(), block_size=6, steps_per_block=6)
    np.testing.assert_array_equal(unmask_step, again)


def test_nan_and_overflow_raise() -> None:
    with pytest.raises(ValueError, match="NaN"):
        confidence_trajectory(np.array([0.2, np.nan]), 2, 1)
    with pytest.raises(ValueError, match="int16"):
        confidence_trajectory(np.zeros(40000), 1, 1)


def test_snapshot_masks_later_steps() -> None:
    ids = np.array([11, 12, 13, 14])
    steps = np.array([2, 1, 3, 1], dtype=np.int16)
    np.testing.assert_array_equal(snapshot(ids, steps, 0, 99), [99, 99, 99, 99])
    np.testing.assert_array_equal(snapshot(ids, steps, 1, 99), [99, 12, 99, 14])
    np.testing.assert_array_equal(snapshot(ids, steps, 3, 99), ids)
    with pytest.raises(ValueError, match="tokens"):
        snapshot(ids, steps[:3], 1, 99)


def test_snapshot_json_bytes_hand_example() -> None:
    prompt, ids, steps, mask = np.array([5, 1234]), np.array([7, 80, 9]), np.array([2, 1, 2]), 126336
    expected = json.dumps(
        {"prompt_ids": [5, 1234], "steps": [[5, 1234, 126336, 80, 126336], [5, 1234, 7, 80, 9]]}
    )
    assert snapshot_json_bytes(ids, steps, mask, prompt) == len(expected.encode())


def test_snapshot_json_bytes_matches_serialisation() -> None:
    rng = np.random.default_rng(3)
    for length, prompt_len in [(0, 4), (1, 0), (17, 9), (40, 3)]:
        ids = rng.integers(-5, 200000, length)
        prompt = rng.integers(0, 10 ** rng.integers(1, 7), prompt_len)
        steps, _ = confidence_trajectory(rng.random(length), 8, 3)
        record = {
            "prompt_ids": prompt.tolist(),
            "steps": [
                prompt.tolist() + snapshot(ids, steps, k, 999).tolist()
                for k in range(1, int(steps.max(initial=0)) + 1)
            ],
        }
        assert snapshot_json_bytes(ids, steps, 999, prompt) == len(json.dumps(record).encode())


def test_schedules() -> None:
    assert mask_ratio_bounds(0, 100, 0.0, 0.8, 1.0) == (0.0, 1.0)
    assert mask_ratio_bounds(50, 100, 0.0, 0.8, 1.0)[0] == pytest.approx(0.4)
    assert mask_ratio_bounds(500, 100, 0.0, 0.8, 1.0)[0] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        mask_ratio_bounds(0, 100, 0.0, 0.9, 0.8)


def _paired(length: int, seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, length)
    unmask_step, _ = confidence_trajectory(rng.random(length), 32, 8)
    return ids, {"sample_id": f"s{seed}", "response_ids": ids.copy(), "unmask_step": unmask_step}


def test_sampler_is_deterministic_per_step_and_index() -> None:
    sampler = ViewSampler(seed=7, total_steps=100, block_size=32)
    ids, traj = _paired(128, 0)

    def masks(step: int, index: int) -> np.ndarray:
        v = sampler.view(step, 0, index, "s0", ids, 0, False, traj, max_blocks=4)
        return np.concatenate([[v.block], v.masked])

    np.testing.assert_array_equal(masks(5, 0), masks(5, 0))
    assert not np.array_equal(masks(5, 0), masks(6, 0))
    assert not np.array_equal(masks(5, 0), masks(5, 1))
    assert sampler.view(5, 0, 0, "s0", ids, 0, False, traj, 4).source == "trajectory"
    assert not sampler.fallbacks


def test_sampler_ratio_follows_curriculum() -> None:
    sampler = ViewSampler(seed=0, total_steps=100, block_size=32, r_min_start=0.0, r_min_end=1.0, r_max=1.0)
    ids, traj = _paired(128, 0)
    late = [sampler.view(100, mb, 0, "s0", ids, 0, False, traj, 4) for mb in range(50)]
    assert all(v.ratio == pytest.approx(1.0) and v.masked.all() for v in late)  # every position masked


@pytest.mark.parametrize(
    ("reason", "edit"),
    [
        ("missing", lambda sid, ids, t: (sid, ids, None)),
        ("sample_id_mismatch", lambda sid, ids, t: (sid, ids, {**t, "sample_id": "other"})),
        ("length_mismatch", lambda sid, ids, t: (sid, ids[:-1], t)),
        ("ids_mismatch", lambda sid, ids, t: (sid, np.where(np.arange(ids.size) == 3, ids + 1, ids), t)),
    ],
)
def test_mismatch_falls_back_to_random(reason: str, edit: Callable[..., tuple[str, np.ndarray, Any]]) -> None:
    ids, traj = _paired(64, 0)
    sample_id, response_ids, trajectory = edit("s0", ids, traj)
    sampler = ViewSampler(seed=0, total_steps=10, block_size=16)
    view = sampler.view(3, 0, 0, sample_id, response_ids, 0, False, trajectory, 4)
    assert view.source == "random"
    assert view.masked.shape == (16,) and view.masked.any()
    assert sampler.fallbacks == {reason: 1}
    got = check_pairing(
        None if trajectory is None else trajectory["sample_id"],
        None if trajectory is None else trajectory["response_ids"],
        None if trajectory is None else trajectory["unmask_step"],
        sample_id,
        response_ids,
    )
    assert got == reason
