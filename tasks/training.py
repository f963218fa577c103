"""Where the head, VFM and drafter trainers keep their checkpoints, how a retry on another machine
finds them, and the task body the in-process trainers (VFM, drafter) share."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from a2d.specs import DrafterSpec, HeadSpec
from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, cache_root
from a2d.stores.uri import Location
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.interrupt import Stopped, stop_requested
from a2d.tasks.runtime import logger


def workdir(store: ArtifactStore, ref: ArtifactRef) -> Path:
    """Where checkpoints live: inside the artifact on local disk, else in the local cache."""
    loc = store.loc(ref)
    if loc.is_local:
        return loc.local_path()
    return cache_root() / "work" / ref.stage / ref.key


def restore_checkpoints(store: ArtifactStore, ref: ArtifactRef, work: Path) -> Location | None:
    """On a remote store, bring the newest checkpoint mirrored there into `work/checkpoints` (a retry
    on another machine resumes from it) and return where checkpoints are mirrored; None on local disk."""
    remote = checkpoints.remote_root(store, ref)
    if remote is not None:
        found = checkpoints.restore(remote, work / "checkpoints")
        if found is not None:
            logger().info("%s %s resumes from checkpoint %s", ref.stage, ref.key, found.name)
    return remote


def lr_lambda(spec: HeadSpec | DrafterSpec) -> Callable[[int], float]:
    """Linear warmup over `warmup_steps`, then `lr_schedule` (cosine, linear or constant) to `steps`."""

    def f(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        if spec.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if spec.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return f


def run_trainer(
    store: ArtifactStore,
    ref: ArtifactRef,
    steps: int,
    train: Callable[[Path, Location | None], dict[str, Any]],
) -> tuple[dict[str, Any], Path]:
    """A training stage's task body: bring back mirrored checkpoints, run `train(work, remote)` while
    holding the GPU slot (not at all when SIGTERM came first), and return its result with the verified
    checkpoint of step `steps`. A stopped or short run raises, saying to rerun the stage."""
    stage = ref.stage
    work = workdir(store, ref)
    remote = restore_checkpoints(store, ref, work)
    if stop_requested():  # SIGTERM came while this task was getting ready: start nothing
        raise Stopped(
            f"{stage} training was not started: SIGTERM arrived first; rerun the {stage} stage to resume"
        )
    with gpu_slot():
        result = train(work, remote)
    if result["stopped"]:
        raise Stopped(
            f"{stage} training stopped by SIGTERM at step {result['step']} after saving a checkpoint; "
            f"rerun the {stage} stage to resume"
        )
    last = checkpoints.latest(work / "checkpoints")
    if last is None or checkpoints.step_of(last) != steps:
        raise RuntimeError(
            f"{stage} training ended at step {result['step']} without a verified checkpoint of step {steps} "
            f"(newest: {last.name if last else 'none'}); rerun the {stage} stage to resume"
        )
    return result, last
