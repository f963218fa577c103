"""The decode canvas of a plain llama-family verifier, over `LeanStep`'s preallocated K/V buffers.

`Canvas` runs every verify forward through transformers' modules; on a 2-core CPU their structure
costs ~20 ms a forward of a 30-layer model whatever it is fed, and building a 4D mask for n > 1
tokens costs more. `LeanCanvas` is the same canvas (same invariant: the buffers hold every
committed token but the newest; a forward feeds the pending committed tokens, then clean
candidates as a chain or a tree) with the layers written as tensor ops over buffers made once per
decode. A forward with no drafts costs what `ar_decode`'s lean step costs, so a speculative decoder
whose drafts are not worth feeding is as fast as AR, not slower.

It takes drafters that feed no open region (n-gram lookup, the DFlash drafter, an external model):
a region of masks needs the head's adapters, which run in the library forward. Layer outputs a
drafter reads are handed to `taps` during the forward (the hooks of `capture_layers` do not fire:
no module is called). The hidden states it returns are final-normed, as `Canvas.forward`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from a2d.models.ar import LeanState, LeanStep, lean_step
from a2d.models.canvas import tree_layout
from a2d.models.student import Student

Taps = tuple[list[int], Callable[[int, torch.Tensor], None]]  # (layers, on_layer(i, (1, n, H)))


def lean_forward(
    lean: LeanStep,
    state: LeanState,
    tokens: list[int],
    positions: torch.Tensor,
    allowed: torch.Tensor | None,
    taps: Taps | None = None,
) -> torch.Tensor:
    """Feed `tokens` into buffer slots state.pos.. at RoPE `positions` (n,); `allowed` (n, n) is what
    each new token sees of the new ones (None: causal); every slot before state.pos is seen. Final-norm
    hidden states (n, H). state.pos is not moved: the caller keeps what was accepted."""
    heads, kv, dim, half, pos, n = lean.heads, lean.kv_heads, lean.head_dim, lean.half, state.pos, len(tokens)
    if pos + n > state.cos.shape[0]:
        raise ValueError(f"{n} tokens at position {pos} overflow buffers of {state.cos.shape[0]} positions")
    cos, sin = state.cos[positions], state.sin[positions]  # (n, dim)
    mask = None
    if n > 1:  # (n, pos + n): the committed slots, then the new tokens' own layout
        mask = torch.ones(n, pos + n, dtype=torch.bool, device=cos.device)
        mask[:, pos:] = allowed if allowed is not None else torch.ones(n, n, dtype=torch.bool).tril()
    wanted = set(taps[0]) if taps else ()
    h = lean.inner.embed_tokens.weight[torch.tensor(tokens, device=cos.device)][None]  # (1, n, H)
    for i, (w1, eps1, q, k, v, o, qk_norm, w2, eps2, gate, up, down) in enumerate(lean.layers):
        x = w1 * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps1))
        qs = q(x).view(n, heads, dim).transpose(0, 1)  # (heads, n, dim)
        ks = k(x).view(n, kv, dim).transpose(0, 1)
        if qk_norm is not None:
            wq, wk, eps = qk_norm
            qs = wq * (qs * torch.rsqrt(qs.pow(2).mean(-1, keepdim=True) + eps))
            ks = wk * (ks * torch.rsqrt(ks.pow(2).mean(-1, keepdim=True) + eps))
        qk = torch.cat((qs, ks))  # (heads + kv, n, dim)
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
        keys, values = state.keys[i], state.values[i]
        keys[0, :, pos : pos + n] = qk[heads:]
        values[0, :, pos : pos + n] = v(x).view(n, kv, dim).transpose(0, 1)
        a = F.scaled_dot_product_attention(
            qk[None, :heads],
            keys[:, :, : pos + n],
            values[:, :, : pos + n],
            attn_mask=mask,
            enable_gqa=heads != kv,
        )  # (1, heads, n, dim)
        h = h + o(a.transpose(1, 2).reshape(1, n, heads * dim))
        x = w2 * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps2))
        h = h + down(F.silu(gate(x)) * up(x))
        if i in wanted:
            taps[1](i, h)
    w, eps = lean.norm
    return (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)))[0]


class LeanCanvas:
    """`Canvas`'s interface (forward, keep_path, keep, commit, tokens, forwards) for a plain
    llama-family verifier on the CPU; `capacity` bounds the positions one decode may fill."""

    def __init__(self, student: Student, lean: LeanStep, prompt: list[int], capacity: int):
        if not prompt:
            raise ValueError("decoding needs a non-empty prompt")
        self.student, self.lean = student, lean
        self.tokens = list(prompt)
        self.state = lean.empty(capacity)
        self.forwards = 0
        self.taps: Taps | None = None
        self._fed = (0, 0)

    @property
    def in_cache(self) -> int:
        return self.state.pos

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.state.pos :]

    def forward(self, clean: list[int], region, branches=None, student=None, parents=None) -> torch.Tensor:
        """Run pending + clean (a chain, or a tree by `parents`); hidden states (pending + clean, H)."""
        if len(region) or branches or student is not None:
            raise ValueError("a lean canvas feeds no open region: use Canvas for drafters with masks")
        pending, pos = self.pending, self.state.pos
        fed, n_p = pending + list(clean), len(pending)
        positions, allowed = torch.arange(pos, pos + len(fed)), None
        if parents is not None:
            allowed, rel = tree_layout(len(fed), parents)
            positions = rel + pos
        hidden = lean_forward(self.lean, self.state, fed, positions, allowed, self.taps)
        self.forwards += 1
        self._fed = (n_p, len(clean))
        return hidden

    def keep_path(self, path: list[int]) -> None:
        """Keep the fed pending tokens and the candidates on `path` (root to leaf), moved into place."""
        n_p, n_clean = self._fed
        if any(not 0 <= i < n_clean for i in path):
            raise ValueError(f"keep path {path} of {n_clean} candidates")
        start = self.state.pos + n_p
        if path != list(range(len(path))):
            src = torch.tensor([start + i for i in path])
            for buf in (*self.state.keys, *self.state.values):
                buf[:, :, start : start + len(path)] = buf[:, :, src]
        self.state.pos = start + len(path)

    def keep(self, clean_kept: int) -> None:
        n_p, n_clean = self._fed
        if not -1 <= clean_kept <= n_clean:
            raise ValueError(f"keep {clean_kept} of {n_clean} clean tokens")
        self.state.pos += n_p + clean_kept

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)


def lean_canvas(student: Student, prompt: list[int], capacity: int) -> LeanCanvas | None:
    """A lean canvas where the verifier is a plain llama-family CPU model with no adapter, else None."""
    if student.mask is not None or student.hybrid or student.model.training:
        return None
    lean = lean_step(student.model)
    return None if lean is None else LeanCanvas(student, lean, prompt, capacity)
