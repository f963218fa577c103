"""Where the head and VFM trainers keep their checkpoints, and how a retry on another machine finds them."""

from __future__ import annotations

from pathlib import Path

from a2d.stores import checkpoints
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, cache_root
from a2d.stores.uri import Location
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
