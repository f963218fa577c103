"""Artifacts: `{root}/{stage}/{key}/` folders with a plan, per-shard markers and a manifest written last.

Layout of one artifact:

    _plan.json            what is being built: spec, upstream keys, shard names (written first)
    _markers/<shard>.json one per finished shard: its files with sha256, rows, tokens, stats
    <shard files>         part-00000.parquet, part-00000.zarr/…, model/…
    manifest.json         written last and atomically: only its presence makes the artifact complete

Metadata that cannot be read (a truncated manifest.json or marker) is treated like a failed
checksum: it is named, the artifact is demoted to partial, and a rerun rebuilds what it covered. A
marker lost under an intact manifest is rewritten from the manifest once the shard's files verify.
One run at a time builds an artifact (`ArtifactStore.lock`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import re
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
from a2d.stores.locks import file_lock
from a2d.stores.uri import Location

log = logging.getLogger("a2d")

MANIFEST = "manifest.json"
PLAN = "_plan.json"
DAMAGED = "_damaged.json"  # shards a reader found damaged: the next run rebuilds them
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
    """Raised when a consumer is handed an artifact whose manifest is missing or damaged."""


class DamagedArtifactError(IncompleteArtifactError):
    """A complete artifact whose files do not match their checksums; the message names them."""


class StoreWriteError(OSError):
    """A write to the store failed (refused, 5xx, disk full); the message names the object, the store
    and what was left unmarked, and the store's own error is chained as the cause."""


KEY_PATTERN = re.compile(r"^[0-9a-f]{16}$")


SCRATCH_MARK = ".tmp-"  # in the names of shard scratch folders and of atomic-write temp files


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


SMALL_FILE = 16 << 20  # read whole in one request when hashing; larger files are streamed


def hash_file(loc: Location, rel: str, size: int | None = None) -> str:
    """sha256 of a stored file; with its `size` known (from a listing) a small one is one read."""
    if size is not None and size <= SMALL_FILE:
        return sha256_stream(io.BytesIO(loc.read_small(rel)))
    with loc.fs.open(loc._p(rel), "rb") as f:
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
        """Whether the artifact has a readable manifest (a damaged one makes it partial)."""
        return self.loc(ref).read_json_checked(MANIFEST)[0] is not None

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
        noted, unreadable = self._read_listed(loc, DAMAGED, present)
        if noted is not None or unreadable:  # a reader found these shards damaged (an unreadable note: all)
            log.warning("%s: a reader found damage (%s); rebuilding", loc.uri, (noted or {}).get("problems"))
            bad |= (
                set(noted.get("shards", [])) & set(manifest["shards"]) if noted else set(manifest["shards"])
            )
            loc.remove_file(DAMAGED)
        if bad:
            loc.remove_file(MANIFEST)
            for shard in sorted(bad):
                self.discard_shard(ref, shard)
            return False
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
        return True

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

    def damaged_metadata(self, ref: ArtifactRef) -> list[str]:
        """A problem line for every metadata file (manifest, plan, markers) that exists but cannot be read."""
        return _problems(self._metadata(self.loc(ref)))

    @staticmethod
    def _read_listed(
        loc: Location, rel: str, present: Mapping[str, int] | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """`read_json_checked`, skipped (no request) when a listing just taken shows `rel` is not there."""
        if present is not None and rel not in present:
            return None, None
        return loc.read_json_checked(rel)

    @staticmethod
    def _metadata(
        loc: Location, present: Mapping[str, int] | None = None
    ) -> dict[str, tuple[dict[str, Any] | None, str | None]]:
        """Every metadata file there is (manifest, plan, markers), each read once: {rel: (object,
        problem)}, from one listing (`present`, else taken here)."""
        present = loc.files() if present is None else present
        names = [n for n in (MANIFEST, PLAN) if n in present] + sorted(
            rel for rel in present if posixpath.dirname(rel) == MARKERS and rel.endswith(".json")
        )
        return {n: loc.read_json_checked(n) for n in names}

    def missing_files(self, ref: ArtifactRef, shards: list[str] | None = None) -> list[str]:
        """Files the manifest lists (for `shards`, default all) that are not there: a listing, no
        hashing. Zarr reads a deleted chunk as fill values, so its readers check this first."""
        loc, recorded = self.loc(ref), self.manifest(ref)["shards"]
        present = set(loc.files())
        wanted = [rel for s in (shards or list(recorded)) for rel in recorded[s]["files"]]
        return [f"{loc.uri}/{rel}: missing" for rel in wanted if rel not in present]

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
    def marker(self, ref: ArtifactRef, shard: str) -> dict[str, Any] | None:
        """The shard's marker; None when it is missing or damaged (the shard is then unfinished)."""
        return self.loc(ref).read_json_checked(f"{MARKERS}/{shard}.json")[0]

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
        loc = self.loc(ref)
        scratch_root = self.scratch_dir(ref)
        scratch_root.mkdir(parents=True, exist_ok=True)
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{name}{SCRATCH_MARK}", dir=scratch_root))
        try:
            target = tmpdir / name
            yield target
            if not target.exists():
                raise RuntimeError(f"shard writer produced nothing at {target}")
            with self.writing(ref, name, f"{name} was not marked finished (finished shards are kept)"):
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
                    remote = [loc._p(f"{name}/{p.relative_to(target).as_posix()}") for p in local]
                    loc.fs.put([str(p) for p in local], remote)  # named pairs: no lookups first
                else:
                    loc.fs.put([str(target)], [loc._p(name)])
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

    # -- inspection -----------------------------------------------------------------------------------
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
        return self._row(ref, present, metadata, damaged=_problems(metadata))

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
        metadata: Mapping[str, tuple[dict[str, Any] | None, str | None]],
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

    def verify(self, ref: ArtifactRef) -> list[str]:
        """Every problem with an artifact: partial, missing markers, missing or corrupted files."""
        loc = self.loc(ref)
        present = loc.files()
        metadata = self._metadata(loc, present)
        info, damaged = metadata.get(MANIFEST, (None, None))
        problems = _problems(metadata)
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


def _problems(metadata: Mapping[str, tuple[Any, str | None]]) -> list[str]:
    """The problem lines of metadata files read by `ArtifactStore._metadata`, manifest and plan first."""
    return [problem for _, problem in metadata.values() if problem]


class Timer:
    """Seconds since construction; used for stage metrics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
