"""Anchor compression: bf16 as raw uint16 bits, and int8 with exact bf16 outlier channels.

Residual streams of real LLMs carry a few "massive activation" channels whose magnitude is
hundreds of times the rest. Plain per-token absmax int8 spends its whole range on them and
crushes every other channel. So, per layer, the k channels with the largest max|x| over the
block's tokens are kept exactly (as bf16 bits) and zeroed; the remainder is int8 with a
per-token-per-layer fp16 scale.
"""

from dataclasses import dataclass

import numpy as np
import torch

_FP16_MAX = float(torch.finfo(torch.float16).max)
_QMAX = 127


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """Round any float tensor to bf16 and return its bit pattern as a uint16 array."""
    b = x.detach().to(torch.bfloat16).contiguous().cpu()
    # int16 view is available on every torch version; numpy reinterprets the same bytes.
    return b.view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> torch.Tensor:
    """Reinterpret a uint16 array of bf16 bits as a torch.bfloat16 tensor (exact round trip)."""
    if bits.dtype != np.uint16:
        raise ValueError(f"bf16 bits must be uint16, got {bits.dtype}")
    # Copy so the tensor owns writable memory (zarr/np.memmap arrays may be read-only).
    owned = np.array(bits, dtype=np.uint16, copy=True, order="C")
    return torch.from_numpy(owned.view(np.int16)).view(torch.bfloat16)


@dataclass
class Int8Block:
    """One shard of anchors in int8 form; all arrays are numpy so a store can write them as-is."""

    q: np.ndarray  # int8 (T, L, H); outlier channels are zero
    scale: np.ndarray  # float16 (T, L); per-token-per-layer absmax / 127
    outlier_idx: np.ndarray  # int32 (L, k); exact channels per layer, sorted ascending
    outlier_bits: np.ndarray  # uint16 (T, L, k); bf16 bits of those channels

    def nbytes(self) -> int:
        """Total payload bytes of the four arrays."""
        return int(self.q.nbytes + self.scale.nbytes + self.outlier_idx.nbytes + self.outlier_bits.nbytes)


def _check_input(x: torch.Tensor, k: int) -> None:
    """Reject inputs the int8 path cannot represent, with a message that says why."""
    if x.dim() != 3:
        raise ValueError(f"anchors must be 3-D (tokens, layers, hidden), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"anchors must be a float tensor, got {x.dtype}")
    hidden = x.shape[2]
    if not 0 <= k <= hidden:
        raise ValueError(f"k={k} outlier channels must be in [0, hidden={hidden}]")


def choose_outliers(x: torch.Tensor, k: int) -> torch.Tensor:
    """Per layer, the k channels with the largest max|x| over tokens: int64 (L, k), ascending."""
    _check_input(x, k)
    n_tok, n_layer, hidden = x.shape
    if n_tok == 0:
        peak = torch.zeros(n_layer, hidden)  # (L, H); no evidence, so ties pick the lowest indices
    else:
        peak = x.detach().to(torch.bfloat16).abs().amax(dim=0).float()  # (L, H)
    # A stable sort makes ties resolve to the lower channel index; topk gives no such promise.
    order = torch.sort(peak, dim=1, descending=True, stable=True).indices  # (L, H)
    return torch.sort(order[:, :k], dim=1).values.to(torch.int64)  # (L, k)


def _check_outlier_idx(idx: torch.Tensor, n_layer: int, hidden: int) -> torch.Tensor:
    """Validate caller-supplied outlier channels; return them int64, sorted per layer."""
    if idx.dim() != 2 or idx.shape[0] != n_layer:
        raise ValueError(f"outlier_idx must be (L={n_layer}, k), got shape {tuple(idx.shape)}")
    if idx.is_floating_point():
        raise ValueError(f"outlier_idx must be integer, got {idx.dtype}")
    k = idx.shape[1]
    if k > hidden:
        raise ValueError(f"k={k} outlier channels must be in [0, hidden={hidden}]")
    idx = torch.sort(idx.to(torch.int64), dim=1).values  # (L, k)
    if idx.numel() and (idx.min() < 0 or idx.max() >= hidden):
        raise ValueError(f"outlier_idx values must lie in [0, {hidden})")
    if k > 1 and bool((idx[:, 1:] == idx[:, :-1]).any()):
        raise ValueError("outlier_idx has a repeated channel within a layer")
    return idx


def _fp16_scale_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Round fp32 scales to fp16, upward, so |x| / scale16 never exceeds 127 and no clamp bites."""
    s16 = scale.to(torch.float16)  # (T,)
    low = (s16.float() < scale) & torch.isfinite(s16)
    # For positive finite halves the next representable value is the bit pattern plus one.
    bumped = (s16.view(torch.int16) + 1).view(torch.float16)
    return torch.where(low, bumped, s16)


def quantize_int8(x: torch.Tensor, k: int = 8, outlier_idx: torch.Tensor | None = None) -> Int8Block:
    """Quantise anchors (T, L, H) to int8 with k exact bf16 outlier channels per layer.

    Everything is derived from the bf16-rounded values, so int8 approximates what bf16 stores.
    Pass outlier_idx (L, k) to reuse channels chosen elsewhere; k is then taken from it.
    """
    _check_input(x, k if outlier_idx is None else 0)
    xb = x.detach().to(torch.bfloat16).cpu()  # (T, L, H)
    n_tok, n_layer, hidden = xb.shape
    if outlier_idx is None:
        idx = choose_outliers(xb, k)  # (L, k)
    else:
        idx = _check_outlier_idx(outlier_idx.cpu(), n_layer, hidden)
    k = idx.shape[1]

    q = np.empty((n_tok, n_layer, hidden), dtype=np.int8)
    scale = np.empty((n_tok, n_layer), dtype=np.float16)
    outlier_bits = np.empty((n_tok, n_layer, k), dtype=np.uint16)
    # One layer at a time keeps the float32 working copy at (T, H) instead of (T, L, H).
    for layer in range(n_layer):
        chans = idx[layer]  # (k,)
        xl = xb[:, layer, :].float()  # (T, H)
        outlier_bits[:, layer, :] = bf16_bits(xl[:, chans])  # bf16 -> fp32 -> bf16 is exact
        xl[:, chans] = 0.0
        s = xl.abs().amax(dim=1) / _QMAX if n_tok else xl.new_zeros(0)  # (T,) in fp32
        s16 = _fp16_scale_ceil(s)  # (T,)
        if not bool(torch.isfinite(s16).all()):
            worst = float(s.nan_to_num(nan=float("inf")).max())
            raise ValueError(
                f"layer {layer}: int8 scale {worst:.4g} is not representable in float16 "
                f"(max {_FP16_MAX:.0f}); values too large or non-finite outside the outliers"
            )
        s32 = s16.float()  # (T,); quantise against the scale that will be stored
        safe = torch.where(s32 > 0, s32, torch.ones_like(s32))  # zero rows: 0 / 1 -> 0
        ql = torch.round(xl / safe[:, None]).clamp_(-_QMAX, _QMAX)  # (T, H)
        q[:, layer, :] = ql.to(torch.int8).numpy()
        scale[:, layer] = s16.numpy()

    return Int8Block(
        q=q,
        scale=scale,
        outlier_idx=idx.to(torch.int32).numpy(),
        outlier_bits=outlier_bits,
    )


def dequantize_int8(
    block: Int8Block,
    layers: list[int] | None = None,
    tokens: np.ndarray | slice | None = None,
) -> torch.Tensor:
    """Decode to float32 (T', L', H), touching only the chosen layer positions and tokens."""
    tok = slice(None) if tokens is None else tokens
    lay = slice(None) if layers is None else np.asarray(layers, dtype=np.int64)
    # Index tokens then layers separately: two fancy indices in one step would broadcast.
    q = block.q[tok][:, lay]  # (T', L', H)
    scale = block.scale[tok][:, lay]  # (T', L')
    bits = block.outlier_bits[tok][:, lay]  # (T', L', k)
    idx = block.outlier_idx[lay]  # (L', k)

    out = torch.from_numpy(q.astype(np.float32))  # (T', L', H)
    out *= torch.from_numpy(scale.astype(np.float32))[:, :, None]
    n_tok, n_layer, k = bits.shape
    if k:
        vals = from_bf16_bits(bits).float()  # (T', L', k)
        where = torch.from_numpy(idx.astype(np.int64))[None].expand(n_tok, n_layer, k)
        out.scatter_(2, where, vals)  # outlier slots hold 0 in q, so overwrite is exact
    return out


def cosine_stats(ref: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Per-vector cosine over all leading dims (mean, min) and relative L2 error of approx."""
    if ref.shape != approx.shape:
        raise ValueError(f"shape mismatch: ref {tuple(ref.shape)} vs approx {tuple(approx.shape)}")
    r = ref.detach().float()  # (..., H)
    a = approx.detach().float()  # (..., H)
    # Reductions in float64: a mean cosine near 0.9999 needs more than fp32 sum accuracy.
    dot = (r * a).sum(-1, dtype=torch.float64)  # (...)
    nr = r.square().sum(-1, dtype=torch.float64).sqrt()  # (...)
    na = a.square().sum(-1, dtype=torch.float64).sqrt()  # (...)
    denom = nr * na
    # Two zero vectors agree perfectly; one zero vector against a non-zero one does not.
    cos = torch.where(denom > 0, dot / denom.clamp_min(1e-300), (nr == na).to(torch.float64))
    err = (r - a).square().sum(dtype=torch.float64).sqrt()
    ref_norm = r.square().sum(dtype=torch.float64).sqrt()
    rel = float(err / ref_norm) if ref_norm > 0 else float(err)
    return {"mean_cos": float(cos.mean()), "min_cos": float(cos.min()), "rel_l2": rel}
