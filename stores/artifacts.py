"""Artifacts: `{root}/{stage}/{key}/` folders with a plan, per-shard markers and a manifest written last.

`ArtifactStore` is the one face of the store; each concern lives in its own module below it:

    stores/layout.py     the metadata file names, `ArtifactRef` and the store's errors
    stores/records.py    addressing, reading manifest/plan/markers, a shard's checksums, local copies
    stores/build.py      the build protocol: lock, scratch, plan, shard publish and markers, commit
    stores/integrity.py  reuse checks, repair of lost metadata, reader-found damage, `verify`
    stores/catalog.py    listing, `a2d ls` rows, keys by prefix, lineage

Everything callers import from here (the types, the helpers) is re-exported under its old name.
"""

from __future__ import annotations

import time

from a2d.stores.build import git_revision, now_iso, package_version
from a2d.stores.catalog import ArtifactCatalog
from a2d.stores.integrity import ArtifactIntegrity
from a2d.stores.layout import (
    DAMAGED,
    KEY_PATTERN,
    MANIFEST,
    MARKERS,
    PLAN,
    SCRATCH_MARK,
    ArtifactRef,
    DamagedArtifactError,
    IncompleteArtifactError,
    StoreWriteError,
    cache_root,
)
from a2d.stores.records import SMALL_FILE, hash_file, hash_local_tree

__all__ = [
    "DAMAGED",
    "KEY_PATTERN",
    "MANIFEST",
    "MARKERS",
    "PLAN",
    "SCRATCH_MARK",
    "SMALL_FILE",
    "ArtifactRef",
    "ArtifactStore",
    "DamagedArtifactError",
    "IncompleteArtifactError",
    "StoreWriteError",
    "Timer",
    "cache_root",
    "git_revision",
    "hash_file",
    "hash_local_tree",
    "now_iso",
    "package_version",
]


class ArtifactStore(ArtifactCatalog, ArtifactIntegrity):
    """Every artifact of one store root, addressed by (stage, key): records, build, integrity, catalog."""


class Timer:
    """Seconds since construction; used for stage metrics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
