"""The decode canvas: the committed sequence and the exact cache of the student's base over it.

Invariant: the cache holds every committed token but the newest one. A forward feeds the committed
tokens the cache does not hold yet (at least the newest: its state predicts the next position),
then optional clean candidates (drafts to verify), then the open region (mask tokens or VFM noise
vectors). Every fed clean position computes the base model exactly (`adapter_scope: masked`,
causal prefix), so after the forward the cache keeps the clean tokens the caller accepted: their
keys, values and Gated DeltaNet states are the base model's own, and each committed token enters
the cache once. The open region never enters the cache.

`cached=False` feeds the whole sequence every time with no cache (the reference the cached path
is tested against, and the baseline of the cache benchmark); both return the same hidden states
for the fed positions.
"""

from __future__ import annotations

import torch

from a2d.models.attention import Tree, set_linear_state
from a2d.models.student import Student, student_forward


def new_cache(model: torch.nn.Module):
    """An empty transformers cache for `model` (attention KV, and conv/recurrent states for hybrids)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Re-index the cache's batch dimension (rows may repeat: one prefix serves several views)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            layer.keys, layer.values = keys[rows], layer.values[rows]
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for i, state in (states or {}).items():
                if state is not None:
                    states[i] = state[rows]


class _ReadCopies(dict):
    """A state dict whose reads return copies: a layer's in-place state update writes into a copy."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return value.clone() if isinstance(value, torch.Tensor) else value


def freeze_linear_states(cache) -> None:
    """Make the cached Gated DeltaNet states read-only for a forward with grad: the layers write their
    updated state in place into the tensor they read (autograd saved it), so every read gets a copy.
    Training uses this: the prefix's cache is computed once without grad and only read after."""
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict) and not isinstance(states, _ReadCopies):
                setattr(layer, name, _ReadCopies(states))


def truncate_attention(cache, length: int) -> None:
    """Keep the first `length` positions of every attention layer's keys and values."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            layer.keys = keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def tree_layout(n_fed: int, parents: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """What each of `n_fed` new tokens sees of the others (n_fed, n_fed) and their positions from the
    first (n_fed,), when the last len(parents) are tree candidates: candidate i continues candidate
    `parents[i]` (-1: the last token before them), sits at the next position after it and sees the
    tokens before the candidates, its ancestors and itself; the tokens before them are causal."""
    first = n_fed - len(parents)  # column of the first candidate
    allowed = torch.ones(n_fed, n_fed, device=device).tril().bool()
    positions = torch.arange(n_fed, device=device)
    allowed[first:, first:] = False
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: parents must come first")
        col = first + i
        allowed[col, col] = True
        if parent >= 0:
            allowed[col] |= allowed[first + parent]
            positions[col] = positions[first + parent] + 1
        else:
            positions[col] = first
    return allowed, positions


class Canvas:
    """One prompt being decoded: committed tokens, the cache over all but the newest, forwards run."""

    def __init__(self, student: Student, prompt: list[int], cached: bool = True):
        if not prompt:
            raise ValueError("decoding needs a non-empty prompt")
        if cached and student.attention != "block":
            raise ValueError("an exact cache needs attention: block (bidirectional heads see later tokens)")
        self.student = student
        self.tokens = list(prompt)
        self.cached = cached
        self.cache = new_cache(student.inner) if cached else None
        self.in_cache = 0  # leading committed tokens the cache holds
        self.forwards = 0
        self.device = next(p for p in student.model.parameters()).device
        self._fed: tuple[int, int] = (0, 0)  # (pending, clean) of the last forward
        self._states: dict[int, list] = {}  # its linear-attention states after each clean segment

    @property
    def pending(self) -> list[int]:
        """Committed tokens the cache does not hold yet (always at least the newest one)."""
        return self.tokens[self.in_cache :]

    def forward(
        self,
        clean: list[int],
        region: list[int] | torch.Tensor,
        branches: list[tuple[int, int]] | None = None,
        student: Student | None = None,
        parents: list[int] | None = None,
    ) -> torch.Tensor:
        """Run pending + clean + region; hidden states (len(pending) + len(clean) + len(region), H).

        `region` is token ids (masks and committed-out-of-order tokens), or input embeddings (n, H).
        `branches` splits the region into open runs `(attach, length)`, in order: a run sits right
        after the first `attach` clean candidates, at their next positions, and sees the prefix up to
        there and itself, not the clean candidates after `attach` nor the other runs (tree
        attention: one forward drafts for every acceptance length of the candidates it verifies).
        Default: one run after every clean candidate, the decode state training trains on.
        `student` runs the forward instead of the canvas's own (a flow map with other adapter
        weights over the same base: the cache is the base's, so both read and extend it).
        `parents` lays the clean candidates out as a tree (no open region): candidate i continues
        candidate `parents[i]` (-1: the newest committed token), sits at the next position after it
        and sees the committed tokens, its ancestors and itself. One forward verifies every path;
        `keep_path` then keeps the accepted one. Attention-only models (a recurrent state has no
        branches).
        """
        student = student or self.student
        pending = self.pending
        embeds = isinstance(region, torch.Tensor)
        n_region = region.shape[0] if embeds else len(region)
        fed_ids = pending + list(clean)
        context = self.tokens[: self.in_cache] if not self.cached else []
        if parents is not None:
            if n_region:
                raise ValueError("a tree of clean candidates takes no open region")
            tree = self._clean_tree(len(context) + len(fed_ids), parents)
        else:
            tree = self._tree(len(context) + len(fed_ids), len(clean), n_region, branches)
        ids = torch.tensor([context + fed_ids + ([] if embeds else list(region))], device=self.device)
        width = ids.shape[1] + (n_region if embeds else 0)
        pad = torch.ones((1, width), dtype=torch.long, device=self.device)
        open_ = torch.zeros((1, width), dtype=torch.bool, device=self.device)
        open_[0, width - n_region :] = True
        inputs_embeds = None
        if embeds:
            emb = student.inner.get_input_embeddings()(ids)  # clean part: the base's own embeddings
            inputs_embeds = torch.cat([emb, region[None].to(emb.dtype)], dim=1)
            ids = None
        segments = [len(pending) - 1, 1, *([1] * len(clean))]  # boundaries a caller may keep
        hidden = student_forward(
            student,
            ids,
            pad,
            open_,
            cache=self.cache,
            inputs_embeds=inputs_embeds,
            segments=segments,
            tree=tree,
        )
        self.forwards += 1
        self._fed = (len(pending), len(clean))
        self._states = student.scope.states  # this forward's rollback points (the next forward replaces them)
        return hidden[0, len(context) :]

    def _tree(self, n_clean_fed: int, n_clean: int, n_region: int, branches) -> Tree | None:
        """The tree-attention layout of a branched region (None for the default single run)."""
        if branches is None or [tuple(b) for b in branches] == [(n_clean, n_region)]:
            return None
        if sum(n for _, n in branches) != n_region or any(not 0 <= a <= n_clean for a, _ in branches):
            raise ValueError(
                f"branches {branches} do not split a region of {n_region} after {n_clean} candidates"
            )
        if self.student.hybrid and not self.cached:
            raise ValueError(
                "branched regions on a hybrid need the cache (each run scans from its own state)"
            )
        t = n_clean_fed + n_region
        first_clean = n_clean_fed - n_clean  # column of the first clean candidate
        allowed = torch.ones(t, t, device=self.device).tril().bool()  # clean columns: causal
        positions = torch.arange(t, device=self.device)
        runs, col = [], n_clean_fed
        for attach, n in branches:
            allowed[col : col + n] = False
            allowed[col : col + n, : first_clean + attach] = True  # the prefix up to the attach point
            allowed[col : col + n, col : col + n] = True  # its own run, both ways
            positions[col : col + n] = first_clean + attach + torch.arange(n, device=self.device)
            runs.append((col, n, 1 + attach))  # linear-attention state after the attach point
            col += n
        return Tree(allowed[None], positions[None], runs)

    def _clean_tree(self, n_fed: int, parents: list[int]) -> Tree:
        """Tree attention over clean candidates: each sees the fed prefix, its ancestors and itself."""
        if self.student.hybrid:
            raise ValueError(
                "a tree of drafts needs an attention-only base (a recurrent state has no branches)"
            )
        allowed, positions = tree_layout(n_fed, parents, self.device)
        return Tree(allowed[None], positions[None], [])

    def keep_path(self, path: list[int]) -> None:
        """After a tree forward: the cache keeps the fed pending tokens and the candidates on `path`
        (indices into the clean candidates, root to leaf). A chain's prefix is `keep(len(path))`."""
        if path == list(range(len(path))):
            return self.keep(len(path))
        n_pending, n_clean = self._fed
        if self.student.hybrid or any(not 0 <= i < n_clean for i in path):
            raise ValueError(f"keep path {path} of {n_clean} tree candidates on this base")
        if self.cached:
            start = self.in_cache + n_pending
            rows = torch.tensor(list(range(start)) + [start + i for i in path], device=self.device)
            for layer in self.cache.layers:
                keys = getattr(layer, "keys", None)
                if isinstance(keys, torch.Tensor) and keys.dim() == 4:
                    layer.keys = keys.index_select(2, rows)
                    layer.values = layer.values.index_select(2, rows)
        self.in_cache += n_pending + len(path)

    def keep(self, clean_kept: int) -> None:
        """After a forward: the cache keeps the fed pending tokens but the newest (clean_kept = -1),
        or all of them and the first `clean_kept` clean candidates. The open region is dropped."""
        n_pending, n_clean = self._fed
        if not -1 <= clean_kept <= n_clean:
            raise ValueError(f"keep {clean_kept} of {n_clean} clean tokens")
        keep = n_pending + clean_kept  # fed tokens that stay cached
        if self.cached:
            truncate_attention(self.cache, self.in_cache + keep)
            for idx, saved in self._states.items():
                set_linear_state(self.cache, idx, saved[clean_kept + 1])
        self.in_cache += keep

    def commit(self, tokens: list[int]) -> None:
        """Append committed tokens (they are fed, and cached, by later forwards)."""
        self.tokens.extend(int(t) for t in tokens)
