"""`spec:drafter+lookup`: the DFlash drafter's tree and n-gram lookup in one tree, fed as far as it pays.

Per verify forward the candidates are the drafter's best-first tree (each node scored by the
product of the drafter's probabilities along its path) and the n-gram lookup continuation (a chain,
merged into the tree where it agrees with it). Each node gets an estimated chance of landing:

- a drafter node: its path probability times a calibration factor, the drafter's landed drafts
  over the ones it predicted on its top path in recent rounds;
- a lookup node at depth d: the product of lookup's measured rates of "draft d held, given draft
  d-1 did" in this decode (a prior of 1/2 each);

both measured every round against what the verify committed, fed or not. The forward is fed the k
most likely nodes, with k chosen to maximise expected tokens per forward cost,
(1 + sum of the k chances) / cost(1 + k), where cost(n) is the measured time of a verify forward
fed n tokens over a one-token forward on this device. When the drafter's recent drafts fail, its
chances fall and fewer nodes are fed, down to a lone lookup draft or none: a forward with no drafts
is a one-token step (on the lean canvas, AR's own cost).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable

import torch

from a2d.models.canvas import Canvas
from a2d.models.dflash_drafter import DFlashDrafter
from a2d.models.lean_canvas import lean_canvas
from a2d.models.proposals import ngram_drafts
from a2d.models.speculative import Proposal
from a2d.models.student import Student

COST_SIZES = (1, 2, 3, 5, 9, 17)  # fed tokens at which a verify forward's cost is timed
DECAY = 0.9  # per-round decay of the drafter's calibration counts (recent rounds weigh most)
MIN_GAIN = 0.1  # drafts the drafter's top path lands per round (decayed mean) below which it rests
PROBE_EVERY = 8  # a resting drafter still drafts every 8th round, to see whether it recovers
GAIN_DECAY = 0.7  # the landed-per-round mean forgets fast: 5 failed rounds from its prior rest the drafter
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _timed(canvas, n: int, reps: int) -> float:
    """Median seconds of a forward fed n tokens (the newest and n - 1 drafts), the cache left as it was."""
    drafts = canvas.tokens[1:n]  # any tokens: the cost does not depend on their values
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        canvas.forward(drafts, [])
        times.append(time.perf_counter() - start)
        canvas.keep(-1)  # back to the context but its newest token
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def forward_cost(student: Student, budget_s: float = 1.5) -> Callable[[int], float]:
    """cost(n): the median time of a verify forward fed n tokens (the newest and n - 1 drafts) over
    a 64-token context, divided by a one-token forward's; measured once per verifier model on the
    canvas a decode would use (about `budget_s` of forwards, 1 to 5 per size), linear between the
    timed sizes and past the last."""
    model = student.model
    if model not in _COSTS:
        context = list(range(2, 66))
        canvas = lean_canvas(student, context, 64 + max(COST_SIZES) + 2) or Canvas(student, context)
        canvas.forward([], [])
        canvas.keep(-1)
        single = _timed(canvas, max(COST_SIZES), 1)  # warm-up, and what one costs at most
        reps = max(1, min(5, int(budget_s / (single * len(COST_SIZES)))))
        timed = [_timed(canvas, n, reps) for n in COST_SIZES]
        _COSTS[model] = [t / timed[0] for t in timed]
    table = _COSTS[model]

    def cost(n: int) -> float:
        points = list(zip(COST_SIZES, table, strict=True))
        for (a, ca), (b, cb) in zip(points, points[1:], strict=False):
            if n <= b:
                return ca + (cb - ca) * (n - a) / (b - a)
        (a, ca), (b, cb) = points[-2:]
        return cb + (cb - ca) * (n - b) / (b - a)

    return cost


def held_prefix(draft: list[int], committed: list[int]) -> tuple[int, int]:
    """(drafts that equal the committed tokens from the start, drafts that could be checked)."""
    checked = min(len(draft), len(committed))
    n = 0
    while n < checked and draft[n] == committed[n]:
        n += 1
    return n, min(checked, n + 1)


class DrafterLookup(DFlashDrafter):
    """The drafter's tree and n-gram lookup merged; what a forward is fed follows measured acceptance."""

    def __init__(
        self,
        student: Student,
        drafter: torch.nn.Module,
        cost: Callable[[int], float],
        max_nodes: int,
        max_ngram: int = 3,
        lookup_len: int = 8,
    ):
        super().__init__(student, drafter, max_nodes)
        self.max_nodes, self.cost = max_nodes, cost
        self.max_ngram, self.lookup_len = max_ngram, lookup_len
        self.landed, self.predicted = 2.0, 2.0  # the drafter's calibration counts (a prior of 1)
        self.gain, self.rested = 0.5, 0  # its top path's landed drafts per round (decayed), rounds rested
        self.look_held = [1.0] * lookup_len  # lookup draft d held, given d - 1 did (prior 1/2)
        self.look_reached = [2.0] * lookup_len
        self._last: tuple[list[int], list[float], list[int]] = ([], [], [])  # drafter top path, its p, lookup
        self._mark = 0  # committed tokens when the last proposal was made
        self.fed: list[int] = []  # nodes proposed per drafting round (0: a one-token forward)

    def start(self, canvas) -> Proposal:
        self._mark = len(canvas.tokens)
        look = ngram_drafts(canvas.tokens, self.max_ngram, self.lookup_len)
        self._last = ([], [], look)
        return self._lookup_only(look)

    def _lookup_only(self, look: list[int]) -> Proposal:
        """The lookup chain alone, as far as it pays (a chain without parents on a hybrid)."""
        proposal, _ = self._choose([], look)
        return proposal if self.nodes > 0 else Proposal(proposal.tokens)

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        self._learn(canvas.tokens[self._mark :])
        self._mark = len(canvas.tokens)
        look = ngram_drafts(canvas.tokens, self.max_ngram, min(self.lookup_len, remaining - 1))
        if remaining < 2:
            self._last = ([], [], [])
            return Proposal()
        if self.gain < MIN_GAIN and self.rested < PROBE_EVERY - 1:  # failing lately: lookup alone
            self.rested += 1
            self._last = ([], [], look)
            proposal = self._lookup_only(look)
            self.fed.append(len(proposal.tokens))
            return proposal
        self.rested = 0
        started = time.perf_counter()
        logits = self.draft_logits(canvas, remaining)
        tokens, parents, scores = self._tree_nodes(logits, self.max_nodes)
        top, top_p, at = [], [], -1  # the drafter's own best path (each node's first child), to calibrate it
        for i, parent in enumerate(parents):
            if parent == at:
                top.append(tokens[i])
                top_p.append(math.exp(scores[i]))
                at = i
        self._last = (top, top_p, look)
        if self.nodes > 0:
            nodes = [(t, p, math.exp(sc)) for t, p, sc in zip(tokens, parents, scores, strict=True)]
            proposal, _ = self._choose(nodes, look)
        else:  # a hybrid verifies a chain: the drafter's best path or the lookup chain, the better
            path = [(t, i - 1, p) for i, (t, p) in enumerate(zip(top, top_p, strict=True))]
            chain, _ = max(self._choose(path, []), self._choose([], look), key=lambda c: c[1])
            proposal = Proposal(chain.tokens)
        self.fed.append(len(proposal.tokens))
        self.seconds += time.perf_counter() - started
        return proposal

    def _learn(self, committed: list[int]) -> None:
        """Score the last round's candidates against what the verify committed (fed or not)."""
        top, top_p, look = self._last
        if top:
            held, _ = held_prefix(top, committed)
            self.landed = DECAY * self.landed + held
            self.gain = GAIN_DECAY * self.gain + (1 - GAIN_DECAY) * held
            self.predicted = DECAY * self.predicted + sum(top_p[: len(committed)])
        held, checked = held_prefix(look, committed)
        for d in range(checked):
            self.look_reached[d] += 1
            self.look_held[d] += d < held

    def _choose(self, nodes: list[tuple[int, int, float]], look: list[int]) -> tuple[Proposal, float]:
        """The k most likely of the drafter's nodes (token, parent, path p) and the lookup chain,
        k maximising (1 + expected landed drafts) / cost(1 + k); and that value."""
        calib = self.landed / max(self.predicted, 1e-6)
        tokens = [t for t, _, _ in nodes]
        parents = [p for _, p, _ in nodes]
        chance = [min(1.0, calib * p) for _, _, p in nodes]
        child = {(p, t): i for i, (t, p, _) in enumerate(nodes)}
        at, p_look = -1, 1.0
        for d, t in enumerate(look):
            p_look *= self.look_held[d] / self.look_reached[d]
            i = child.get((at, t))
            if i is None:
                i = len(tokens)
                tokens.append(t)
                parents.append(at)
                chance.append(p_look)
                child[(at, t)] = i
            else:
                chance[i] = max(chance[i], p_look)
            at = i
        # a child's chance never exceeds its parent's, so the best k nodes (ties: the earlier) form a tree
        order = sorted(range(len(tokens)), key=lambda i: (-chance[i], i))[: self.max_nodes]
        best_k, best, gain = 0, 1.0 / self.cost(1), 1.0
        for k, i in enumerate(order, start=1):
            gain += chance[i]
            value = gain / self.cost(1 + k)
            if value > best:
                best_k, best = k, value
        index: dict[int, int] = {-1: -1}
        for i in sorted(order[:best_k]):  # parents first
            if parents[i] in index:
                index[i] = len(index) - 1
        kept = [i for i in index if i >= 0]
        return Proposal([tokens[i] for i in kept], parents=[index[parents[i]] for i in kept]), best
