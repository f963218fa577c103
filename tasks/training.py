"""Where the head, VFM and drafter trainings keep their checkpoints, how a retry on another machine
finds them, and the task body every training stage shares (a training process, `a2d.tasks.train`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from a2d.models.teacher import resolve_device
from a2d.specs import DrafterSpec, HeadSpec, TeacherSpec, TrainOptions, VFMSpec
from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, cache_root
from a2d.stores.uri import Location
from a2d.tasks.concurrency import gpu_slot
from a2d.tasks.runtime import logger
from a2d.tasks.train import TrainJob, run_training


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


def stage_job(
    store: ArtifactStore,
    ref: ArtifactRef,
    inputs: dict[str, ArtifactRef],
    spec: HeadSpec | VFMSpec | DrafterSpec,
    train: TrainOptions,
    device: str,
    teacher_spec: TeacherSpec | None = None,
) -> TrainJob:
    """The job of a training stage's task: its artifact's work folder, the store by its absolute URI."""
    return TrainJob(
        store_uri=store.root.uri,
        ref=ref,
        inputs=inputs,
        spec=spec,
        train=train,
        teacher_spec=teacher_spec,
        device=str(resolve_device(device)),
        workdir=str(workdir(store, ref)),
    )


def run_trainer(store: ArtifactStore, job: TrainJob) -> tuple[dict[str, Any], Path]:
    """A training stage's task body: bring back mirrored checkpoints, run the training process(es)
    while holding the GPU slot, and return its result with the verified checkpoint of the last step.
    A stopped run raises `Stopped`, a short one RuntimeError, each saying to rerun the stage."""
    stage, steps = job.stage, job.spec.steps
    work = Path(job.workdir)
    restore_checkpoints(store, job.ref, work)  # the trainer mirrors new ones itself
    with gpu_slot():
        result = run_training(job)
    last = checkpoints.latest(work / "checkpoints")
    if last is None or checkpoints.step_of(last) != steps:
        raise RuntimeError(
            f"{stage} training ended at step {result['step']} without a verified checkpoint of step {steps} "
            f"(newest: {last.name if last else 'none'}); rerun the {stage} stage to resume"
        )
    return result, last
