"""Inference linears on the CPU: oneDNN with pre-packed weights, or MKL, whichever is faster here.

On the CPU a decoding forward feeds a handful of rows (the newest token and a few drafts), and which
kernel is faster at that size depends on the processor, the shape and the row count. On a 2-core
AMD EPYC, MKL's matrix-vector path took 159 us for a 3072x576 product where oneDNN took 78 us, and
over 2-8 rows MKL's general product cost 2.1-2.3x one row while oneDNN's packed inner product cost
0.9-1.1x. On a 2-core Intel Xeon it is the other way round at one or two rows (576x960: MKL 22 us,
oneDNN 47 us; 1536x576: 34 against 86 us) and oneDNN wins from four rows on (the 49k-row LM head
over 9 rows: 6.8 ms against 16.3 ms). So the kernel is chosen per weight shape and row count by
timing both once per process, interleaved, and oneDNN runs only where it is clearly faster: a near
tie stays with `F.linear`, what transformers runs (`kernel_choice`; `A2D_CPU_LINEAR=packed|dense`
forces one). Anything
with gradients (training), a non-fp32 weight or a non-CPU tensor keeps `F.linear`: the packed path
is an inference-time kernel choice, the same function up to float rounding (checked when packing).

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
import os
import threading
import time
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


BUCKETS = (1, 2, 4, 8, 16)  # row counts a kernel choice is timed at; more rows take the last


_BUCKET_OF = [0] + [next(i for i, b in enumerate(BUCKETS) if r <= b) for r in range(1, BUCKETS[-1] + 1)]


def _bucket(rows: int) -> int:
    return _BUCKET_OF[rows] if rows <= BUCKETS[-1] else len(BUCKETS) - 1


def _median_us(fn, budget_s: float = 0.002) -> float:
    fn()  # warm-up (and the first call's one-time work)
    start = time.perf_counter()
    fn()
    reps = max(3, min(25, int(budget_s / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


MARGIN = 0.9  # oneDNN must take under 90 % of MKL's time to be chosen: a near tie stays with F.linear
ROUNDS = 5  # interleaved timing rounds per row bucket (one noisy round cannot flip the choice)


@functools.cache
def kernel_choice(in_features: int, out_features: int) -> tuple[bool, ...]:
    """Per row bucket (`BUCKETS`), whether oneDNN's packed product beats `F.linear` (what the library
    runs) for a weight of this shape on this machine by a clear margin: both timed once per process
    on random data, interleaved over a few rounds (tens of ms a shape)."""
    forced = os.environ.get("A2D_CPU_LINEAR", "auto")
    if forced not in ("auto", "packed", "dense"):
        raise ValueError(f"A2D_CPU_LINEAR={forced!r}: use auto, packed or dense")
    if forced != "auto":
        return (forced == "packed",) * len(BUCKETS)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen)
    packed = _pack(w)
    wins = []
    with torch.no_grad():
        for rows in BUCKETS:
            x = torch.randn(rows, in_features, generator=gen)
            one, mkl = [], []
            for _ in range(ROUNDS):
                one.append(
                    _median_us(
                        lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                    )
                )
                mkl.append(_median_us(lambda x=x: F.linear(x, w)))
            wins.append(sorted(one)[ROUNDS // 2] < MARGIN * sorted(mkl)[ROUNDS // 2])
    return tuple(wins)


def _plain(x: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`: the packed kernel (alone or in its group's product) where it is the faster one
    for this many rows and there is no grad, else `F.linear` (checked first: the one-row hot path)."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if (
        not rows
        or not module._a2d_wins[_bucket(rows)]
        or not _plain(x)
        or module.weight.dtype != torch.float32
    ):
        return F.linear(x, module.weight, module.bias)
    group = module._a2d_group
    if group is not None:
        return group.output(module._a2d_index, x)[0]
    if module._a2d_version != module.weight._version:  # the weight changed in place: pack it again
        module._a2d_packed, module._a2d_version = _pack(module.weight), module.weight._version
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(rows, width), module._a2d_packed, module.bias, "none", [], ""
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
        if "_a2d_fast" in module.__dict__:
            module._a2d_fast = None  # groups are made afresh below
        if type(module) is not nn.Linear or not _packable(module):
            continue
        module._a2d_packed, module._a2d_group = None, None
        module._a2d_wins = (False,) * len(BUCKETS)  # set below, with the packed copy or the group
        module.forward = MethodType(_forward, module)
        routed.append(module)
    for parent in model.modules():
        for names in SIBLINGS:
            children = [getattr(parent, n, None) for n in names]
            if all(c is not None for c in children):
                _group(children)
    for module in routed:  # a grouped linear runs through its group's product: only the others pack
        if module._a2d_group is None:
            wins = kernel_choice(module.in_features, module.out_features)
            if any(wins):  # MKL at every row count: no packed copy
                module._a2d_packed, module._a2d_version = _pack(module.weight), module.weight._version
                module._a2d_wins = wins
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
        b._a2d_group, b._a2d_index, b._a2d_wins = group, i, group.wins
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
        self.rank = sum(a._a2d_lora[0].shape[0] for a in adapters or ())  # LoRA rows in the product
        self.wins = kernel_choice(bases[0].in_features, self.width + self.rank)  # per row bucket: packed?

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
            if self.adapters:
                loras = [a._a2d_lora for a in self.adapters]
                rows += [lora[0].float() for lora in loras]
                ranks = [lora[0].shape[0] for lora in loras]
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
            stacked = torch.cat(rows).contiguous()
            self.packed = _pack(stacked) if any(self.wins) else None
            # where MKL wins some row count, an adapted group keeps the same stacked rows dense
            self.dense = stacked if self.rank and not all(self.wins) else None
        self.version = self._versions()

    def output(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        local = self.local
        kept = getattr(local, "kept", None)
        if kept is not None and local.x is x:
            out = kept[index]
            if out is not None:
                kept[index] = None  # each slice serves one call: a second call computes afresh
                return out, local.lora
        if self.version != tuple(map(_VERSION, self.params)):
            self._build()
        # A decode forward makes ~120 of these calls, and on a 2-core CPU every tensor op and Python
        # frame costs microseconds whatever the size: the product, then two strided views and the
        # delta, then one split.
        rows = x.numel() // x.shape[-1]
        if self.wins[_bucket(rows)]:
            y = torch.ops.mkldnn._linear_pointwise(
                x.reshape(rows, x.shape[-1]), self.packed, self.bias, "none", [], ""
            ).view(*x.shape[:-1], -1)
        elif self.dense is not None:  # MKL at this row count: the same stacked rows, dense
            y = F.linear(x, self.dense, self.bias)  # (…, Σout + rank), fresh and contiguous
        else:  # MKL at this row count: each plain member its own product, as the model runs it
            base = self.bases[index]
            return F.linear(x, base.weight, base.bias), False
        lora = False
        if self.adapters:
            w = self._window(x)
            if w is not None:
                lora = True
                if w:  # y[-w:, :Σout] += y[-w:, Σout:] @ blockdiag(B_i s_i)ᵀ, on strided views
                    step = self.width + self.rank
                    at = (rows - w) * step  # y is fresh: its storage starts at its first element
                    y.as_strided((w, self.width), (step, 1), at).addmm_(
                        y.as_strided((w, self.rank), (step, 1), at + self.width), self.blocks
                    )
        if len(self.sizes) == 1:  # a group of one (an adapted o/down projection): nothing to stash
            local.lora = lora
            return (y.narrow(-1, 0, self.width) if self.rank else y), lora
        outs = list(torch.split_with_sizes(y, self.splits, -1))
        out, outs[index] = outs[index], None
        local.x, local.lora, local.kept = x, lora, outs
        return out, lora

    def _window(self, x: torch.Tensor) -> int | None:
        """The open window the delta goes into here (0: none), or None when the wrappers must add it:
        it goes in for one row, no grad, the whole trailing window open with gate 1, no dropout."""
        scope = self.scope
        gate = scope.adapter
        if gate is None or self.first._disable_adapters:
            return 0  # no open positions, or adapters off: the base alone
        if (
            scope.unit_window
            and gate is scope.forward_gate
            and not self.dropout
            and x.dim() == 3
            and x.shape[0] == 1
        ):
            return min(scope.window, x.shape[1])
        return None  # training, dropout, a batch: the members' wrappers add the delta themselves
