"""The one door to storage: URI normalisation, fsspec filesystems and atomic writes.

No other module calls fsspec or zarr on a raw user string; everything goes through `Location`.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import fsspec

SUPPORTED_PROTOCOLS = ("file", "memory", "s3", "gs", "gcs", "az", "abfs")
IN_PROCESS = ("file", "memory")  # every call is cheap here; elsewhere each one is a request
# Whole-object reads that skip s3fs's size lookup (a HEAD before each GET, only to decide whether
# to download in parallel parts): for small objects (JSON metadata, zarr chunks of ~2 MiB).
SINGLE_GET = {"s3": {"max_concurrency": 1}}


def normalise_uri(uri: str) -> str:
    """Return a canonical URI: absolute `file://` for local paths, protocol URIs without trailing slash."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(
            "store URI is empty: pass a path such as ./a2d-store or a URI such as s3://bucket/prefix"
        )
    uri = uri.strip()
    if "://" not in uri:
        return "file://" + str(Path(uri).expanduser().resolve())
    protocol, rest = uri.split("://", 1)
    protocol = protocol.lower()
    if protocol not in SUPPORTED_PROTOCOLS:
        raise ValueError(
            f"unsupported store protocol {protocol!r} in {uri!r}: use a local path or one of "
            f"{', '.join(p + '://' for p in SUPPORTED_PROTOCOLS)}"
        )
    if protocol == "file":
        return "file://" + str(Path(rest).expanduser().resolve())
    if protocol == "memory":
        rest = "/" + rest.strip("/")
    else:
        rest = rest.strip("/")
        if not rest:
            raise ValueError(f"store URI {uri!r} names no bucket: use {protocol}://bucket/prefix")
    return f"{protocol}://{rest}".rstrip("/") if rest != "/" else f"{protocol}:///"


def storage_options_from_env(protocol: str) -> dict[str, Any]:
    """Storage options for `protocol` from `A2D_STORAGE_OPTIONS` (JSON) and, for s3, `AWS_ENDPOINT_URL`."""
    options: dict[str, Any] = {}
    raw = os.environ.get("A2D_STORAGE_OPTIONS")
    if raw:
        try:
            options.update(json.loads(raw))
        except json.JSONDecodeError as e:
            raise ValueError(f"A2D_STORAGE_OPTIONS is not valid JSON ({e}): set it to an object") from e
    if protocol == "s3" and os.environ.get("AWS_ENDPOINT_URL") and "endpoint_url" not in options:
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    if protocol == "file":
        options.setdefault("auto_mkdir", True)
    if protocol == "s3":
        # Listings are cached per filesystem instance; another process's write must be seen at once.
        options.setdefault("use_listings_cache", False)
    return options


@dataclass(frozen=True)
class Location:
    """A folder in some filesystem: `uri` is canonical, `fs` does the I/O, `path` is the fs-native path."""

    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __repr__(self) -> str:
        # Storage options hold credentials (keys, secrets, tokens): only their names are shown.
        return f"Location({self.uri!r}, storage_options=<{', '.join(sorted(self.storage_options))}>)"

    @classmethod
    def of(cls, uri: str, storage_options: dict[str, Any] | None = None) -> Location:
        canonical = normalise_uri(uri)
        protocol = canonical.split("://", 1)[0]
        options = storage_options_from_env(protocol)
        options.update(storage_options or {})
        return cls(canonical, options)

    @property
    def protocol(self) -> str:
        return self.uri.split("://", 1)[0]

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return _filesystem(self.protocol, json.dumps(self.storage_options, sort_keys=True, default=str))

    @property
    def path(self) -> str:
        return self.uri.split("://", 1)[1]

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def join(self, *parts: str) -> Location:
        """A child location; parts must be relative and may not climb out with `..`."""
        for part in parts:
            if part.startswith("/") or ".." in part.split("/"):
                raise ValueError(f"path part {part!r} must be relative and stay inside {self.uri}")
        return Location(self.uri.rstrip("/") + "/" + posixpath.join(*parts), self.storage_options)

    def exists(self, rel: str = "") -> bool:
        return self.fs.exists(self._p(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._p(rel))

    def read_small(self, rel: str) -> bytes:
        """Read a whole file the caller knows to be small (metadata, a chunk): one GET on S3."""
        return self.fs.cat_file(self._p(rel), **SINGLE_GET.get(self.protocol, {}))

    def open_read(self, rel: str) -> IO[bytes]:
        """Open a file for streamed reading (a large one: hashed without holding it in memory)."""
        return self.fs.open(self._p(rel), "rb")

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def read_json_checked(self, rel: str) -> tuple[dict[str, Any] | None, str | None]:
        """(object, None) for a readable JSON object; (None, problem) when `rel` exists but is
        truncated, not JSON or not an object; (None, None) when it does not exist. One GET on S3."""
        try:
            data = self.read_small(rel)
        except FileNotFoundError:
            return None, None
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return None, f"{self.uri}/{rel}: damaged ({len(data)} bytes, not valid JSON: {e})"
        if not isinstance(obj, dict):
            return None, f"{self.uri}/{rel}: damaged (a JSON {type(obj).__name__}, not an object)"
        return obj, None

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a file atomically: readers never see a partial file under the final name."""
        target = self._p(rel)
        if self.protocol in ("file",):
            os.makedirs(posixpath.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:  # a full disk, say: no half-written temp file stays behind
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:
            # Object stores publish a PUT atomically; memory:// replaces the value in one step.
            self.fs.pipe_file(target, data)

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())

    def put_file(self, local: Path, rel: str) -> None:
        """Upload one local file to `rel` (one PUT on object stores)."""
        if self.is_local:
            os.makedirs(posixpath.dirname(self._p(rel)), exist_ok=True)
        self.fs.put_file(str(local), self._p(rel))

    def put_files(self, files: Mapping[str, Path]) -> None:
        """Upload local files, {rel: local file}, in one batched call; named pairs: no lookups first."""
        self.fs.put([str(local) for local in files.values()], [self._p(rel) for rel in files])

    def get_file(self, rel: str, local: Path) -> None:
        """Download `rel` to a local file, creating its folder."""
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._p(rel), str(local))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under `rel`; empty when it does not exist. One LIST on S3."""
        try:
            entries = self.fs.ls(self._p(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def files(self, rel: str = "") -> dict[str, int]:
        """Every file below `rel` (or `rel` itself, as "") as {relative path: size}: one listing
        (a LIST per 1000 objects on S3), with no per-file request."""
        base = self._p(rel).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {
            "" if p.rstrip("/") == base else posixpath.relpath(p, base): int(info.get("size") or 0)
            for p, info in found.items()
        }

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """The size of each file in `rels`: one listing per folder they lie in at the top (a zarr
        group, a model folder), one lookup per file directly under this location."""
        tops = sorted({rel.split("/", 1)[0] for rel in rels if "/" in rel})
        listed = {f"{top}/{sub}": size for top in tops for sub, size in self.files(top).items()}
        return {rel: listed[rel] if rel in listed else int(self.fs.size(self._p(rel))) for rel in rels}

    def remove(self, rel: str = "") -> None:
        """Remove a file or a folder with everything below it; nothing when `rel` does not exist."""
        p = self._p(rel)
        if self.protocol in IN_PROCESS:
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)
            return
        # Object stores have no folders: list what is there once and delete those objects in bulk.
        found = list(self.fs.find(p))
        if found:
            self.fs.rm(found)

    def remove_file(self, rel: str) -> None:
        """Remove one file (a marker, a manifest); nothing when it does not exist. One DELETE on S3."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(rel))

    def zarr_store(self, rel: str = "", read_only: bool = True) -> Any:
        """A zarr v3 store for the folder `rel` below this location."""
        import zarr.storage

        if self.is_local:
            return zarr.storage.LocalStore(self._p(rel), read_only=read_only)
        options = {**self.storage_options, **(SINGLE_GET.get(self.protocol, {}) if read_only else {})}
        return zarr.storage.FsspecStore.from_url(
            f"{self.protocol}://{self._p(rel)}", storage_options=options or None, read_only=read_only
        )

    def local_path(self) -> Path:
        """The local filesystem path; only for `file://` stores."""
        if not self.is_local:
            raise ValueError(f"{self.uri} is not on local disk")
        return Path(self.path)

    def _p(self, rel: str) -> str:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"path {rel!r} must be relative and stay inside {self.uri}")
        return posixpath.join(self.path, rel) if rel else self.path


_FS_CACHE: dict[tuple[str, str], fsspec.AbstractFileSystem] = {}


def _filesystem(protocol: str, options_json: str) -> fsspec.AbstractFileSystem:
    key = (protocol, options_json)
    if key not in _FS_CACHE:
        _FS_CACHE[key] = fsspec.filesystem(protocol, **json.loads(options_json))
    return _FS_CACHE[key]
