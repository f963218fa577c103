"""What an artifact is on disk and what names it: its metadata files, its reference and its errors.

Layout of one artifact, `{root}/{stage}/{key}/`:

    _plan.json            what is being built: spec, upstream keys, shard names (written first)
    _markers/<shard>.json one per finished shard: its files with sha256, rows, tokens, stats
    <shard files>         part-00000.parquet, part-00000.zarr/…, model/…
    manifest.json         written last and atomically: only its presence makes the artifact complete
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from a2d.stores.uri import Location

MANIFEST = "manifest.json"
PLAN = "_plan.json"
DAMAGED = "_damaged.json"  # shards a reader found damaged: the next run rebuilds them
MARKERS = "_markers"
SCRATCH_MARK = ".tmp-"  # in the names of shard scratch folders and of atomic-write temp files
KEY_PATTERN = re.compile(r"^[0-9a-f]{16}$")


class ArtifactRef(BaseModel):
    """What crosses a task boundary: small, hashable, enough to find the artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    stage: str
    key: str
    uri: str

    def location(self, storage_options: dict[str, Any] | None = None) -> Location:
        return Location.of(self.uri, storage_options)


class IncompleteArtifactError(RuntimeError):
    """Raised when a consumer is handed an artifact whose manifest is missing or damaged."""


class DamagedArtifactError(IncompleteArtifactError):
    """A complete artifact whose files do not match their checksums; the message names them."""


class StoreWriteError(OSError):
    """A write to the store failed (refused, 5xx, disk full); the message names the object, the store
    and what was left unmarked, and the store's own error is chained as the cause."""


def cache_root() -> Path:
    """Local cache for copies of remote artifacts and remote stores' training work ($A2D_CACHE)."""
    return Path(os.environ.get("A2D_CACHE", Path.home() / ".cache" / "a2d"))
