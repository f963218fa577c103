"""Parquet shards: token columns as list<int32>, zstd, one file a shard, read back through `Location`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from a2d.stores.uri import Location

TOKENS = pa.list_(pa.int32())


def token_array(seqs: list[Any]) -> pa.Array:
    """A list<int32> array from lists or numpy arrays of token ids (range-checked)."""
    out = []
    for s in seqs:
        a = np.asarray(s, dtype=np.int64)
        if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise ValueError("token id out of int32 range")
        out.append(a.astype(np.int32))
    return pa.array(out, type=TOKENS)


def write_shard(path: Path, columns: dict[str, Any], schema: pa.Schema) -> int:
    """Write one Parquet shard to a local path; returns the number of rows."""
    arrays = []
    for field in schema:
        values = columns[field.name]
        if field.type == TOKENS and not isinstance(values, pa.Array):
            values = token_array(values)
        arrays.append(pa.array(values, type=field.type) if not isinstance(values, pa.Array) else values)
    table = pa.Table.from_arrays(arrays, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", compression_level=3)
    return table.num_rows


def read_shard(loc: Location, rel: str, columns: list[str] | None = None) -> pa.Table:
    """Read one shard (any fsspec store) into memory; a file that is not readable Parquet is an
    error naming it."""
    try:
        if loc.is_local:
            return pq.read_table(loc.local_path() / rel, columns=columns)
        return pq.read_table(io.BytesIO(loc.read_bytes(rel)), columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(
            f"{loc.uri}/{rel} is not readable Parquet ({type(e).__name__}: {e}): the file is damaged or "
            "missing; `a2d verify` names every damaged file, and a rerun of its stage rebuilds it"
        ) from e
