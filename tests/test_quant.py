"""Tests for models.quant: bf16 bit storage and int8 anchors with exact outlier channels."""

import numpy as np
import pytest
import torch

from a2d.models.quant import (
    Int8Block,
    bf16_bits,
    choose_outliers,
    cosine_stats,
    dequantize_int8,
    from_bf16_bits,
    quantize_int8,
)

T, L, H = 256, 4, 576


def llm_like(n_tok: int = T, n_layer: int = L, hidden: int = H, seed: int = 0) -> torch.Tensor:
    """Gaussian hidden states (T, L, H) with a few massive channels and per-token scale drift."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, n_layer, hidden, generator=g)  # (T, L, H)
    token_scale = torch.exp(0.5 * torch.randn(n_tok, 1, 1, generator=g))  # (T, 1, 1)
    x = x * token_scale
    # Each layer gets its own 3-4 massive channels, scaled 50-500x, as in real residual streams.
    for layer in range(n_layer):
        n_big = 3 + layer % 2
        chans = torch.randperm(hidden, generator=g)[:n_big]
        gains = torch.linspace(50.0, 500.0, n_big)
        x[:, layer, chans] *= gains
    return x


def bf16_ref(x: torch.Tensor) -> torch.Tensor:
    """What the bf16 mode stores, as float32."""
    return x.to(torch.bfloat16).float()


def test_bf16_bits_round_trip_special_values() -> None:
    tiny = torch.finfo(torch.bfloat16).tiny
    x = torch.tensor(
        [0.0, -0.0, 1.0, -2.5, 3e38, -3e38, float("inf"), float("-inf"), tiny, tiny / 4, -tiny / 8]
    )
    bits = bf16_bits(x)
    assert bits.dtype == np.uint16 and bits.shape == (11,)
    back = from_bf16_bits(bits)
    assert back.dtype == torch.bfloat16
    xb = x.to(torch.bfloat16)
    assert torch.equal(back.view(torch.int16), xb.view(torch.int16))  # bitwise, keeps -0.0
    assert bits[1] == 0x8000 and bits[0] == 0x0000
    assert bits[6] == 0x7F80 and bits[7] == 0xFF80
    assert back[9] != 0 and back[9] < tiny  # a subnormal survives


def test_bf16_bits_matches_torch_cast_on_random_values() -> None:
    x = torch.randn(64, 3, 32, dtype=torch.float32) * 1e3
    expected = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16_bits(x), expected)
    assert torch.equal(from_bf16_bits(bf16_bits(x)), x.to(torch.bfloat16))


def test_from_bf16_bits_all_patterns_exact() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every pattern, NaNs included
    back = from_bf16_bits(bits)
    np.testing.assert_array_equal(back.view(torch.int16).numpy().view(np.uint16), bits)
    np.testing.assert_array_equal(bf16_bits(back), bits)


def test_outliers_fix_massive_activations() -> None:
    x = llm_like()
    ref = bf16_ref(x)
    stats = {}
    for k in (0, 8, 16):
        block = quantize_int8(x, k=k)
        stats[k] = cosine_stats(ref, dequantize_int8(block))
        stats[k]["ratio"] = block.nbytes() / (T * L * H * 2)
    assert stats[0]["mean_cos"] < stats[8]["mean_cos"]
    assert stats[0]["mean_cos"] < 0.9999
    assert stats[8]["mean_cos"] >= 0.9999
    assert stats[8]["ratio"] <= 0.52
    assert stats[16]["mean_cos"] >= stats[8]["mean_cos"] - 1e-6


def test_outliers_are_the_massive_channels_and_exact() -> None:
    x = llm_like()
    block = quantize_int8(x, k=8)
    assert block.outlier_idx.dtype == np.int32 and block.outlier_idx.shape == (L, 8)
    peak = x.abs().amax(dim=0)  # (L, H)
    for layer in range(L):
        top = set(torch.topk(peak[layer], 3).indices.tolist())
        assert top <= set(block.outlier_idx[layer].tolist())
        assert np.all(np.diff(block.outlier_idx[layer]) > 0)
        assert not block.q[:, layer, block.outlier_idx[layer]].any()
    full = dequantize_int8(block)
    idx = torch.from_numpy(block.outlier_idx.astype(np.int64))  # (L, k)
    got = torch.gather(full, 2, idx[None].expand(T, L, 8))
    want = torch.gather(bf16_ref(x), 2, idx[None].expand(T, L, 8))
    assert torch.equal(got, want)


def test_block_dtypes_shapes_and_range() -> None:
    block = quantize_int8(llm_like(n_tok=32), k=8)
    assert isinstance(block, Int8Block)
    assert block.q.dtype == np.int8 and block.q.shape == (32, L, H)
    assert block.scale.dtype == np.float16 and block.scale.shape == (32, L)
    assert block.outlier_bits.dtype == np.uint16 and block.outlier_bits.shape == (32, L, 8)
    assert block.q.min() >= -127 and block.q.max() <= 127
    assert np.abs(block.q).max(axis=2).min() >= 126  # the scale uses nearly the full range


def test_quantize_uses_bf16_rounded_values_and_is_deterministic() -> None:
    x = llm_like(n_tok=64)
    a, b = quantize_int8(x), quantize_int8(x.to(torch.bfloat16))
    for field in ("q", "scale", "outlier_idx", "outlier_bits"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_given_outlier_idx_is_used() -> None:
    x = llm_like(n_tok=64)
    idx = torch.tensor([[5, 1, 3]] * L)
    block = quantize_int8(x, outlier_idx=idx)
    np.testing.assert_array_equal(block.outlier_idx, [[1, 3, 5]] * L)
    assert block.outlier_bits.shape == (64, L, 3)
    with pytest.raises(ValueError, match="repeated"):
        quantize_int8(x, outlier_idx=torch.tensor([[1, 1, 3]] * L))
    with pytest.raises(ValueError, match="outlier_idx"):
        quantize_int8(x, outlier_idx=torch.tensor([[1, 2, H]] * L))


def test_subset_decode_equals_slice_of_full() -> None:
    block = quantize_int8(llm_like(n_tok=64), k=8)
    full = dequantize_int8(block)  # (T, L, H)
    assert full.dtype == torch.float32
    assert torch.equal(dequantize_int8(block, layers=[3, 1]), full[:, [3, 1]])
    assert torch.equal(dequantize_int8(block, tokens=slice(10, 20)), full[10:20])
    toks = np.array([0, 63, 7])
    got = dequantize_int8(block, layers=[2], tokens=toks)
    assert got.shape == (3, 1, H)
    assert torch.equal(got, full[torch.from_numpy(toks)][:, [2]])


def test_zero_rows_decode_to_zero() -> None:
    x = llm_like(n_tok=16)
    x[3] = 0.0
    x[5, 2] = 0.0
    block = quantize_int8(x, k=8)
    assert block.scale[3].max() == 0 and block.scale[5, 2] == 0
    full = dequantize_int8(block)
    assert not full[3].any() and not full[5, 2].any()
    assert torch.isfinite(full).all()


def test_invalid_inputs_raise() -> None:
    x = llm_like(n_tok=8, hidden=16)
    with pytest.raises(ValueError, match="k=17"):
        quantize_int8(x, k=17)
    with pytest.raises(ValueError, match="k=17"):
        choose_outliers(x, k=17)
    with pytest.raises(ValueError, match="3-D"):
        quantize_int8(x[:, 0])
    with pytest.raises(ValueError, match="float"):
        quantize_int8(torch.ones(2, 2, 2, dtype=torch.int32), k=0)


def test_scale_overflow_names_layer() -> None:
    x = torch.zeros(4, 3, 16)
    x[1, 2, 5] = 1e7  # scale 1e7 / 127 > fp16 max, and k=0 leaves it in the int8 part
    with pytest.raises(ValueError, match="layer 2"):
        quantize_int8(x, k=0)
    quantize_int8(x, k=1)  # the same value is fine once it is an exact outlier


def test_cosine_stats_known_values() -> None:
    ref = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # (1, 2, 2)
    approx = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])
    s = cosine_stats(ref, approx)
    assert s["min_cos"] == pytest.approx(0.0)
    assert s["mean_cos"] == pytest.approx(0.5)  # two zero vectors count as agreeing
    assert s["rel_l2"] == pytest.approx(2**0.5)
    assert cosine_stats(ref, ref)["rel_l2"] == 0.0
