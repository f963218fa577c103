"""Artifacts: `{root}/{stage}/{key}/` folders with a plan, per-shard markers and a manifest written last.

Layout of one artifact:

    _plan.json            what is being built: spec, upstream keys, shard names (written first)
    _markers/<shard>.json one per finished shard: its files with sha256, rows, tokens, stats
    <shard files>         part-00000.parquet, part-00000.zarr/…, model/…
    manifest.json         written last and atomically: only its presence makes the artifact complete
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from a2d.stores.keys import KeyInputs, canonical, sha256_file, sha256_stream, sha256_tree
from a2d.stores.uri import Location

MANIFEST = "manifest.json"
PLAN = "_plan.json"
MARKERS = "_markers"


class ArtifactRef(BaseModel):
    """What crosses a task boundary: small, hashable, enough to find the artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    stage: str
    key: str
    uri: str

    def location(self, storage_options: dict[str, Any] | None = None) -> Location:
        return Location.of(self.uri, storage_options)


class IncompleteArtifactError(RuntimeError):
    """Raised when a consumer is handed an artifact whose manifest is missing."""


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("a2d-pipeline")
    except Exception:
        return "0+unknown"


def git_revision() -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cache_root() -> Path:
    """Local cache for copies of remote artifacts and remote stores' training work ($A2D_CACHE)."""
    return Path(os.environ.get("A2D_CACHE", Path.home() / ".cache" / "a2d"))


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def hash_file(fs: Any, path: str) -> str:
    with fs.open(path, "rb") as f:
        return sha256_stream(f)


def hash_local_tree(path: Path) -> dict[str, str]:
    """{relative posix path: sha256} for a file or every file below a folder."""
    if path.is_file():
        return {"": sha256_file(path)}
    return {p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}


class ArtifactStore:
    """Every artifact of one store root, addressed by (stage, key)."""

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

    # -- state --------------------------------------------------------------------------------------
    def is_complete(self, ref: ArtifactRef) -> bool:
        return self.loc(ref).exists(MANIFEST)

    def reusable(self, ref: ArtifactRef, verify: bool = True) -> bool:
        """Complete and, with `verify`, every shard still matches its checksum.

        A complete artifact with a corrupted shard is demoted to partial (its manifest is removed;
        markers of the bad shards too) so that the next run rebuilds exactly those shards.
        """
        if not self.is_complete(ref):
            return False
        if not verify:
            return True
        bad = [s for s, m in self.manifest(ref)["shards"].items() if self.check_shard(ref, m)]
        if not bad:
            return True
        self.loc(ref).remove(MANIFEST)
        for shard in bad:
            self.discard_shard(ref, shard)
        return False

    def manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        loc = self.loc(ref)
        if not loc.exists(MANIFEST):
            raise IncompleteArtifactError(
                f"{ref.stage} artifact {ref.key} at {loc.uri} has no manifest.json: it is partial "
                f"(a run stopped before it finished); rerun the {ref.stage} stage to complete it"
            )
        return loc.read_json(MANIFEST)

    def plan(self, ref: ArtifactRef) -> dict[str, Any] | None:
        loc = self.loc(ref)
        return loc.read_json(PLAN) if loc.exists(PLAN) else None

    def write_plan(self, ref: ArtifactRef, inputs: KeyInputs, shards: list[str]) -> None:
        """Record what this artifact will hold before any shard is written (shown by `a2d ls`)."""
        if inputs.key != ref.key or inputs.stage != ref.stage:
            raise ValueError(f"key inputs of {inputs.stage}/{inputs.key} do not name {ref.stage}/{ref.key}")
        existing = self.plan(ref)
        plan = {
            "stage": ref.stage,
            "key": ref.key,
            "format_version": inputs.format_version,
            "spec": canonical(inputs.payload),
            "upstream": dict(inputs.upstream),
            "shards": shards,
            "created": existing["created"] if existing else now_iso(),
        }
        if existing != plan:
            self.loc(ref).write_json(PLAN, plan)

    # -- shards ---------------------------------------------------------------------------------------
    def marker(self, ref: ArtifactRef, shard: str) -> dict[str, Any] | None:
        loc = self.loc(ref)
        rel = f"{MARKERS}/{shard}.json"
        return loc.read_json(rel) if loc.exists(rel) else None

    def finished_shard(self, ref: ArtifactRef, shard: str, verify: bool = True) -> dict[str, Any] | None:
        """The shard's marker when it exists and (with `verify`) every file still matches its sha256."""
        marker = self.marker(ref, shard)
        if marker is None:
            return None
        if verify and self.check_shard(ref, marker):
            return None
        return marker

    def check_shard(self, ref: ArtifactRef, marker: dict[str, Any]) -> list[str]:
        """Problems with one shard's files: missing or checksum mismatch, each naming the file."""
        loc = self.loc(ref)
        problems = []
        for rel, want in sorted(marker["files"].items()):
            path = loc._p(rel)
            if not loc.fs.exists(path):
                problems.append(f"{loc.uri}/{rel}: missing")
            elif hash_file(loc.fs, path) != want:
                problems.append(f"{loc.uri}/{rel}: sha256 mismatch (shard {marker['shard']})")
        return problems

    @contextlib.contextmanager
    def shard_output(self, ref: ArtifactRef, name: str) -> Iterator[Path]:
        """Yield a local scratch path; on success it is published as `name` inside the artifact.

        Local stores publish by rename (atomic for files, and the old copy is removed first for
        folders); object stores by upload. Either way the marker is written only after, so a
        half-published shard is never taken as finished.
        """
        loc = self.loc(ref)
        scratch_root = loc.local_path() if loc.is_local else None
        if scratch_root is not None:
            scratch_root.mkdir(parents=True, exist_ok=True)
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=scratch_root))
        try:
            target = tmpdir / name
            yield target
            if not target.exists():
                raise RuntimeError(f"shard writer produced nothing at {target}")
            if loc.is_local:
                final = loc.local_path() / name
                if final.is_dir():
                    shutil.rmtree(final)
                elif final.exists():
                    final.unlink()
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(target, final)
            else:
                loc.remove(name)
                loc.fs.put(str(target), loc._p(name), recursive=target.is_dir())
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    def write_marker(
        self, ref: ArtifactRef, shard: str, files: Mapping[str, str], stats: Mapping[str, Any]
    ) -> dict:
        """Mark a shard finished. `files` maps paths relative to the artifact to their sha256."""
        loc = self.loc(ref)
        sizes = {rel: loc.fs.size(loc._p(rel)) for rel in files}
        marker = {
            "shard": shard,
            "files": dict(sorted(files.items())),
            "sha256": sha256_tree(files),
            "bytes": int(sum(sizes.values())),
            "finished": now_iso(),
            **canonical(dict(stats)),
        }
        loc.write_json(f"{MARKERS}/{shard}.json", marker)
        return marker

    def discard_shard(self, ref: ArtifactRef, shard: str) -> None:
        self.loc(ref).remove(f"{MARKERS}/{shard}.json")

    # -- commit ---------------------------------------------------------------------------------------
    def commit(self, ref: ArtifactRef, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write manifest.json last, from the plan and every shard marker; refuses if a shard is missing."""
        plan = self.plan(ref)
        if plan is None:
            raise RuntimeError(f"cannot commit {ref.stage}/{ref.key}: no plan was written")
        shards = {}
        for shard in plan["shards"]:
            marker = self.marker(ref, shard)
            if marker is None:
                raise RuntimeError(f"cannot commit {ref.stage}/{ref.key}: shard {shard} is not finished")
            shards[shard] = marker
        manifest = {
            "stage": ref.stage,
            "key": ref.key,
            "format_version": plan.get("format_version"),
            "spec": plan["spec"],
            "upstream": plan["upstream"],
            "package_version": package_version(),
            "git_revision": git_revision(),
            "created": now_iso(),
            "shards": shards,
            "rows": int(sum(m.get("rows", 0) for m in shards.values())),
            "tokens": int(sum(m.get("tokens", 0) for m in shards.values())),
            "bytes": int(sum(m["bytes"] for m in shards.values())),
            "metrics": canonical(dict(metrics or {})),
        }
        self.loc(ref).write_json(MANIFEST, manifest)
        return manifest

    def local_copy(self, ref: ArtifactRef, shard: str, cache_root: Path) -> Path:
        """A local folder with one finished shard's files: the artifact itself on disk, else a download
        into `cache_root/<stage>/<key>/<shard>` verified against the shard's marker."""
        self.manifest(ref)  # refuses partial artifacts with a clear message
        loc = self.loc(ref)
        if loc.is_local:
            return loc.local_path() / shard
        marker = self.marker(ref, shard)
        want = {rel.split("/", 1)[1]: h for rel, h in marker["files"].items()}
        target = cache_root / ref.stage / ref.key / shard
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

    # -- inspection -----------------------------------------------------------------------------------
    def iter_refs(self, stage: str | None = None) -> Iterator[ArtifactRef]:
        stages = [stage] if stage else [s for s in self.root.listdir() if not s.startswith((".", "_"))]
        for s in stages:
            for key in self.root.listdir(s):
                if not key.startswith("."):
                    yield self.ref(s, key)

    def describe(self, ref: ArtifactRef) -> dict[str, Any]:
        """One row of `a2d ls`: completeness, shards done/total, bytes, created."""
        loc = self.loc(ref)
        complete = loc.exists(MANIFEST)
        info = self.manifest(ref) if complete else (self.plan(ref) or {})
        shards = list(info.get("shards", []))
        done = len([m for m in loc.listdir(MARKERS) if m.endswith(".json")])
        size = sum(v for k, v in loc.files().items() if not k.startswith((".", MARKERS)) and ".tmp-" not in k)
        return {
            "stage": ref.stage,
            "key": ref.key,
            "uri": ref.uri,
            "complete": complete,
            "shards_done": done,
            "shards_total": len(shards),
            "bytes": int(size),
            "rows": info.get("rows"),
            "tokens": info.get("tokens"),
            "created": info.get("created"),
            "upstream": info.get("upstream", {}),
        }

    def verify(self, ref: ArtifactRef) -> list[str]:
        """Every problem with an artifact: partial, missing markers, missing or corrupted files."""
        loc = self.loc(ref)
        info = self.manifest(ref) if loc.exists(MANIFEST) else None
        if info is None:
            plan = self.plan(ref) or {"shards": []}
            problems = [f"{loc.uri}: partial (no manifest.json)"]
            shards = plan["shards"]
        else:
            problems, shards = [], list(info["shards"])
        for shard in shards:
            marker = self.marker(ref, shard)
            if marker is None:
                if info is not None:
                    problems.append(f"{loc.uri}/{MARKERS}/{shard}.json: marker missing")
                continue
            if info is not None and info["shards"][shard]["sha256"] != marker["sha256"]:
                problems.append(f"{loc.uri}/{MARKERS}/{shard}.json: disagrees with manifest.json")
            problems.extend(self.check_shard(ref, marker))
        return problems

    def find(self, key_prefix: str) -> ArtifactRef:
        """The one artifact whose key starts with `key_prefix` (or `stage/key`)."""
        stage = None
        if "/" in key_prefix:
            stage, key_prefix = key_prefix.split("/", 1)
        hits = [r for r in self.iter_refs(stage) if r.key.startswith(key_prefix)]
        if not hits:
            raise KeyError(f"no artifact with key {key_prefix!r} in {self.root.uri}; `a2d ls` lists them")
        if len(hits) > 1:
            names = ", ".join(f"{r.stage}/{r.key}" for r in hits)
            raise KeyError(f"key prefix {key_prefix!r} is ambiguous ({names}); give more characters")
        return hits[0]

    def lineage(self, ref: ArtifactRef) -> dict[str, list[str]]:
        """Upstream (from the manifest or plan) and downstream (found by scanning) as `stage/key`."""
        up_keys = self.describe(ref)["upstream"]
        upstream = [f"{stage}/{key}" for stage, key in sorted(up_keys.items())]
        downstream = []
        for other in self.iter_refs():
            if ref.key in self.describe(other)["upstream"].values():
                downstream.append(f"{other.stage}/{other.key}")
        return {"upstream": upstream, "downstream": sorted(downstream)}


class Timer:
    """Seconds since construction; used for stage metrics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
