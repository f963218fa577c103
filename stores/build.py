"""Building an artifact: the lock, the plan, shards published then marked, the manifest written last.

One run at a time builds an artifact (`lock`). A shard is published whole (a rename on disk, an
upload to an object store) before its marker is written, so a half-published shard is never taken
as finished; `commit` refuses while a planned shard has no marker.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from a2d.stores.keys import KeyInputs, canonical, sha256_stream, sha256_tree
from a2d.stores.layout import MANIFEST, MARKERS, PLAN, SCRATCH_MARK, ArtifactRef, StoreWriteError, cache_root
from a2d.stores.locks import file_lock
from a2d.stores.records import ArtifactRecords
from a2d.stores.uri import Location

log = logging.getLogger("a2d")


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


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def publish(loc: Location, name: str, target: Path) -> None:
    """Put the finished scratch file or folder `target` at `name` inside the artifact `loc`.

    Local stores publish by rename (atomic for files, and the old copy is removed first for
    folders); object stores by upload."""
    if loc.is_local:
        final = loc.local_path() / name
        if final.is_dir():
            shutil.rmtree(final)
        elif final.exists():
            final.unlink()
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(target, final)
    elif target.is_dir():
        loc.remove(name)  # files of an earlier attempt that this one does not overwrite
        local = sorted(p for p in target.rglob("*") if p.is_file())
        loc.put_files({f"{name}/{p.relative_to(target).as_posix()}": p for p in local})
    else:
        loc.put_files({name: target})


class ArtifactBuild(ArtifactRecords):
    """The build protocol over `ArtifactRecords`: lock, scratch, plan, shard markers, commit."""

    def lock(self, ref: ArtifactRef, on_wait: Any = None) -> contextlib.AbstractContextManager[None]:
        """Exclusive right to build or repair `ref`, across processes and threads (`stores.locks`).

        Local stores keep the lock files in `{root}/.locks/`; for an object store they live in the
        local cache, so only runs on the same machine are serialised there.
        """
        name = f"{ref.stage}-{ref.key}.lock"
        if self.root.is_local:
            return file_lock(self.root.local_path() / ".locks" / name, on_wait)
        digest = sha256_stream(io.BytesIO(self.root.uri.encode()))[:16]
        return file_lock(cache_root() / "locks" / digest / name, on_wait)

    def scratch_dir(self, ref: ArtifactRef) -> Path:
        """Where shard writers put their scratch: inside the artifact on disk (the publish is then a
        rename), else in the local cache."""
        loc = self.loc(ref)
        if loc.is_local:
            return loc.local_path()
        return cache_root() / "scratch" / ref.stage / ref.key

    def clean_scratch(self, ref: ArtifactRef) -> list[str]:
        """Remove the scratch a killed run left (shard folders being written, temp files of atomic
        writes); names of what was removed. Call under `lock(ref)`: no other run is writing then."""
        removed = []
        loc = self.loc(ref)
        local = self.scratch_dir(ref)
        for rel in [*loc.listdir(), *(f"{MARKERS}/{m}" for m in loc.listdir(MARKERS))]:
            if SCRATCH_MARK in rel.rsplit("/", 1)[-1]:
                loc.remove(rel)
                removed.append(f"{loc.uri}/{rel}")
        if not loc.is_local and local.is_dir():
            for p in local.iterdir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(str(p))
        if removed:
            log.info("removed scratch left by an interrupted run: %s", ", ".join(removed))
        return removed

    def plan_shards(
        self, ref: ArtifactRef, inputs: KeyInputs, shards: Sequence[str] | Callable[[], Sequence[str]]
    ) -> list[str]:
        """Record the plan and return its shards: a sequence is the plan; a callable is asked only
        when the artifact has no plan (a partial or demoted artifact keeps the shards it planned)."""
        if callable(shards):
            plan = self.plan(ref)
            shards = plan["shards"] if plan else shards()
        shards = list(shards)
        self.write_plan(ref, inputs, shards)
        return shards

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
            with self.writing(ref, PLAN, "no shard of it was written"):
                self.loc(ref).write_json(PLAN, plan)

    @contextlib.contextmanager
    def writing(self, ref: ArtifactRef, rel: str, unmarked: str) -> Iterator[None]:
        """Raise a failed write of `rel` as a StoreWriteError naming the object, the store and what
        was left unmarked (`unmarked`), with the store's own error chained."""
        try:
            yield
        except Exception as e:
            raise StoreWriteError(
                f"could not write {self.loc(ref).uri}/{rel} to the store {self.root.uri} "
                f"({type(e).__name__}: {e}); {unmarked}: rerun once the store is reachable"
            ) from e

    # -- shards ---------------------------------------------------------------------------------------
    def pending_shards(self, ref: ArtifactRef, shards: list[str], verify: bool = True) -> list[str]:
        """The shards of `shards` still to run: no readable marker, or (with `verify`) files that no
        longer match it; a marker that does not hold is removed. One listing of the artifact (of its
        markers without `verify`), then a read of each listed marker. Call under `lock(ref)`."""
        loc = self.loc(ref)
        present = loc.files() if verify else {f"{MARKERS}/{m}": 0 for m in loc.listdir(MARKERS)}
        pending = []
        for shard in shards:
            rel = f"{MARKERS}/{shard}.json"
            marker = self._read_listed(loc, rel, present)[0]
            if marker is None or (verify and self.check_shard(ref, marker, present)):
                if rel in present:
                    self.discard_shard(ref, shard)
                pending.append(shard)
        return pending

    @contextlib.contextmanager
    def shard_output(self, ref: ArtifactRef, name: str) -> Iterator[Path]:
        """Yield a local scratch path; on success it is published as `name` inside the artifact.

        Local stores publish by rename (atomic for files, and the old copy is removed first for
        folders); object stores by upload. Either way the marker is written only after, so a
        half-published shard is never taken as finished.
        """
        scratch_root = self.scratch_dir(ref)
        scratch_root.mkdir(parents=True, exist_ok=True)
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{name}{SCRATCH_MARK}", dir=scratch_root))
        try:
            target = tmpdir / name
            yield target
            if not target.exists():
                raise RuntimeError(f"shard writer produced nothing at {target}")
            with self.writing(ref, name, f"{name} was not marked finished (finished shards are kept)"):
                publish(self.loc(ref), name, target)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    def write_marker(
        self, ref: ArtifactRef, shard: str, files: Mapping[str, str], stats: Mapping[str, Any]
    ) -> dict:
        """Mark a shard finished. `files` maps paths relative to the artifact to their sha256."""
        loc = self.loc(ref)
        path = f"{MARKERS}/{shard}.json"
        with self.writing(ref, path, f"shard {shard} was not marked finished (finished shards are kept)"):
            sizes = loc.sizes(list(files))
            marker = {
                "shard": shard,
                "files": dict(sorted(files.items())),
                "sha256": sha256_tree(files),
                "bytes": int(sum(sizes.values())),
                "finished": now_iso(),
                **canonical(dict(stats)),
            }
            loc.write_json(path, marker)
        return marker

    def discard_shard(self, ref: ArtifactRef, shard: str) -> None:
        self.loc(ref).remove_file(f"{MARKERS}/{shard}.json")

    # -- commit ---------------------------------------------------------------------------------------
    def commit(
        self,
        ref: ArtifactRef,
        metrics: Mapping[str, Any] | None = None,
        markers: Mapping[str, dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """Write manifest.json last, from the plan and every shard marker; refuses if a shard is missing.

        `markers` are the shard markers as the caller just read them from the store (under the lock),
        so they are not read again; shards it does not name are read here."""
        plan = self.plan(ref)
        if plan is None:
            raise RuntimeError(f"cannot commit {ref.stage}/{ref.key}: no plan was written")
        shards = {}
        for shard in plan["shards"]:
            marker = markers[shard] if markers is not None and shard in markers else self.marker(ref, shard)
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
        undone = (
            f"the {ref.stage} artifact {ref.key} was not committed and stays partial (its shards are kept)"
        )
        with self.writing(ref, MANIFEST, undone):
            self.loc(ref).write_json(MANIFEST, manifest)
        return manifest
