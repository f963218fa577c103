"""`DFlashDrafter`: the DFlash block-diffusion drafter as a speculative proposal. Hooks in the verify
forward capture the drafter's target layers (`a2d.models.drafter.DFlashDraftModel` reads them); one
drafter forward drafts a block, as a chain or, on an attention-only base, a tree."""

from __future__ import annotations

import contextlib
import heapq
import time

import torch

from a2d.models.capture import capture_layers
from a2d.models.lean_canvas import LeanCanvas
from a2d.models.objectives.drafter import draft_head, draft_tokens
from a2d.models.speculative import Drafter, Proposal
from a2d.models.student import Student, lm_head


class DFlashDrafter(Drafter):
    """A DFlash drafter: the verify forward's outputs of the drafter's target layers (forward hooks,
    the same forward) become its context; one drafter forward drafts a block from
    `[newest committed token, MASK x (L-1)]`.

    With `nodes` > 0 (an attention-only base) the block's per-offset distributions propose a tree of
    that many drafts instead of one chain: best-first over paths by the product of the drafter's
    probabilities along them (its second guess at offset 1 may beat its first at offset 3), every
    path verified by the same forward (tree attention), the accepted one kept in the cache.

    Only committed rows enter the drafter's context (keys/values per draft layer, appended after
    each verify), so a rejected draft leaves nothing to roll back there; the verifier's own cache
    (attention truncated or gathered, recurrent state restored) is the canvas's. `seconds` is the
    time spent in the drafter's own forwards (its cost next to the verify forwards').
    """

    def __init__(self, student: Student, drafter: torch.nn.Module, nodes: int = 0):
        cfg = drafter.config
        hidden = student.inner.get_input_embeddings().weight.shape[1]
        if cfg.hidden_size != hidden:
            raise ValueError(f"the drafter's hidden_size {cfg.hidden_size} is not the verifier's {hidden}")
        self.student, self.drafter = student, drafter
        self.nodes = 0 if student.hybrid else nodes  # a recurrent state has no branches: a chain there
        self.layers = list(cfg.target_layer_ids)
        self.length = cfg.block_size
        self.embed = student.inner.get_input_embeddings()
        self.vocab = drafter.draft_vocab
        # the frozen head restricted to the draft vocabulary, as training computes it
        self.head_weight, self.head_bias = draft_head(lm_head(student), self.vocab)
        self._fed: dict[int, torch.Tensor] = {}  # layer -> its output rows of the last verify forward
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.context = 0  # committed tokens whose states the drafter's context holds
        self.seconds = 0.0

    def session(self, canvas) -> contextlib.AbstractContextManager:
        def keep(layer: int, hidden: torch.Tensor) -> None:
            self._fed[layer] = hidden[0]

        if isinstance(canvas, LeanCanvas):  # no module runs there: the lean forward hands them over
            canvas.taps = (self.layers, keep)
            return contextlib.nullcontext()
        return capture_layers(self.student.inner, self.layers, keep)

    def observe(self, committed: torch.Tensor, rows: list[int]) -> None:
        n = len(rows)
        started = time.perf_counter()
        chain = rows[-1] == n - 1  # the first n rows (no tree branch skipped)
        index = None if chain else torch.tensor(rows, device=committed.device)
        features = torch.cat(
            [self._fed[layer][:n] if chain else self._fed[layer][index] for layer in self.layers], -1
        )[None]  # (1, n, K*H)
        positions = torch.arange(self.context, self.context + n, device=features.device)[None]
        kv = self.drafter.context_kv(self.drafter.fuse(features), positions)
        if self._kv is None:
            self._kv = kv
        else:
            self._kv = [
                (torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                for (k0, v0), (k, v) in zip(self._kv, kv, strict=True)
            ]
        self.context += n
        self.seconds += time.perf_counter() - started

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        if remaining < 2:
            return Proposal()
        started = time.perf_counter()
        logits = self.draft_logits(canvas, remaining)
        if self.nodes > 0:
            proposal = self._tree(logits)
        else:
            best = logits.argmax(-1)
            proposal = Proposal(draft_tokens(self.vocab, best).tolist())
        self.seconds += time.perf_counter() - started
        return proposal

    def draft_logits(self, canvas, remaining: int) -> torch.Tensor:
        """One drafter forward (counted) over `[newest token, MASK x (L-1)]`: the draft head's logits
        (D, V') of the offsets 1..D, D <= min(L - 1, remaining - 1)."""
        length = self.length  # the whole block, as in training; drafts past the budget are dropped
        if self.context != len(canvas.tokens) - 1:
            raise AssertionError(
                f"drafter context {self.context} != committed tokens {len(canvas.tokens) - 1} - 1"
            )
        ids = torch.full((1, length), self.drafter.config.mask_token_id, device=self.head_weight.device)
        ids[0, 0] = canvas.tokens[-1]
        positions = torch.arange(self.context, self.context + length, device=ids.device)[None]
        states = self.drafter(self.embed(ids), positions, self._kv)[0, 1:remaining]  # (D, H), D <= L - 1
        self.forwards += 1
        return torch.nn.functional.linear(states.to(self.head_weight.dtype), self.head_weight, self.head_bias)

    def _tree(self, logits: torch.Tensor) -> Proposal:
        """The `nodes` most probable paths' nodes (best-first, parents before children)."""
        tokens, parents, _ = self._tree_nodes(logits, self.nodes)
        return Proposal(tokens, parents=parents)

    def _tree_nodes(self, logits: torch.Tensor, nodes: int) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, path log-probabilities) of the `nodes` most probable paths' nodes."""
        logp = torch.log_softmax(logits.float(), -1)  # (D, V')
        top = logp.topk(min(nodes, logp.shape[-1]), -1)
        score, rank = top.values.tolist(), top.indices
        tokens_at = draft_tokens(self.vocab, rank).tolist()
        depth, width = len(score), len(score[0])
        # a node is (depth d, rank r at d, parent): its children are ranks 0.. at d + 1 under it;
        # popping a node pushes its next sibling and its first child, so nodes come out best-first
        heap = [(-score[0][0], 0, 0, -1)]
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        while heap and len(tokens) < nodes:
            neg, d, r, parent = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(tokens_at[d][r])
            parents.append(parent)
            scores.append(-neg)
            base = neg + score[d][r]  # the parent's (negated) score
            if r + 1 < width:
                heapq.heappush(heap, (base - score[d][r + 1], d, r + 1, parent))
            if d + 1 < depth:
                heapq.heappush(heap, (neg - score[d + 1][0], d + 1, 0, node))
        return tokens, parents, scores


# The proposal was `DFlashDraft` while the network was `DFlashDrafter`; the network is now
# `DFlashDraftModel`, the architecture name its checkpoints are saved under.
DFlashDraft = DFlashDrafter
