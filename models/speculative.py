"""Lossless speculative decoding: one loop verifies any `Drafter` with the student's base model.

Each verify forward feeds, on the exact prefix cache of `a2d.models.canvas`,

    [pending committed tokens (at least the newest), drafts d_1..d_k, the drafter's open region]

The clean positions are the base model exactly (`adapter_scope: masked`), so their logits verify the
drafts: greedy keeps the longest prefix equal to the base's argmax plus the base's own next token;
temperature > 0 keeps draft i with probability min(1, p_i/q_i) and draws the next token from the
residual (Leviathan et al. 2023). Either way the output is the base model's, token for token (greedy)
or in distribution (sampling). The mask row never gets mass: the base's verify logits drop it.

Drafters (what proposes d_1..d_k and what it costs):
- `HeadDrafter`: the head's masks. The open region holds one run of masks *per acceptance length*
  (tree attention: run a sits after d_a and sees the prefix up to there), so whatever the verify
  accepts, the run behind the accepted prefix has already drafted the next tokens: no forward goes
  without drafts after the first. Costs no forward of its own (it rides in the verify forward).
- `LookupDrafter`: n-gram lookup in the prompt and output (prompt-lookup decoding); no forward.
- `HeadLookupDrafter`: both; per forward the lookup continuation wins where it agrees with the
  head's first draft (it extends it), else the head's.
- `VFMDrafter`: the VFM's one-step block, conditioned on the verifier's own states (no re-encoded
  prompt); its flow-map forward is counted, and the base's next token it computes on a clean row
  lands directly (it is exact), so accepted drafts count only what the VFM drafted.
- `ModelDrafter`: an external causal LM drafting greedily with its own cache; its forwards count.
- `DFlashDrafter`: a block-diffusion drafter (`a2d.models.drafter`) reading the verifier's own layer
  outputs, captured by hooks in the verify forward; one drafter forward per block, counted.

Counts (`Decoded`): `forwards` is every model call (verify, flow-map and drafter forwards);
`drafted[i]` / `accepted[i]` are the drafts fed to verify forward i and how many of them held.
"""

from __future__ import annotations

import contextlib
import heapq
import time

import torch

from a2d.models.block_decode import Decoded, OnStep, cut_at_eos
from a2d.models.canvas import Canvas, truncate_attention
from a2d.models.capture import capture_layers
from a2d.models.lean_canvas import LeanCanvas, lean_canvas
from a2d.models.objectives.drafter import draft_head, draft_tokens
from a2d.models.student import Student, lm_head

Runs = list[tuple[int, int]]  # (attach, length) per open run, see Canvas.forward


class Proposal:
    """Drafts for the next verify forward (and the distributions they were drawn from, sampling)."""

    def __init__(
        self,
        tokens: list[int] | None = None,
        q: torch.Tensor | None = None,
        landed=None,
        parents: list[int] | None = None,
    ):
        self.tokens = list(tokens or [])
        self.q = q  # (k, V) or None
        self.landed = list(landed or [])  # base tokens a drafter's own clean forward computed (exact)
        # a tree: draft i continues draft parents[i] (-1: the newest committed token); None: a chain
        self.parents = parents


class Drafter:
    """Proposes the next tokens from the context and what the last verify forward computed."""

    samples = False  # gives draft distributions, so it can serve temperature > 0
    forwards = 0  # forwards it ran itself, beyond the verify forwards
    feeds_region = False  # feeds an open region (masks, noise) after its drafts: the library forward

    def start(self, canvas: Canvas) -> Proposal:
        """Drafts for the first forward (from the prompt alone)."""
        return Proposal()

    def session(self, canvas) -> contextlib.AbstractContextManager:
        """Held around one prompt's whole decode (e.g. hooks on the verifier)."""
        return contextlib.nullcontext()

    def region(self, n_drafts: int, remaining: int) -> tuple[list[int], Runs | None]:
        """The open region fed after `n_drafts` drafts when `remaining` tokens may still land."""
        return [], None

    def observe(self, committed: torch.Tensor, rows: list[int]) -> None:
        """The base's final states (n, H) of the tokens the verify forward just committed to the
        cache, and which rows of that forward they were (pending tokens, then the accepted drafts)."""

    def propose(
        self, canvas: Canvas, accepted: int, region: torch.Tensor, remaining: int, sampling
    ) -> Proposal:
        """Drafts for the next forward: `accepted` drafts held, `region` (n, H) the open rows'
        states of the forward just run, `remaining` tokens may still land after this one."""
        raise NotImplementedError


class HeadDrafter(Drafter):
    """The head's masks, one run per acceptance length, `masks` per run (trimmed to the budget)."""

    samples = True
    feeds_region = True

    def __init__(self, student: Student, masks: int):
        if student.attention != "block" or not student.scope.masked:
            raise ValueError(
                "the head drafts in the verify forward only with attention: block, adapter_scope: masked"
            )
        self.student, self.masks = student, max(1, min(masks, student.block_size))
        self._runs: dict[int, tuple[int, int]] = {}  # attach -> (first row in the region, length)

    def region(self, n_drafts: int, remaining: int) -> tuple[list[int], Runs | None]:
        runs, self._runs, row = [], {}, 0
        for attach in range(n_drafts + 1):
            # after `attach` drafts and the correction land, the next forward lands at most
            # remaining - attach - 1 tokens, one of them its own correction
            n = min(self.masks, remaining - attach - 2)
            if n > 0:
                runs.append((attach, n))
                self._runs[attach] = (row, n)
                row += n
        return [self.student.info.mask_id] * row, runs or None

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        if accepted not in self._runs:
            return Proposal()
        row, n = self._runs[accepted]
        logits = lm_head(self.student)(region[row : row + n]).float()  # (n, V)
        logits[:, self.student.info.mask_id] = float("-inf")  # a draft is never the mask token
        if sampling is None:
            return Proposal(logits.argmax(-1).tolist())
        temperature, generator = sampling
        q = torch.softmax(logits / temperature, -1)
        return Proposal(torch.multinomial(q, 1, generator=generator).flatten().tolist(), q)


def ngram_drafts(context: list[int], max_ngram: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the context's last n
    tokens, for the longest n <= max_ngram that occurred; [] where none did."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + count]
    return []


class LookupDrafter(Drafter):
    """Prompt-lookup drafting: what followed the longest recent n-gram (n <= `max_ngram`), `draft_len` tokens."""

    def __init__(self, max_ngram: int, draft_len: int):
        self.max_ngram, self.draft_len = max_ngram, draft_len

    def start(self, canvas: Canvas) -> Proposal:
        return Proposal(ngram_drafts(canvas.tokens, self.max_ngram, self.draft_len))

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        return Proposal(ngram_drafts(canvas.tokens, self.max_ngram, self.draft_len))


class HeadLookupDrafter(HeadDrafter):
    """The head's mask runs, and n-gram lookup: the lookup continuation wins a forward where its
    first token agrees with the head's first draft (it extends the head's guess), else the head's."""

    samples = False

    def __init__(self, student: Student, masks: int, max_ngram: int, draft_len: int):
        super().__init__(student, masks)
        self.lookup = LookupDrafter(max_ngram, draft_len)

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        head = super().propose(canvas, accepted, region, remaining, None)
        look = self.lookup.propose(canvas, accepted, region, remaining, None).tokens
        if look and (not head.tokens or look[0] == head.tokens[0]) and len(look) > len(head.tokens):
            return Proposal(look)
        return head


class ModelDrafter(Drafter):
    """An external causal LM (same tokenizer) drafting `draft_len` tokens greedily with its own KV
    cache, cropped back to the committed tokens after every verify; each of its calls counts."""

    def __init__(self, model: torch.nn.Module, draft_len: int):
        from transformers import DynamicCache

        if any(hasattr(m, "linear_attn") for m in model.modules()):
            raise ValueError("an external drafter needs an attention-only model (its cache is cropped)")
        self.model, self.draft_len = model, draft_len
        self.cache, self.cached = DynamicCache(config=model.config), 0  # tokens its cache holds
        self.device = next(model.parameters()).device

    def _draft(self, context: list[int], count: int) -> list[int]:
        if count <= 0:
            return []
        self.cached = min(self.cached, len(context) - 1)
        truncate_attention(self.cache, self.cached)
        feed, out = context[self.cached :], []
        for _ in range(count):
            ids = torch.tensor([feed], device=self.device)
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
            self.forwards += 1
            feed = [int(logits[0, -1].argmax())]
            out.append(feed[0])
        self.cached = self.cache.get_seq_length()  # context + all drafts but the last
        return out

    def start(self, canvas: Canvas) -> Proposal:
        return Proposal()

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        return Proposal(self._draft(canvas.tokens, min(self.draft_len, remaining - 1)))


class VFMDrafter(Drafter):
    """The VFM's one-step block from the verifier's committed states.

    q(z | states) reads the base's final states of the committed tokens, which the verify forwards
    already computed (each committed token is fed once). The flow-map forward feeds the newest token
    (clean: its row is the base's exact next-token prediction) and z; the base token lands at once
    and the z rows' predictions after it are the drafts.
    """

    feeds_region = True

    def __init__(self, flow_map: Student, adapter: torch.nn.Module, block: int, shifted: bool):
        if not shifted:
            raise ValueError(
                "VFM drafting needs shifted logits (the first position is the base's next token)"
            )
        self.flow_map, self.adapter = flow_map, adapter
        self.length = min(block, adapter.config["max_len"])
        self.states: list[torch.Tensor] = []  # (n, H) committed states, in order

    def observe(self, committed: torch.Tensor, rows: list[int]) -> None:
        self.states.append(committed)

    def propose(self, canvas, accepted, region, remaining, sampling) -> Proposal:
        length = min(self.length, remaining)
        if length < 2:
            return Proposal()
        states = torch.cat(self.states)[None]  # (1, N, H)
        mu, _ = self.adapter(states, torch.ones(states.shape[:2], device=states.device), length)
        z = self.adapter.embed(mu)[0, : length - 1]  # (L - 1, H): the positions after the base's token
        hidden = canvas.forward(
            [], z.to(states.dtype), student=self.flow_map
        )  # (pending + L - 1, H); counted there
        n_pending = hidden.shape[0] - z.shape[0]
        self.states.append(hidden[:n_pending])
        canvas.keep(0)  # the pending tokens enter the cache; z never does
        logits = lm_head(self.flow_map)(hidden[n_pending - 1 :]).float()  # (L, V)
        logits[:, self.flow_map.info.mask_id] = float("-inf")
        tokens = logits.argmax(-1).tolist()
        return Proposal(tokens[1:], landed=tokens[:1])


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


def accept_path(drafts: list[int], parents: list[int] | None, best: list[int]) -> list[int]:
    """Greedy verification: the drafts (indices) on the path the base's argmax follows from the
    newest token, root to leaf. `best[0]` is the base's next token after the newest committed token,
    `best[i + 1]` after draft i; a chain's parents are [-1, 0, 1, ...]."""
    path, row = [], 0  # row: the verify row whose argmax picks the next draft
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents if parents is not None else range(-1, len(drafts) - 1)):
        children.setdefault(p, []).append(i)
    at = -1
    while True:
        nxt = next((c for c in children.get(at, ()) if drafts[c] == best[row]), None)
        if nxt is None:
            return path
        path.append(nxt)
        at, row = nxt, nxt + 1


@torch.no_grad()
def speculative_decode(
    student: Student,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    drafter: Drafter,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    on_step: OnStep | None = None,
    draft_len: int = 8,
    lean: bool = True,
) -> Decoded:
    """Decode one prompt with `drafter`'s proposals verified by the student's base (see the module doc).

    `draft_len` caps the drafts per verify forward (a forward's cost grows with what it is fed).
    A plain llama-family verifier decodes on a `LeanCanvas` where the drafter feeds no open region
    (`lean=False`: the library forward, the reference).
    """
    if temperature > 0 and not drafter.samples:
        raise ValueError(f"{type(drafter).__name__} gives no draft distribution: use it with temperature 0")
    sampling = (temperature, generator) if temperature > 0 else None
    eos = set(eos_ids)
    canvas = None
    if lean and not drafter.feeds_region:
        canvas = lean_canvas(student, prompt, len(prompt) + max_new_tokens + draft_len + 2)
    canvas = canvas or Canvas(student, prompt, cached=True)
    with drafter.session(canvas):
        return _decode_loop(student, canvas, max_new_tokens, eos, drafter, sampling, on_step, draft_len)


def _decode_loop(
    student: Student,
    canvas: Canvas,
    max_new_tokens: int,
    eos: set[int],
    drafter: Drafter,
    sampling: tuple[float, torch.Generator | None] | None,
    on_step: OnStep | None,
    draft_len: int,
) -> Decoded:
    head = lm_head(student)
    temperature, generator = sampling or (0.0, None)
    out: list[int] = []
    steps: list[int] = []
    drafted: list[int] = []
    accepted: list[int] = []
    reach: list[int] = []
    draftable: list[bool] = []
    proposal = drafter.start(canvas)
    while len(out) < max_new_tokens:
        stop = False
        if proposal.landed:  # base tokens a drafter's clean row computed: exact, no verify needed
            new, stop = cut_at_eos(proposal.landed[: max_new_tokens - len(out)], eos)
            canvas.commit(new)
            out.extend(new)
            steps.extend([canvas.forwards + drafter.forwards] * len(new))
            if on_step is not None:
                on_step(out, list(range(len(out) - len(new), len(out))))
            if stop or len(out) >= max_new_tokens:
                break
        remaining = max_new_tokens - len(out)
        drafts, parents = proposal.tokens, proposal.parents
        if parents is None:
            drafts = drafts[: min(draft_len, remaining - 1)]
        else:
            drafts, parents, depth = trim_tree(drafts, parents, remaining - 1, draft_len)
        region, runs = drafter.region(len(drafts), remaining)
        hidden = canvas.forward(drafts, region, runs, parents=parents)
        n_pending = hidden.shape[0] - len(drafts) - len(region)
        verify = head(hidden[n_pending - 1 : n_pending + len(drafts)]).float()  # (k + 1, V)
        if student.info.mask_is_new:
            verify[:, student.info.mask_id] = float("-inf")  # an added row the teacher never emits
        if sampling is None:
            best = verify.argmax(-1).tolist()
            path = accept_path(drafts, parents, best)
            new = [drafts[i] for i in path] + [best[path[-1] + 1 if path else 0]]
        elif parents is not None:
            raise ValueError("a tree of drafts is verified greedily: decode it with temperature 0")
        else:
            j, correction = speculative_accept(drafts, proposal.q, verify, temperature, generator)
            path, new = list(range(j)), drafts[:j] + [correction]
        j = len(path)
        canvas.keep_path(path)
        rows = list(range(n_pending)) + [n_pending + i for i in path]
        drafter.observe(hidden[: n_pending + j] if j == 0 or path[-1] == j - 1 else hidden[rows], rows)
        new, stop = cut_at_eos(new[:remaining], eos)
        canvas.commit(new)
        if on_step is not None:
            on_step(out + new, list(range(len(out), len(out) + len(new))))
        out.extend(new)
        steps.extend([canvas.forwards + drafter.forwards] * len(new))
        drafted.append(len(drafts))
        reach.append(depth if parents is not None else len(drafts))
        accepted.append(j)
        draftable.append(len(drafted) > 1 and remaining > 1)  # not the prompt's forward nor a 1-token budget
        if stop or len(out) >= max_new_tokens:
            break
        proposal = drafter.propose(
            canvas, j, hidden[n_pending + len(drafts) :], max_new_tokens - len(out), sampling
        )
    return Decoded(out, canvas.forwards + drafter.forwards, steps, accepted, drafted, draftable, reach)


def trim_tree(
    tokens: list[int], parents: list[int], max_depth: int, max_nodes: int
) -> tuple[list[int], list[int], int]:
    """The first `max_nodes` nodes of a tree no deeper than `max_depth`, parents renumbered, and
    the kept tree's depth (a root child: 1)."""
    depth, index, out_tokens, out_parents = [], {}, [], []
    for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
        depth.append(1 + (depth[p] if p >= 0 else 0))
        if depth[i] <= max_depth and (p < 0 or p in index) and len(out_tokens) < max_nodes:
            index[i] = len(out_tokens)
            out_tokens.append(t)
            out_parents.append(index[p] if p >= 0 else -1)
    return out_tokens, out_parents, max((depth[i] for i in index), default=0)


def speculative_accept(
    drafts: list[int],
    q: torch.Tensor | None,
    verify: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """The speculative-sampling rule (Leviathan et al. 2023): (accepted drafts, next token).

    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token
    is drawn from norm(max(p_i - q_i, 0)); if all are kept, from p after the last draft.
    """
    p = torch.softmax(verify / temperature, -1)  # (k + 1, V)
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        if u < min(1.0, float(p[i, d] / q[i, d])):
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        residual = residual / residual.sum() if float(residual.sum()) > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))
