"""Content-addressed artifact keys (DESIGN §2)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
