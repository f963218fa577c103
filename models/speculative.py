"""Lossless speculative decoding: one loop verifies any `Drafter` with the student's base model.

Each verify forward feeds, on the exact prefix cache of `a2d.models.canvas`,

    [pending committed tokens (at least the newest), drafts d_1..d_k, the drafter's open region]

The clean positions are the base model exactly (`adapter_scope: masked`), so their logits verify the
drafts: greedy keeps the longest prefix equal to the base's argmax plus the base's own next token;
temperature > 0 keeps draft i with probability min(1, p_i/q_i) and draws the next token from the
residual (Leviathan et al. 2023). Either way the output is the base model's, token for token (greedy)
or in distribution (sampling). The mask row never gets mass: the base's verify logits drop it.

Drafters (what proposes d_1..d_k and what it costs; `a2d.models.proposals`, and
`a2d.models.dflash_drafter` for the DFlash one):
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

import torch

from a2d.models.block_decode import Decoded, OnStep, cut_at_eos
from a2d.models.canvas import Canvas
from a2d.models.lean_canvas import lean_canvas
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
