"""The catalog of a store: which artifacts it holds, one row per artifact, keys found by prefix and
lineage; what `a2d ls` and `a2d show` print. Reads only."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator, Mapping
from typing import Any

from a2d.stores.layout import KEY_PATTERN, MANIFEST, MARKERS, PLAN, SCRATCH_MARK, ArtifactRef
from a2d.stores.records import ArtifactRecords, Metadata, metadata_problems


class ArtifactCatalog(ArtifactRecords):
    """Listing and describing the artifacts under the store root."""

    def iter_refs(self, stage: str | None = None) -> Iterator[ArtifactRef]:
        """Every artifact folder `{stage}/{key}` (a known stage, a 16-hex-digit key) under the root."""
        from a2d.specs import STAGES

        stages = [stage] if stage else [s for s in self.root.listdir() if s in STAGES]
        for s in stages:
            for key in self.root.listdir(s):
                if KEY_PATTERN.match(key):
                    yield self.ref(s, key)

    def check_root(self) -> None:
        """Refuse a store root that is really a stage folder or an artifact folder inside a store."""
        from a2d.specs import STAGES

        names = set(self.root.listdir())
        parent = self.root.uri.rsplit("/", 1)[0]
        if names & {MANIFEST, PLAN, MARKERS}:
            raise ValueError(
                f"{self.root.uri} is an artifact folder, not a store root: pass the store with "
                f"--store {parent.rsplit('/', 1)[0]} and the artifact as stage/key"
            )
        name = self.root.uri.rsplit("/", 1)[1]
        if name in STAGES and names and all(KEY_PATTERN.match(n) for n in names if not n.startswith(".")):
            raise ValueError(
                f"{self.root.uri} is the {name} stage folder of a store, not a store root: use --store {parent}"
            )

    def describe(self, ref: ArtifactRef) -> dict[str, Any]:
        """One row of `a2d ls`: completeness, damaged metadata, shards done/total, bytes, created.

        One listing of the artifact and one read of each metadata file (manifest, plan, markers)."""
        loc = self.loc(ref)
        present = loc.files()
        metadata = self._metadata(loc, present)
        return self._row(ref, present, metadata, damaged=metadata_problems(metadata))

    def summary(self, ref: ArtifactRef) -> dict[str, Any]:
        """`describe` less its check of every marker (`damaged`): what a run's own summary shows, from
        one listing and the manifest (the plan too while there is none)."""
        loc = self.loc(ref)
        present = loc.files()
        metadata = {MANIFEST: self._read_listed(loc, MANIFEST, present)}
        if metadata[MANIFEST][0] is None:
            metadata[PLAN] = self._read_listed(loc, PLAN, present)
        return self._row(ref, present, metadata)

    @staticmethod
    def _row(
        ref: ArtifactRef,
        present: Mapping[str, int],
        metadata: Metadata,
        damaged: list[str] | None = None,
    ) -> dict[str, Any]:
        """The row `describe` (with `damaged`) and `summary` (without) return."""
        manifest = metadata.get(MANIFEST, (None, None))[0]
        complete = manifest is not None
        info = manifest if complete else (metadata.get(PLAN, (None, None))[0] or {})
        markers = [
            rel
            for rel in present
            if posixpath.dirname(rel) == MARKERS and rel.endswith(".json") and SCRATCH_MARK not in rel
        ]
        size = sum(
            v for k, v in present.items() if not k.startswith((".", MARKERS)) and SCRATCH_MARK not in k
        )
        row: dict[str, Any] = {"stage": ref.stage, "key": ref.key, "uri": ref.uri, "complete": complete}
        if damaged is not None:
            row["damaged"] = damaged
        return row | {
            "shards_done": len(markers),
            "shards_total": len(info.get("shards", [])),
            "bytes": int(size),
            "rows": info.get("rows"),
            "tokens": info.get("tokens"),
            "created": info.get("created"),
            "upstream": info.get("upstream", {}),
        }

    def find(self, key_prefix: str) -> ArtifactRef:
        """The one artifact whose key starts with `key_prefix` (or `stage/key`)."""
        from a2d.specs import STAGES

        given, stage = key_prefix, None
        if "/" in key_prefix:
            stage, key_prefix = key_prefix.split("/", 1)
        if (stage is not None and stage not in STAGES) or not re.fullmatch(r"[0-9a-f]*", key_prefix):
            raise KeyError(
                f"{given!r} is not an artifact key: give a key or a unique prefix of one (hex digits), or "
                f"stage/key such as prompts/8d35f8; `a2d ls` lists them (a folder is not a key: pass "
                "a store's root with --store)"
            )
        hits = [r for r in self.iter_refs(stage) if r.key.startswith(key_prefix)]
        if not hits:
            raise KeyError(f"no artifact with key {key_prefix!r} in {self.root.uri}; `a2d ls` lists them")
        if len(hits) > 1:
            names = ", ".join(f"{r.stage}/{r.key}" for r in hits)
            raise KeyError(f"key prefix {key_prefix!r} is ambiguous ({names}); give more characters")
        return hits[0]

    def upstream(self, ref: ArtifactRef) -> dict[str, str]:
        """{stage: key} of the artifacts `ref` was built from: from its manifest, else its plan."""
        loc = self.loc(ref)
        info = loc.read_json_checked(MANIFEST)[0] or loc.read_json_checked(PLAN)[0] or {}
        return dict(info.get("upstream", {}))

    def lineage(self, ref: ArtifactRef) -> dict[str, list[str]]:
        """Upstream (from the manifest or plan) and downstream (found by scanning) as `stage/key`."""
        upstream = [f"{stage}/{key}" for stage, key in sorted(self.upstream(ref).items())]
        downstream = [
            f"{other.stage}/{other.key}"
            for other in self.iter_refs()
            if other != ref and ref.key in self.upstream(other).values()
        ]
        return {"upstream": upstream, "downstream": sorted(downstream)}
