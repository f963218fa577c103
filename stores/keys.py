"""Content-addressed artifact keys (DESIGN §2)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel

KEY_CHARS = 16


def canonical(obj: Any) -> Any:
    """Plain JSON-able data: pydantic models dumped, tuples as lists, mapping keys as strings."""
    if isinstance(obj, BaseModel):
        return canonical(obj.model_dump(mode="json"))
    if isinstance(obj, Mapping):
        return {str(k): canonical(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [canonical(v) for v in obj]
    if isinstance(obj, float) and obj.is_integer():
        # 1.0 and 1 hash alike so a YAML `1` and a UI `1.0` give one key.
        return int(obj)
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"cannot put {type(obj).__name__} into an artifact key")


def canonical_json(obj: Any) -> str:
    """Sorted-key, compact JSON: the exact bytes that are hashed."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def artifact_key(stage: str, format_version: int, spec: Any, upstream: Mapping[str, str]) -> str:
    """First 16 hex chars of sha256 over (stage, format version, spec, upstream keys)."""
    payload = {"stage": stage, "format_version": format_version, "spec": spec, "upstream": dict(upstream)}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:KEY_CHARS]


@dataclass(frozen=True)
class KeyInputs:
    """Everything an artifact key is made of. Each stage builds these in one function; the key,
    the recorded plan and the manifest all come from the same object, so a manifest's spec and
    upstream always hash back to its key."""

    stage: str
    format_version: int
    payload: Any  # the content-determining spec, canonical JSON-able
    upstream: Mapping[str, str]  # upstream stage -> key

    @property
    def key(self) -> str:
        return artifact_key(self.stage, self.format_version, self.payload, self.upstream)


def sha256_stream(f: BinaryIO) -> str:
    """sha256 of a readable binary stream, read in 4 MiB chunks."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 22), b""):
        h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)


def sha256_tree(file_hashes: Mapping[str, str]) -> str:
    """One checksum for a folder: sha256 over its sorted (relative path, file sha256) pairs."""
    h = hashlib.sha256()
    for rel in sorted(file_hashes):
        h.update(f"{rel}\0{file_hashes[rel]}\n".encode())
    return h.hexdigest()


# Content hashes of local inputs, cached per process on (path, size, mtime): one `a2d run` plans,
# keys and runs a stage several times, and a multi-GB checkpoint or dataset is hashed once.
_HASHES: dict[tuple, str] = {}
_HASHES_LOCK = threading.Lock()


def _stat(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns


def sha256_file_cached(path: str | os.PathLike) -> str:
    """sha256_file, computed again only when the file's size or mtime changed."""
    p = Path(path).resolve()
    key = ("file", str(p), _stat(p))
    with _HASHES_LOCK:
        if key not in _HASHES:
            _HASHES[key] = sha256_file(p)
        return _HASHES[key]


def dir_sha256(path: str | os.PathLike) -> str:
    """Content hash of a local directory: every non-hidden file by relative path, cached like files."""
    root = Path(path).resolve()
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(root).as_posix()}\0{sha256_file_cached(p)}\n".encode())
    return h.hexdigest()
