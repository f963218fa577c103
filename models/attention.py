"""What each position of a student forward sees, and where the adapter acts.

The decode state a2d trains on (DESIGN §3 head): the prompt and every committed token form a
causal prefix; the open block sits at the end of the sequence and nothing after it is present.
Every forward names its *open* positions, a suffix of each row: in `block` attention an open
position attends to the whole prefix and to the whole open part, a prefix position attends
causally; in `bidirectional` attention (full A2D conversion) every position attends to every real
token.

`adapter_scope: masked` confines the adapter to the open positions: the LoRA deltas are gated to
zero elsewhere, the mask embedding only ever replaces mask tokens, and the reverse Gated DeltaNet
scan is added only there. Every prefix position then computes the base model exactly (causal, no
adapter): the logits that predict the first open position are the base model's own next-token
logits, and committed tokens' keys, values and recurrent states are the base model's cache.

Rows are left-padded, so the open part is always the last columns and a reverse scan over the
last `window` columns covers it for every row at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Tree:
    """A branched open region (speculative decoding drafts for every acceptance length at once).

    `allowed` (1, T, T) says which of the T new tokens each new token sees (clean tokens: causal;
    each open run: the prefix up to its attach point and itself); `positions` (1, T) are their
    positions from the first new token; `runs` are (first column, length, index of the saved
    linear-attention state it continues from) per open run (see `BidirectionalScan`).
    """

    allowed: torch.Tensor
    positions: torch.Tensor
    runs: list[tuple[int, int, int]]


class Scope:
    """The open positions and adapter gate of the forward being run, read by the hooks below.

    `set` leaves them in place after the forward (gradient checkpointing recomputes layers during
    backward, and the hooks must see the same gate then); the next forward replaces them. One
    student serves one forward at a time.
    """

    def __init__(self, masked: bool):
        self.masked = masked  # adapter_scope == "masked"
        self.open: torch.Tensor | None = None  # (B, T) bool: open positions of the current forward
        self.adapter: torch.Tensor | None = None  # (B, T) gate the LoRA deltas are multiplied by
        self.window = 0  # trailing columns the reverse scan covers
        self.segments: list[int] | None = None  # decode: clean-prefix segment lengths (see BidirectionalScan)
        self.states: dict[int, list] = {}  # decode: linear-attention state after each segment, per layer
        self.runs: list[tuple[int, int, int]] | None = None  # decode: open runs of a branched region
        self.unit_window = False  # see set()
        self.forward_gate: torch.Tensor | None = None

    def set(
        self,
        open_: torch.Tensor | None,
        window: int,
        adapter: torch.Tensor | None,
        segments: list[int] | None = None,
        runs: list[tuple[int, int, int]] | None = None,
    ) -> None:
        self.open, self.window, self.adapter, self.segments = open_, window, adapter, segments
        self.runs = runs
        self.states = {}
        # The whole trailing window open in one row (a decode forward): the LoRA delta needs no gate.
        self.unit_window = (
            adapter is not None
            and adapter.shape[0] == 1
            and window > 0
            and not torch.is_grad_enabled()
            and bool(adapter[:, -window:].eq(1).all())
        )
        self.forward_gate = adapter  # the gate of the whole forward (adapter_as swaps slices in)

    def clear(self) -> None:
        self.set(None, 0, None)

    @contextlib.contextmanager
    def adapter_as(self, gate: torch.Tensor | None) -> Iterator[None]:
        """Temporarily gate the adapter with `gate` (the reverse scan runs on flipped windows)."""
        old = self.adapter
        self.adapter = gate
        try:
            yield
        finally:
            self.adapter = old

    def lora_hook(self, _module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        """Forward hook on every `lora_B`: the LoRA delta times the gate (zero outside the scope)."""
        gate = self.adapter
        if gate is None:
            return out * 0.0  # no open positions: the base model
        if out.shape[:2] != gate.shape:
            raise RuntimeError(
                f"adapter gate {tuple(gate.shape)} does not fit a LoRA output {tuple(out.shape)}: "
                "call the student through student_forward so every position has a gate"
            )
        return out * gate[..., None].to(out.dtype)


class BidirectionalScan(nn.Module):
    """Wraps a causal linear-attention (Gated DeltaNet) layer of a student.

    - `reverse=True`: adds tanh(gate) · a reversed scan over the trailing `scope.window` columns at
      open positions (the open block in `block` mode, everything in `bidirectional` mode); the gate
      starts at zero, so an untrained student equals the teacher.
    - With a decode cache and `scope.segments` set, the clean prefix of the call is scanned in
      those segments and the recurrent state is saved after each (`scope.states[layer]`), then the
      open part is scanned and the state put back to "after the clean prefix": the open block never
      enters the cache, and a decoder can roll back to any segment boundary (a rejected draft).
    Without open positions (plain generation) it is the inner module.
    """

    def __init__(self, inner: nn.Module, scope: Scope, reverse: bool = True):
        super().__init__()
        self.inner = inner
        self.scope = scope
        self.gate = nn.Parameter(torch.zeros(())) if reverse else None

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        scope = self.scope
        if cache is not None and scope.segments is not None:
            fwd = self._segmented(hidden_states, cache, attention_mask, **kwargs)
        else:
            fwd = self.inner(
                hidden_states=hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if self.gate is None or scope.open is None or scope.window == 0:
            return fwd
        t = hidden_states.shape[1]
        runs = (
            [(start, n) for start, n, _ in scope.runs] if scope.runs else [(t - scope.window, scope.window)]
        )
        parts, pos = [], 0
        for start, n in runs:  # each open run scanned in reverse on its own
            x = hidden_states[:, start : start + n].flip(1)  # (B, n, H), last column first
            gate = scope.adapter[:, start : start + n].flip(1) if scope.adapter is not None else None
            with scope.adapter_as(gate):
                bwd = self.inner(hidden_states=x, cache=None, attention_mask=None).flip(1)
            weight = torch.tanh(self.gate).to(fwd.dtype) * scope.open[:, start : start + n, None].to(
                fwd.dtype
            )
            parts += [fwd[:, pos:start], fwd[:, start : start + n] + weight * bwd]  # weight (B, n, 1)
            pos = start + n
        return torch.cat(parts + [fwd[:, pos:]], dim=1)

    def _segmented(self, hidden: torch.Tensor, cache, attention_mask, **kwargs) -> torch.Tensor:
        """Scan the clean segments one after another (saving the state after each), then the open part."""
        idx = self.inner.layer_idx
        outs, saved, pos = [], [], 0
        gate = self.scope.adapter
        for n in self.scope.segments:
            if n:
                with self.scope.adapter_as(gate[:, pos : pos + n] if gate is not None else None):
                    outs.append(self.inner(hidden_states=hidden[:, pos : pos + n], cache=cache, **kwargs))
                pos += n
            saved.append(linear_state(cache, idx))
        runs = self.scope.runs or (
            [(pos, hidden.shape[1] - pos, len(saved) - 1)] if pos < hidden.shape[1] else []
        )
        for start, n, state in runs:  # each open run continues from the state at its attach point
            if start != pos:
                raise RuntimeError(f"open run at column {start} does not follow the scanned prefix ({pos})")
            set_linear_state(cache, idx, saved[state])
            with self.scope.adapter_as(gate[:, pos : pos + n] if gate is not None else None):
                outs.append(self.inner(hidden_states=hidden[:, pos : pos + n], cache=cache, **kwargs))
            pos += n
        if runs:
            set_linear_state(cache, idx, saved[-1])
        self.scope.states[idx] = saved
        return torch.cat(outs, dim=1)


def linear_state(cache, idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """A copy of one linear-attention layer's cached conv and recurrent state."""
    layer = cache.layers[idx]
    conv, rec = layer.conv_states.get(0), layer.recurrent_states.get(0)
    return (
        conv.clone() if conv is not None else None,
        rec.clone() if rec is not None else None,
        bool(layer.has_previous_state.get(0)),
    )


def set_linear_state(cache, idx: int, state: tuple[torch.Tensor | None, torch.Tensor | None, bool]) -> None:
    """Put a saved linear-attention state back (what `linear_state` returned)."""
    layer = cache.layers[idx]
    conv, rec, has_previous = state
    if conv is not None:
        layer.conv_states[0] = conv.clone()
    if rec is not None:
        layer.recurrent_states[0] = rec.clone()
    layer.has_previous_state[0] = has_previous


def open_suffix(first_open: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T) bool: True from column `first_open[b]` on (a suffix per row); first_open >= T means none."""
    cols = torch.arange(width, device=first_open.device)
    return cols[None, :] >= first_open[:, None]


def attention_masks(
    pad: torch.Tensor,
    open_: torch.Tensor,
    mode: str,
    dtype: torch.dtype,
    past: int = 0,
    hybrid: bool = False,
    past_pad: torch.Tensor | None = None,
    tree: Tree | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The attention mask of a student forward over T new tokens after `past` cached ones.

    pad (B, T) is 1 for real tokens, open_ (B, T) marks open positions. Full-attention layers get an
    additive (B, 1, T, past + T) mask: 0 where a query may attend, the dtype minimum elsewhere.
    Cached tokens are committed and visible to every query, except where `past_pad` (B, past) marks
    them as padding. Linear-attention layers of a hybrid get the 2D padding mask (None when nothing
    is padded). `tree` (block mode) replaces the new tokens' block layout with a branched one.
    """
    b, t = pad.shape
    idx = torch.arange(t, device=pad.device)
    real = pad.bool()[:, None, :]  # (B, 1, T) keys
    if mode == "bidirectional":
        if past:
            raise ValueError("bidirectional attention has no exact cache: every token sees later tokens")
        allowed = real.expand(b, t, t)
    elif mode == "block" and tree is not None:
        allowed = real & tree.allowed.to(pad.device)
    elif mode == "block":
        causal = idx[None, :] <= idx[:, None]  # (T, T) key <= query
        allowed = real & (causal[None] | open_.bool()[:, :, None])  # open queries see every real key
    else:
        raise ValueError(f"unknown attention mode {mode!r}: use block or bidirectional")
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=pad.device)[None]  # no empty rows
    if past:
        seen = past_pad.bool()[:, None, :].expand(b, t, past) if past_pad is not None else None
        seen = seen if seen is not None else torch.ones(b, t, past, dtype=torch.bool, device=pad.device)
        allowed = torch.cat([seen, allowed], dim=2)
    full = torch.zeros(b, 1, t, past + t, dtype=dtype, device=pad.device)
    full.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    if hybrid:
        return {"full_attention": full, "linear_attention": None if bool(pad.all()) else pad}
    return full


def position_ids(pad: torch.Tensor, past: int | torch.Tensor = 0) -> torch.Tensor:
    """Positions that skip left padding: a row's first new real token is at `past` (an int, or (B, 1)
    real tokens already cached per row). (B, T) long."""
    return (pad.long().cumsum(-1) - 1).clamp(min=0) + past
