"""Multi-row linears on the CPU through oneDNN with pre-packed weights.

On the CPU a decoding forward feeds a handful of rows (the newest token and a few drafts). MKL's
general matrix product is poor at that size: on the 2-core AMD EPYC this project runs on, a
576x1536 projection over 2 rows costs 2.1x one row and over 8 rows 2.3x, while a oneDNN inner
product on a weight packed once costs 0.9x / 1.1x of one row (benchmarks/decode.py reports what a
whole forward costs). One row keeps `F.linear` (MKL's matrix-vector path is as fast), and so does
anything with gradients (training), a non-fp32 weight or a non-CPU tensor: the packed path is an
inference-time kernel choice, the same function up to float rounding (checked when packing).
"""

from __future__ import annotations

import functools
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


@functools.cache
def supported() -> bool:
    """Whether this torch build has oneDNN's packed linear and it agrees with `F.linear` (checked once)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 32, generator=gen), torch.randn(3, 32, generator=gen)
        got = torch.ops.mkldnn._linear_pointwise(x, _pack(w), None, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w), atol=1e-4, rtol=1e-4))
    except (RuntimeError, AttributeError):
        return False


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`: the packed kernel for several rows without grad, else `F.linear`."""
    packed = getattr(module, "_a2d_packed", None)
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        packed is None
        or rows < 2
        or torch.is_grad_enabled()
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or module.weight.dtype != torch.float32
    ):
        return F.linear(x, module.weight, module.bias)
    if module._a2d_version != module.weight._version:  # the weight changed in place: pack it again
        module._a2d_packed, module._a2d_version = _pack(module.weight), module.weight._version
        packed = module._a2d_packed
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(rows, x.shape[-1]), packed, module.bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], out.shape[-1])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(self, x)


def pack(model: nn.Module) -> int:
    """Route every fp32 CPU `nn.Linear` of `model` through `linear`; returns how many. A no-op where
    the torch build lacks the kernel (or on GPU models)."""
    if not supported():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        module._a2d_packed, module._a2d_version = _pack(w), w._version
        module.forward = MethodType(_forward, module)
        count += 1
    return count
