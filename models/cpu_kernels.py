"""Inference linears on the CPU through oneDNN with pre-packed weights.

On the CPU a decoding forward feeds a handful of rows (the newest token and a few drafts). MKL's
general matrix product is poor at that size: on the 2-core AMD EPYC this project runs on, a
576x1536 projection over 2 rows costs 2.1x one row and over 8 rows 2.3x, while a oneDNN inner
product on a weight packed once costs 0.9x / 1.1x of one row (benchmarks/decode.py reports what a
whole forward costs). One row too: at 2 threads oneDNN takes 78 us where MKL's matrix-vector path
takes 159 us for a 3072x576 product, and 4.7 ms against 10.5 ms for the demo's 49k-row LM head, so
AR decoding runs 18.4 tokens/s where it ran 13.3 (transformers' `generate`: 14.0). Anything with
gradients (training), a non-fp32 weight or a non-CPU tensor keeps `F.linear`: the packed path is an
inference-time kernel choice, the same function up to float rounding (checked when packing).

Sibling projections that read the same input (q/k/v, gate/up, a Gated DeltaNet layer's input
projections) run as one product over their concatenated weights (`Group`): one kernel call where
the model makes two to four, each sibling's output a column slice of it. A LoRA-adapted group
(`a2d.models.fast_lora`) carries its members' LoRA A rows in the same product and adds every
member's delta on the open rows with one block-diagonal B product: a decode forward costs its base
forward plus one small product per group, not two per projection and the dispatch around them.
"""

from __future__ import annotations

import functools
import operator
import threading
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

_VERSION = operator.attrgetter("_version")


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


def _plain(x: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`: the packed kernel for several rows without grad, else `F.linear`."""
    group = getattr(module, "_a2d_group", None)
    if group is not None and _plain(x):
        return group.output(module._a2d_index, x)[0]
    packed = getattr(module, "_a2d_packed", None)
    rows = x.numel() // max(x.shape[-1], 1)
    if packed is None or rows < 1 or not _plain(x) or module.weight.dtype != torch.float32:
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
    """Route every fp32 CPU `nn.Linear` of `model` through `linear`, siblings as one `Group`;
    returns how many linears. A no-op where the torch build lacks the kernel (or on GPU models).
    Packing again (after PEFT wrapped the projections, or installed the lean LoRA) regroups."""
    if not supported():
        return 0
    routed = []
    for module in model.modules():
        module.__dict__.pop("_a2d_fast", None)  # groups are made afresh below
        if type(module) is not nn.Linear or not _packable(module):
            continue
        module._a2d_packed, module._a2d_group = None, None
        module.forward = MethodType(_forward, module)
        routed.append(module)
    for parent in model.modules():
        for names in SIBLINGS:
            children = [getattr(parent, n, None) for n in names]
            if all(c is not None for c in children):
                _group(children)
    for module in routed:  # a grouped linear runs through its group's product: only the others pack
        if module._a2d_group is None:
            module._a2d_packed, module._a2d_version = _pack(module.weight), module.weight._version
    return len(routed)


# Projections that read the same input tensor, by the names transformers gives them (llama and its
# relatives, qwen3 / qwen3_5 attention and MLP, qwen3_5's Gated DeltaNet input projections). A
# LoRA-adapted projection outside these forms a group of one (its A rows join its own product).
SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("o_proj",),
    ("down_proj",),
    ("out_proj",),
)


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype == torch.float32


def _adapted(child: nn.Module) -> bool:
    return getattr(child, "_a2d_lora", None) is not None


def _group(children: list[nn.Module]) -> None:
    """Make `children` (plain linears, or LoRA wrappers around them) one Group, when they can be."""
    bases = [getattr(c, "base_layer", c) for c in children]
    if not all(type(b) is nn.Linear and "_a2d_group" in b.__dict__ for b in bases):  # routed by pack()
        return
    if len({b.in_features for b in bases}) != 1:
        return
    adapted = [_adapted(c) for c in children]
    if any(adapted) and not all(adapted):
        return  # a partly adapted group keeps per-projection products
    if len(bases) == 1 and not any(adapted):
        return  # nothing to fuse
    group = Group(bases, children if all(adapted) else None)
    for i, b in enumerate(bases):
        b._a2d_group, b._a2d_index = group, i
    if group.adapters:
        for i, c in enumerate(children):
            c._a2d_fast = (group, i)  # the lean LoRA forward's shortcut (a2d.models.fast_lora)


class Group:
    """Sibling linears over one input as one product: `[W_1; …; W_g (; A_1; …; A_g)] x`.

    `output(i, x)` returns member i's output (a column slice of the product) and whether the LoRA
    delta is in it. The first member called computes the product for all and keeps the others'
    slices for their calls with the same input tensor (per thread); a call with another tensor
    computes afresh, so the order of the calls does not matter. The LoRA delta goes in when the
    decode state allows it: one row, a no-grad forward whose whole trailing window is open with a
    unit gate (`Scope.unit_window`), no dropout; then `y[-w:, :Σout] += xa[-w:] @ blockdiag(B_i s_i)ᵀ`.
    Otherwise the members' wrappers add the delta themselves (`fast_lora`). Weights changed in place
    (an adapter load) are packed again on the next call.
    """

    def __init__(self, bases: list[nn.Linear], adapters: list[nn.Module] | None):
        self.bases, self.adapters = bases, adapters
        self.sizes = [b.out_features for b in bases]
        self.width = sum(self.sizes)
        self.local = threading.local()
        self.version: tuple[int, ...] | None = None
        self.params = [p for b in bases for p in (b.weight, b.bias) if p is not None]
        for a in adapters or ():  # the LoRA parameters themselves: an adapter load copies into them
            self.params += [a._a2d_lora[0], a._a2d_lora[1]]
        if adapters:
            self.first, self.scope = adapters[0], adapters[0]._a2d_scope
            self.dropout = any(a._a2d_lora[3] is not None for a in adapters)

    def _versions(self) -> tuple[int, ...]:
        return tuple(map(_VERSION, self.params))

    def _build(self) -> None:
        with torch.no_grad():
            rows = [b.weight for b in self.bases]
            bias = None
            if any(b.bias is not None for b in self.bases):
                bias = torch.cat(
                    [b.bias if b.bias is not None else b.weight.new_zeros(b.out_features) for b in self.bases]
                )
            self.rank = 0
            if self.adapters:
                loras = [a._a2d_lora for a in self.adapters]
                rows += [lora[0].float() for lora in loras]
                ranks = [lora[0].shape[0] for lora in loras]
                self.rank = sum(ranks)
                blocks = torch.zeros(self.rank, self.width)  # blockdiag(B_i * s_i)^T
                r0, c0 = 0, 0
                for (_, b, scaling, _), r, n in zip(loras, ranks, self.sizes, strict=True):
                    blocks[r0 : r0 + r, c0 : c0 + n] = b.float().t() * scaling
                    r0, c0 = r0 + r, c0 + n
                self.blocks = blocks
                if bias is not None:
                    bias = torch.cat([bias, bias.new_zeros(self.rank)])
            self.splits = [*self.sizes, self.rank] if self.rank else list(self.sizes)
            self.bias = bias
            self.packed = _pack(torch.cat(rows).contiguous())
        self.version = self._versions()

    def _lora_ready(self, x: torch.Tensor) -> int | None:
        """The open window the delta goes into here, or None when the wrappers must add it."""
        scope = self.scope
        gate = scope.adapter
        if gate is None or self.first._disable_adapters:
            return 0  # no open positions, or adapters off: the base alone
        if self.dropout or not (scope.unit_window and gate is scope.forward_gate and x.dim() == 3):
            return None
        if x.shape[0] != 1:
            return None
        return min(scope.window, x.shape[-2])

    def output(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        local = self.local
        kept = getattr(local, "kept", None)
        if kept and local.x is x:
            out = kept.pop(index, None)
            if out is not None:
                return out, local.lora
        if self.version != tuple(map(_VERSION, self.params)):
            self._build()
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, x.shape[-1]), self.packed, self.bias, "none", [], ""
        )
        lora = False
        if self.adapters:
            w = self._lora_ready(x)
            if w is not None:
                lora = True
                if w:  # narrow, not indexing: this runs ~120 times per decode forward
                    tail = y.narrow(0, y.shape[0] - w, w)
                    tail.narrow(1, 0, self.width).addmm_(tail.narrow(1, self.width, self.rank), self.blocks)
        y = y.view(*x.shape[:-1], y.shape[-1])
        if len(self.sizes) == 1:  # a group of one (an adapted o/down projection): nothing to stash
            local.lora = lora
            return (y.narrow(-1, 0, self.width) if self.rank else y), lora
        outs = y.split(self.splits, -1)
        local.x, local.lora = x, lora
        local.kept = {j: outs[j] for j in range(len(self.sizes)) if j != index}
        return outs[index], lora
