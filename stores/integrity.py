"""Integrity and repair: whether an artifact still holds, what is wrong with it, and the demotion
that makes the next run rebuild exactly what is damaged.

Metadata that cannot be read (a truncated manifest.json or marker) is treated like a failed
checksum: it is named, the artifact is demoted to partial, and a rerun rebuilds what it covered. A
marker lost under an intact manifest is rewritten from the manifest once the shard's files verify.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from a2d.stores.build import ArtifactBuild
from a2d.stores.layout import (
    DAMAGED,
    MANIFEST,
    MARKERS,
    PLAN,
    ArtifactRef,
    DamagedArtifactError,
    IncompleteArtifactError,
)
from a2d.stores.records import metadata_problems
from a2d.stores.uri import Location

log = logging.getLogger("a2d")


class ArtifactIntegrity(ArtifactBuild):
    """Checks and repairs over the build protocol: reuse, reader-found damage, `a2d verify`."""

    def reusable(self, ref: ArtifactRef, verify: bool = True) -> bool:
        """Complete and, with `verify`, every shard still matches its checksum.

        A complete artifact with a corrupted shard or a damaged manifest is demoted to partial (its
        manifest is removed; markers of the bad shards too) so that the next run rebuilds exactly
        those shards (or, for a damaged manifest alone, only commits again). A missing or damaged
        marker under an intact manifest is rewritten from the manifest when the shard's files
        (re-hashed with `verify`) match it. Call under `lock(ref)`: this writes.
        """
        loc = self.loc(ref)
        manifest, damaged = loc.read_json_checked(MANIFEST)
        if damaged:
            log.warning("%s; demoting it to partial", damaged)
            loc.remove_file(MANIFEST)
            return False
        if manifest is None:
            return False
        present = loc.files() if verify else None  # one listing: no request per file to see it is there
        bad = {s for s, m in manifest["shards"].items() if verify and self.check_shard(ref, m, present)}
        bad |= self._noted_damage(loc, manifest, present)
        if bad:
            loc.remove_file(MANIFEST)
            for shard in sorted(bad):
                self.discard_shard(ref, shard)
            return False
        self._restore_from_manifest(ref, manifest, present)
        return True

    def _noted_damage(
        self, loc: Location, manifest: dict[str, Any], present: Mapping[str, int] | None
    ) -> set[str]:
        """The shards a reader noted as damaged (`_damaged.json`; an unreadable note: all of them),
        the note removed once read."""
        noted, unreadable = self._read_listed(loc, DAMAGED, present)
        if noted is None and not unreadable:
            return set()
        log.warning("%s: a reader found damage (%s); rebuilding", loc.uri, (noted or {}).get("problems"))
        loc.remove_file(DAMAGED)
        return set(noted.get("shards", [])) & set(manifest["shards"]) if noted else set(manifest["shards"])

    def _restore_from_manifest(
        self, ref: ArtifactRef, manifest: dict[str, Any], present: Mapping[str, int] | None
    ) -> None:
        """Rewrite the markers and the plan that are lost, damaged or rewritten: the manifest wins."""
        loc = self.loc(ref)
        for shard, recorded in manifest["shards"].items():
            marker = self._read_listed(loc, f"{MARKERS}/{shard}.json", present)[0]
            if marker != recorded:  # lost, damaged or rewritten: the manifest wins
                log.warning(
                    "%s/%s/%s.json: missing or damaged; rewritten from manifest.json", loc.uri, MARKERS, shard
                )
                loc.write_json(f"{MARKERS}/{shard}.json", recorded)
        if self.plan(ref) is None:  # the plan is what the manifest was committed from
            log.warning("%s/%s: missing or damaged; rewritten from manifest.json", loc.uri, PLAN)
            plan = {k: manifest.get(k) for k in ("stage", "key", "format_version", "spec", "upstream")}
            loc.write_json(
                PLAN, {**plan, "shards": list(manifest["shards"]), "created": manifest.get("created")}
            )

    def refuse_damaged(
        self, ref: ArtifactRef, problems: list[str], cause: BaseException | None = None
    ) -> None:
        """Note the shards named in `problems` as damaged (`_damaged.json`: the next run of the
        artifact's stage demotes it and rebuilds them, even with run.verify_reuse=false) and raise a
        DamagedArtifactError naming them. The artifact itself is left as it is until then, so other
        readers in this run get the same error rather than a missing manifest."""
        manifest = self.manifest(ref)
        bad = sorted(
            shard
            for shard, record in manifest["shards"].items()
            if any(f"/{rel}:" in p for rel in record["files"] for p in problems)
        )
        with self.lock(ref):
            noted = self.loc(ref).read_json_checked(DAMAGED)[0] or {}
            shards = sorted({*noted.get("shards", []), *bad})
            self.loc(ref).write_json(
                DAMAGED, {"shards": shards, "problems": sorted({*noted.get("problems", []), *problems})}
            )
        what = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        raise DamagedArtifactError(
            f"reading {ref.stage}/{ref.key} failed{what}: {'; '.join(problems)}. Rerun the {ref.stage} "
            f"stage: it rebuilds the damaged shards ({', '.join(bad)})"
        ) from cause

    @contextlib.contextmanager
    def reading(self, ref: ArtifactRef, shards: list[str] | None = None) -> Iterator[None]:
        """Read from `ref` inside the block; when the read fails and the files of `shards` (default
        all) no longer match their checksums (say with run.verify_reuse=false), the error names the
        damaged files instead of a decoder's message, and the artifact is demoted for a rebuild."""
        try:
            yield
        except IncompleteArtifactError:
            raise
        except Exception as e:
            recorded = self.manifest(ref)["shards"]
            problems = [p for s in (shards or list(recorded)) for p in self.check_shard(ref, recorded[s])]
            if not problems:
                raise
            self.refuse_damaged(ref, problems, e)

    def verify(self, ref: ArtifactRef) -> list[str]:
        """Every problem with an artifact: partial, missing markers, missing or corrupted files."""
        loc = self.loc(ref)
        present = loc.files()
        metadata = self._metadata(loc, present)
        info, damaged = metadata.get(MANIFEST, (None, None))
        problems = metadata_problems(metadata)
        if info is None:
            plan = metadata.get(PLAN, (None, None))[0] or {"shards": []}
            if not damaged:
                problems.insert(0, f"{loc.uri}: partial (no manifest.json)")
            shards = plan["shards"]
        else:
            shards = list(info["shards"])
        for shard in shards:
            marker, marker_damaged = metadata.get(f"{MARKERS}/{shard}.json", (None, None))
            if marker is None:
                if info is not None and marker_damaged is None:
                    problems.append(f"{loc.uri}/{MARKERS}/{shard}.json: marker missing (a rerun rewrites it)")
                if info is not None:
                    problems.extend(self.check_shard(ref, info["shards"][shard], present))
                continue
            if info is not None and info["shards"][shard]["sha256"] != marker["sha256"]:
                problems.append(f"{loc.uri}/{MARKERS}/{shard}.json: disagrees with manifest.json")
            problems.extend(self.check_shard(ref, marker, present))
        return problems
