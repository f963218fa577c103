"""What each stage of a multi-stage run did (built, reused, resumed), for the run's own summary."""

from __future__ import annotations

from dataclasses import dataclass

from a2d.stores.artifacts import ArtifactRef, ArtifactStore, Timer


@dataclass(frozen=True)
class Outcome:
    """One stage: reused when its artifact was complete before the stage ran; resumed when some of its
    shards were already finished (`done_before` of `shards`)."""

    stage: str
    key: str
    uri: str
    reused: bool
    done_before: int
    shards: int
    seconds: float
    bytes: int

    @property
    def outcome(self) -> str:
        if self.reused:
            return "reused"
        if self.done_before:
            return f"resumed ({self.done_before} of {self.shards} shards already finished)"
        return "built"


def before(store: ArtifactStore, ref: ArtifactRef) -> tuple[bool, int]:
    """(complete, finished shards) of an artifact before its stage runs; (False, 0) where nothing is."""
    row = store.summary(ref)  # nothing there: not complete, no shard finished
    return bool(row["complete"]), int(row["shards_done"])


def observe(store: ArtifactStore, planned: ArtifactRef, run) -> tuple[ArtifactRef, Outcome]:
    """Run a stage (`run()` returns its ref) and say what it did."""
    complete, done = before(store, planned)
    timer = Timer()
    ref = run()
    row = store.summary(ref)
    return ref, Outcome(
        ref.stage, ref.key, ref.uri, complete, done, row["shards_total"], timer.seconds, row["bytes"]
    )


def table(outcomes: list[Outcome]) -> list[dict]:
    """The rows of a run's summary table artifact."""
    return [
        {
            "stage": o.stage,
            "key": o.key,
            "outcome": o.outcome,
            "seconds": round(o.seconds, 1),
            "size_mb": round(o.bytes / 2**20, 2),
            "uri": o.uri,
        }
        for o in outcomes
    ]
