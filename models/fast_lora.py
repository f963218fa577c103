"""The masked-scope LoRA as one lean call per projection, for decoding.

PEFT runs every adapted projection through its generic wrapper (argument checks, an adapter loop,
dtype casts) and three module calls (`lora_A`, dropout, `lora_B`) plus the scope hook that gates
`lora_B`'s output: 631 module calls per forward where the base makes 211, +39 % at one token on the
CPU demo. Under `adapter_scope: masked` the delta is zero outside the open positions, and the open
positions are a suffix of every row (`a2d.models.attention`), so the delta only needs computing on
the trailing `scope.window` columns:

    y = base(x);  y[:, -w:] += B(A(dropout(x[:, -w:]))) · scaling · gate[:, -w:]

which is the same function PEFT computes (a test compares logits with the training forward), at
the cost of the base layer plus two small matmuls over the open rows. Clean rows cost what the base
costs. With adapters disabled (`Student.base()`) or no open positions it is the base layer alone.
On the CPU, sibling projections go further (`a2d.models.cpu_kernels.Group`): their A rows ride in
the siblings' one base product and one block-diagonal B product adds every delta, so a decode
forward makes about one extra small product per group instead of two per projection (at 2 threads
the 420 small products and their dispatch cost +12-29 ms on a ~62-82 ms forward of the demo).
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from a2d.models import cpu_kernels
from a2d.models.attention import Scope

ADAPTER = "default"


def _lean_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    fast = self._a2d_fast  # (group, index) where cpu_kernels grouped this projection, else None
    if fast is not None and not args and not kwargs and cpu_kernels._plain(x):
        out, applied = fast[0].output(fast[1], x)  # siblings' product, A rows and delta included
        if applied:
            return out
    else:
        base = self.base_layer
        plain = type(base) is nn.Linear and not args and not kwargs
        out = cpu_kernels.linear(base, x) if plain else base(x, *args, **kwargs)  # (B, T, out)
    gate = self._a2d_scope.adapter  # (B, T) or None
    if gate is None or self.disable_adapters:
        return out
    w = min(self._a2d_scope.window, x.shape[-2])
    if w == 0:
        return out
    a, b, scaling, dropout = self._a2d_lora
    scope = self._a2d_scope
    if (
        scope.unit_window
        and gate is scope.forward_gate
        and dropout is None
        and x.dim() == 3
        and x.dtype == a.dtype
    ):
        # a decode forward (one row, its whole window open, no grad): one fused multiply-add in place
        out[0, -w:].addmm_(F.linear(x[0, -w:], a), b.t().to(out.dtype), alpha=scaling)
        return out
    xo = x[..., -w:, :]
    if xo.dtype != a.dtype:
        xo = xo.to(a.dtype)
    if dropout is not None:
        xo = dropout(xo)
    delta = F.linear(F.linear(xo, a), b) * (gate[:, -w:, None].to(a.dtype) * scaling)
    if delta.dtype != out.dtype:
        delta = delta.to(out.dtype)
    if torch.is_grad_enabled():
        return torch.cat([out[..., :-w, :], out[..., -w:, :] + delta], dim=-2)
    out[..., -w:, :] += delta
    return out


def install(model: nn.Module, scope: Scope) -> int:
    """Route every LoRA projection of `model` (a PeftModel with one plain LoRA adapter) through the
    lean forward gated by `scope`; returns how many were routed. Needs `adapter_scope: masked`."""
    if not scope.masked:
        raise ValueError(
            "the lean LoRA path needs adapter_scope: masked (the delta is confined to open rows)"
        )
    count = 0
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or ADAPTER not in lora_a:
            continue
        if set(lora_a) != {ADAPTER} or getattr(module, "lora_variant", {}):
            raise ValueError(f"{type(module).__name__} carries adapters the lean path does not model")
        module._a2d_scope = scope
        module._a2d_fast = None  # set by cpu_kernels.pack where the projection joins a group
        dropout = module.lora_dropout[ADAPTER]
        module._a2d_lora = (  # the parameters themselves: loading an adapter copies into them in place
            lora_a[ADAPTER].weight,
            module.lora_B[ADAPTER].weight,
            float(module.scaling[ADAPTER]),
            None if isinstance(dropout, nn.Identity) else dropout,
        )
        module.forward = MethodType(_lean_forward, module)
        count += 1
    cpu_kernels.pack(model)  # sibling projections and their A rows as one product each (CPU)
    return count
