"""What each stage of a multi-stage run did (built, reused, resumed), for the run's own summary."""

from __future__ import annotations

from dataclasses import dataclass

from a2d.stores.artifacts import ArtifactRef, ArtifactStore, Timer


@dataclass(frozen=True)
class Outcome:
    """One stage: reused when its artifact was complete before the stage ran; resumed when some of its
    shards were already finished (`done_before` of `shards`) or, a training stage, from the
    checkpoint of step `from_step`."""

    stage: str
    key: str
    uri: str
    reused: bool
    done_before: int
    shards: int
    seconds: float
    bytes: int
    from_step: int = 0

    @property
    def outcome(self) -> str:
        if self.reused:
            return "reused"
        if self.done_before:
            return f"resumed ({self.done_before} of {self.shards} shards already finished)"
        if self.from_step:
            return f"resumed from the checkpoint of step {self.from_step}"
        return "built"


TRAINING = frozenset({"drafter", "head", "vfm"})  # stages that checkpoint inside their one shard


def before(store: ArtifactStore, ref: ArtifactRef) -> tuple[bool, int, int]:
    """(complete, finished shards, checkpoint step a training stage resumes from) of an artifact
    before its stage runs; (False, 0, 0) where nothing is."""
    row = store.summary(ref)  # nothing there: not complete, no shard finished
    step = 0
    if not row["complete"] and ref.stage in TRAINING:
        from a2d.stores.checkpoints import newest_step
        from a2d.tasks.training import workdir

        step = newest_step(store, ref, workdir(store, ref))
    return bool(row["complete"]), int(row["shards_done"]), step


def observe(store: ArtifactStore, planned: ArtifactRef, run) -> tuple[ArtifactRef, Outcome]:
    """Run a stage (`run()` returns its ref) and say what it did."""
    complete, done, step = before(store, planned)
    timer = Timer()
    ref = run()
    row = store.summary(ref)
    return ref, Outcome(
        ref.stage, ref.key, ref.uri, complete, done, row["shards_total"], timer.seconds, row["bytes"], step
    )


def table(outcomes: list[Outcome]) -> list[dict]:
    """The rows of a run's summary table artifact: the link to each stage's page first (the UI
    draws the columns in this order, and the long URI last, so a narrow window shows the links)."""
    return [
        {
            "artifact": stage_table_link(o.stage),
            "stage": o.stage,
            "outcome": o.outcome,
            "seconds": round(o.seconds, 1),
            "size_mb": round(o.bytes / 2**20, 2),
            "key": o.key,
            "uri": o.uri,
        }
        for o in outcomes
    ]


def stage_table_link(stage: str) -> str:
    """The stage's table artifact (its history across runs) in the Prefect UI, or its key where no
    UI URL is known."""
    from prefect.settings import PREFECT_UI_URL

    from a2d.tasks.report import artifact_key

    key = artifact_key("a2d", stage)
    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/artifacts/key/{key}" if ui else key
