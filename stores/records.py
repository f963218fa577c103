"""Addressing artifacts and reading them: manifest, plan, markers, a shard's checksums, local copies.

Metadata that cannot be read (a truncated manifest.json or marker) is named as a problem, never
raised from a JSON decoder: the callers (`stores.integrity`, `stores.catalog`) decide what it means.
"""

from __future__ import annotations

import io
import posixpath
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from a2d.stores.keys import KeyInputs, sha256_file, sha256_stream
from a2d.stores.layout import MANIFEST, MARKERS, PLAN, ArtifactRef, IncompleteArtifactError
from a2d.stores.locks import file_lock
from a2d.stores.uri import Location

SMALL_FILE = 16 << 20  # read whole in one request when hashing; larger files are streamed

Metadata = Mapping[str, tuple[dict[str, Any] | None, str | None]]  # {rel: (object, problem)}


def hash_file(loc: Location, rel: str, size: int | None = None) -> str:
    """sha256 of a stored file; with its `size` known (from a listing) a small one is one read."""
    if size is not None and size <= SMALL_FILE:
        return sha256_stream(io.BytesIO(loc.read_small(rel)))
    with loc.open_read(rel) as f:
        return sha256_stream(f)


def hash_local_tree(path: Path) -> dict[str, str]:
    """{relative posix path: sha256} for a file or every file below a folder."""
    if path.is_file():
        return {"": sha256_file(path)}
    return {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}


def metadata_problems(metadata: Mapping[str, tuple[Any, str | None]]) -> list[str]:
    """The problem lines of metadata files read by `ArtifactRecords._metadata`, manifest and plan first."""
    return [problem for _, problem in metadata.values() if problem]


class ArtifactRecords:
    """Every artifact of one store root, addressed by (stage, key): what its records say."""

    def __init__(self, root: str | Location, storage_options: dict[str, Any] | None = None):
        self.root = root if isinstance(root, Location) else Location.of(root, storage_options)

    # -- addressing ---------------------------------------------------------------------------------
    def ref(self, stage: str, key: str) -> ArtifactRef:
        return ArtifactRef(stage=stage, key=key, uri=self.root.join(stage, key).uri)

    def ref_for(self, inputs: KeyInputs) -> ArtifactRef:
        """The artifact a stage's key inputs name."""
        return self.ref(inputs.stage, inputs.key)

    def loc(self, ref: ArtifactRef) -> Location:
        return self.root.join(ref.stage, ref.key)

    # -- records --------------------------------------------------------------------------------------
    def is_complete(self, ref: ArtifactRef) -> bool:
        """Whether the artifact has a readable manifest (a damaged one makes it partial)."""
        return self.loc(ref).read_json_checked(MANIFEST)[0] is not None

    def manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        loc = self.loc(ref)
        manifest, damaged = loc.read_json_checked(MANIFEST)
        if damaged:
            raise IncompleteArtifactError(
                f"{damaged}; the {ref.stage} artifact {ref.key} counts as partial: rerun the "
                f"{ref.stage} stage to rebuild its manifest"
            )
        if manifest is None:
            raise IncompleteArtifactError(
                f"{ref.stage} artifact {ref.key} at {loc.uri} has no manifest.json: it is partial "
                f"(a run stopped before it finished); rerun the {ref.stage} stage to complete it"
            )
        return manifest

    def plan(self, ref: ArtifactRef) -> dict[str, Any] | None:
        """The recorded plan; None when there is none or it is damaged (it is then written again)."""
        return self.loc(ref).read_json_checked(PLAN)[0]

    def marker(self, ref: ArtifactRef, shard: str) -> dict[str, Any] | None:
        """The shard's marker; None when it is missing or damaged (the shard is then unfinished)."""
        return self.loc(ref).read_json_checked(f"{MARKERS}/{shard}.json")[0]

    def damaged_metadata(self, ref: ArtifactRef) -> list[str]:
        """A problem line for every metadata file (manifest, plan, markers) that exists but cannot be read."""
        return metadata_problems(self._metadata(self.loc(ref)))

    @staticmethod
    def _read_listed(
        loc: Location, rel: str, present: Mapping[str, int] | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """`read_json_checked`, skipped (no request) when a listing just taken shows `rel` is not there."""
        if present is not None and rel not in present:
            return None, None
        return loc.read_json_checked(rel)

    @staticmethod
    def _metadata(loc: Location, present: Mapping[str, int] | None = None) -> Metadata:
        """Every metadata file there is (manifest, plan, markers), each read once: {rel: (object,
        problem)}, from one listing (`present`, else taken here)."""
        present = loc.files() if present is None else present
        names = [n for n in (MANIFEST, PLAN) if n in present] + sorted(
            rel for rel in present if posixpath.dirname(rel) == MARKERS and rel.endswith(".json")
        )
        return {n: loc.read_json_checked(n) for n in names}

    # -- shard files ----------------------------------------------------------------------------------
    def missing_files(self, ref: ArtifactRef, shards: list[str] | None = None) -> list[str]:
        """Files the manifest lists (for `shards`, default all) that are not there: a listing, no
        hashing. Zarr reads a deleted chunk as fill values, so its readers check this first."""
        loc, recorded = self.loc(ref), self.manifest(ref)["shards"]
        present = set(loc.files())
        wanted = [rel for s in (shards or list(recorded)) for rel in recorded[s]["files"]]
        return [f"{loc.uri}/{rel}: missing" for rel in wanted if rel not in present]

    def check_shard(
        self, ref: ArtifactRef, marker: dict[str, Any], present: Mapping[str, int] | None = None
    ) -> list[str]:
        """Problems with one shard's files: missing or checksum mismatch, each naming the file.

        `present` is a listing of the artifact (`Location.files`) taken by a caller that checks
        many shards: it says what is there and each file's size, so each file costs one read."""
        loc = self.loc(ref)
        problems = []
        for rel, want in sorted(marker["files"].items()):
            if present is not None and rel not in present:
                problems.append(f"{loc.uri}/{rel}: missing")
                continue
            try:
                got = hash_file(loc, rel, None if present is None else present[rel])
            except FileNotFoundError:
                problems.append(f"{loc.uri}/{rel}: missing")
                continue
            if got != want:
                problems.append(f"{loc.uri}/{rel}: sha256 mismatch (shard {marker['shard']})")
        return problems

    def local_copy(self, ref: ArtifactRef, shard: str, cache_root: Path) -> Path:
        """A local folder with one finished shard's files: the artifact itself on disk, else a download
        into `cache_root/<stage>/<key>/<shard>` verified against the shard's record in the manifest
        (processes sharing the cache take turns: one downloads, the others then find it there)."""
        recorded = self.manifest(ref)["shards"][shard]  # refuses partial artifacts with a clear message
        loc = self.loc(ref)
        if loc.is_local:
            return loc.local_path() / shard
        want = {rel.split("/", 1)[1]: h for rel, h in recorded["files"].items()}
        target = cache_root / ref.stage / ref.key / shard
        with file_lock(target.parent / f".{shard}.lock"):
            if not target.is_dir() or hash_local_tree(target) != want:
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                for rel in want:
                    loc.get_file(f"{shard}/{rel}", target / rel)
                if hash_local_tree(target) != want:
                    raise RuntimeError(
                        f"download of {ref.stage}/{ref.key}/{shard} to {target} does not match its checksums"
                    )
        return target
