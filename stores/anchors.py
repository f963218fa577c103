"""Anchor shards in Zarr v3, and the trainer-side reader.

One shard is a group `part-NNNNN.zarr`:

    hidden        (tokens, layers, hidden) uint16 bf16 bits, or int8 with the arrays below
    scale         (tokens, layers) float16               int8 only: per-token-per-layer absmax/127
    outlier_idx   (layers, k) int32                      int8 only: channels kept exactly
    outlier_bits  (tokens, layers, k) uint16             int8 only: their bf16 bits
    offsets       (samples + 1,) int64                   token range of each sample
    sample_ids    (samples,) str
    positions     (tokens,) int32                        position of each token in prompt+response
    confidence    (tokens,) float16                      teacher p(next actual token); NaN at prompt tokens
    entropy       (tokens,) float16                      teacher predictive entropy (nats); NaN at prompt tokens

Attributes name the teacher key, tokenizer hash, layer list, capture point and dtype, so a
consumer can refuse anchors that were made by another teacher or at another capture point.
Hidden chunks hold one layer each, so reading some layers never reads the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import ZstdCodec

from a2d.models.quant import Int8Block, dequantize_int8, from_bf16_bits
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.stores.uri import Location

CHUNK_BYTES = 1 << 21  # ~2 MiB chunks: smaller ones are slow in zarr


class AnchorMismatchError(ValueError):
    """Anchors that do not fit the consumer: the message names both sides."""


def _chunk_tokens(row_bytes: int, tokens: int) -> int:
    return max(1, min(tokens, CHUNK_BYTES // max(row_bytes, 1)))


def write_shard(
    path: Path,
    hidden: np.ndarray | Int8Block,
    offsets: np.ndarray,
    sample_ids: list[str],
    positions: np.ndarray,
    confidence: np.ndarray,
    entropy: np.ndarray,
    attrs: dict[str, Any],
    zstd_level: int = 1,
) -> None:
    """Write one whole shard to a local path in a single pass (one writer, one write per array)."""
    group = zarr.open_group(store=str(path), mode="w", zarr_format=3)
    codec = [ZstdCodec(level=zstd_level)]
    tokens = int(offsets[-1])

    def put(name: str, data: np.ndarray, chunks: tuple[int, ...]) -> None:
        arr = group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks, compressors=codec)
        if data.size:
            arr[...] = data

    if isinstance(hidden, Int8Block):
        _, layers, width = hidden.q.shape
        ct = _chunk_tokens(width, tokens)
        put("hidden", hidden.q, (ct, 1, width))
        put("scale", hidden.scale, (ct, layers))
        put("outlier_idx", hidden.outlier_idx, hidden.outlier_idx.shape or (1,))
        put("outlier_bits", hidden.outlier_bits, (ct, layers, max(hidden.outlier_bits.shape[2], 1)))
    else:
        _, layers, width = hidden.shape
        put("hidden", hidden, (_chunk_tokens(width * 2, tokens), 1, width))
    put("offsets", offsets.astype(np.int64), (len(offsets),))
    put("positions", positions.astype(np.int32), (max(tokens, 1),))
    put("confidence", confidence.astype(np.float16), (max(tokens, 1),))
    put("entropy", entropy.astype(np.float16), (max(tokens, 1),))
    ids = group.create_array(
        "sample_ids", shape=(len(sample_ids),), dtype=str, chunks=(max(len(sample_ids), 1),)
    )
    if sample_ids:
        ids[...] = np.array(sample_ids, dtype=object)
    group.attrs.update(attrs)


def open_shard(loc: Location, name: str) -> zarr.Group:
    """Open a published shard read-only through the store's one I/O door."""
    return zarr.open_group(store=loc.zarr_store(name), mode="r", zarr_format=3)


@dataclass(frozen=True)
class _Where:
    shard: str
    start: int
    end: int


class AnchorReader:
    """Random access to anchors: `(sample_id, layer) -> (tokens, hidden)` and sampled training batches."""

    def __init__(self, store: ArtifactStore, ref: ArtifactRef):
        manifest = store.manifest(ref)
        missing = store.missing_files(ref)  # zarr would read a deleted chunk as zeros
        if missing:
            store.refuse_damaged(ref, missing)
        self.store, self.ref = store, ref
        self.loc = store.loc(ref)
        self.meta: dict[str, Any] = manifest["metrics"]["anchor_attrs"]
        self.shard_attrs: dict[str, dict[str, Any]] = {s: m["attrs"] for s, m in manifest["shards"].items()}
        self.layers: list[int] = list(self.meta["layers"])
        # Opened arrays and whole per-token columns, kept: on an object store every array opened
        # is a read of its metadata and every slice a read of its chunk, per sample otherwise.
        self._groups: dict[str, zarr.Group] = {}
        self._arrays: dict[tuple[str, str], zarr.Array] = {}
        self._columns: dict[tuple[str, str], np.ndarray] = {}
        self._index: dict[str, _Where] = {}
        for shard in manifest["shards"]:
            with store.reading(ref, [shard]):
                offsets = self._array(shard, "offsets")[...]
                for i, sid in enumerate(self._array(shard, "sample_ids")[...].tolist()):
                    self._index[str(sid)] = _Where(shard, int(offsets[i]), int(offsets[i + 1]))

    def _group(self, shard: str) -> zarr.Group:
        if shard not in self._groups:
            self._groups[shard] = open_shard(self.loc, f"{shard}.zarr")
        return self._groups[shard]

    def _array(self, shard: str, name: str) -> zarr.Array:
        if (shard, name) not in self._arrays:
            self._arrays[shard, name] = self._group(shard)[name]
        return self._arrays[shard, name]

    def _column(self, shard: str, name: str, where: _Where) -> np.ndarray:
        """One sample's slice of a per-token column (positions, confidence, entropy: 2-4 bytes a
        token), the shard's whole column read once."""
        if (shard, name) not in self._columns:
            with self.store.reading(self.ref, [shard]):
                self._columns[shard, name] = self._array(shard, name)[...]
        return self._columns[shard, name][where.start : where.end].copy()

    @property
    def sample_ids(self) -> list[str]:
        return list(self._index)

    def check(self, **expected: Any) -> None:
        """Refuse anchors whose provenance differs: e.g. check(teacher_key=…, capture="residual")."""
        for name, want in expected.items():
            have = self.meta.get(name)
            if have != want:
                raise AnchorMismatchError(
                    f"anchors {name} mismatch: the anchors at {self.loc.uri} have {name}={have!r}, "
                    f"the consumer expects {name}={want!r}; rebuild the anchors with the consumer's settings"
                )

    def check_responses(
        self, store: ArtifactStore, responses: ArtifactRef, shards: list[str] | None = None
    ) -> None:
        """Refuse anchors captured from other response rows than `responses` holds now, shard by shard
        (a responses shard rebuilt with other tokens keeps its key; its checksum changes)."""
        self.check(responses_key=responses.key)
        now = store.manifest(responses)["shards"]
        for shard in shards if shards is not None else list(self.shard_attrs):
            have = self.shard_attrs.get(shard, {}).get("responses_sha256")
            want = now.get(shard, {}).get("sha256")
            if have != want:
                raise AnchorMismatchError(
                    f"anchors shard {shard} at {self.loc.uri} was captured from responses with sha256 "
                    f"{have}, but responses shard {shard} at {store.loc(responses).uri} now has sha256 {want}: "
                    f"they no longer describe the same rows; delete {self.loc.uri} and rerun the anchors stage"
                )

    def _layer_pos(self, layers: list[int]) -> list[int]:
        missing = [i for i in layers if i not in self.layers]
        if missing:
            raise AnchorMismatchError(
                f"layers {missing} were not stored: the anchors hold layers {self.layers}, the consumer asked for "
                f"{layers}; rebuild anchors with anchors.layers covering them"
            )
        return [self.layers.index(i) for i in layers]

    def _decode(self, shard: str, rows: slice | np.ndarray, layer_pos: list[int]) -> torch.Tensor:
        """float32 (rows, layers, hidden) of one shard; a damaged chunk is named, not a codec error."""
        with self.store.reading(self.ref, [shard]):
            return self._decode_arrays(shard, rows, layer_pos)

    def _decode_arrays(self, shard: str, rows: slice | np.ndarray, layer_pos: list[int]) -> torch.Tensor:
        def array(name: str) -> zarr.Array:
            return self._array(shard, name)

        if self.meta["dtype"] == "int8":
            block = Int8Block(
                q=array("hidden").get_orthogonal_selection((rows, layer_pos, slice(None))),
                scale=array("scale").get_orthogonal_selection((rows, layer_pos)),
                outlier_idx=array("outlier_idx")[...][layer_pos],
                outlier_bits=array("outlier_bits").get_orthogonal_selection((rows, layer_pos, slice(None))),
            )
            return dequantize_int8(block)
        bits = array("hidden").get_orthogonal_selection((rows, layer_pos, slice(None)))
        return from_bf16_bits(bits).float()

    def get(self, sample_id: str, layer: int) -> torch.Tensor:
        """One sample's stored tokens at one layer: float32 (tokens, hidden)."""
        return self.sample(sample_id, [layer])[:, 0]

    def sample(self, sample_id: str, layers: list[int]) -> torch.Tensor:
        """float32 (tokens, len(layers), hidden) for one sample, reading only those layers."""
        if sample_id not in self._index:
            raise KeyError(f"sample {sample_id!r} has no anchors in {self.loc.uri}")
        w = self._index[sample_id]
        return self._decode(w.shard, slice(w.start, w.end), self._layer_pos(layers))

    def samples(self, sample_ids: list[str], layers: list[int]) -> list[torch.Tensor]:
        """`sample` for many samples, one read per shard (of just those samples' rows) instead of one
        per sample: loading a drafter's 444 training samples took 33 s in per-sample Zarr calls."""
        missing = [sid for sid in sample_ids if sid not in self._index]
        if missing:
            raise KeyError(f"samples {missing[:3]} have no anchors in {self.loc.uri}")
        pos = self._layer_pos(layers)
        by_shard: dict[str, list[str]] = {}
        for sid in sample_ids:
            by_shard.setdefault(self._index[sid].shard, []).append(sid)
        out: dict[str, torch.Tensor] = {}
        for shard, sids in by_shard.items():
            where = [self._index[sid] for sid in sids]
            rows = np.concatenate([np.arange(w.start, w.end) for w in where])  # not the rows between them
            if rows.size == 0:
                out.update((sid, self._decode(shard, slice(0, 0), pos)) for sid in sids)
                continue
            block = self._decode(shard, rows, pos)  # (rows, L, H)
            out.update(zip(sids, torch.split(block, [w.end - w.start for w in where]), strict=True))
        return [out[sid] for sid in sample_ids]

    def at(self, sample_id: str, layers: list[int], positions: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The stored states of one sample at the given absolute token positions (those stored).

        Returns (positions found (k,), float32 (k, len(layers), H)); positions without anchors (EOS
        padding past the response, prompt tokens under `tokens: response`) are left out.
        """
        w = self._index[sample_id]
        stored = self._column(w.shard, "positions", w)
        rows = np.flatnonzero(np.isin(stored, positions))
        return stored[rows], self._decode(w.shard, w.start + rows, self._layer_pos(layers))

    def layer_means(self, layers: list[int], samples: int = 64) -> torch.Tensor:
        """Mean stored state per layer over the first `samples` samples: float32 (len(layers), H)."""
        pos = self._layer_pos(layers)
        total, count = None, 0
        for sid in self.sample_ids[:samples]:
            w = self._index[sid]
            if w.end == w.start:
                continue
            h = self._decode(w.shard, slice(w.start, w.end), pos)  # (n, L, H)
            total = h.sum(0) if total is None else total + h.sum(0)
            count += h.shape[0]
        if total is None:
            raise AnchorMismatchError(f"the anchors at {self.loc.uri} hold no tokens to average")
        return total / count

    def scalars(self, sample_id: str) -> dict[str, np.ndarray]:
        """positions, confidence and entropy of one sample's stored tokens."""
        w = self._index[sample_id]
        return {k: self._column(w.shard, k, w) for k in ("positions", "confidence", "entropy")}

    def batch(
        self, sample_ids: list[str], layers: list[int], token_fraction: float, rng: np.random.Generator
    ) -> list[dict[str, Any]]:
        """For each sample, a random subset of its tokens at the given layers (for alignment losses)."""
        pos = self._layer_pos(layers)
        out = []
        for sid in sample_ids:
            w = self._index[sid]
            n = w.end - w.start
            k = max(1, int(round(token_fraction * n))) if n else 0
            rows = np.sort(rng.choice(n, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)
            out.append(
                {
                    "sample_id": sid,
                    "positions": self._column(w.shard, "positions", w)[rows],
                    "hidden": self._decode(w.shard, w.start + rows, pos),  # (k, len(layers), H)
                }
            )
        return out
