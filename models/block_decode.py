"""Block decoding with a diffusion student: threshold/entropy decoding (lossy) on the exact prefix
cache of `a2d.models.canvas`; lossless speculative decoding lives in `a2d.models.speculative`.

Counting rules (every decoder, every report): a forward is one call of the model over whatever it
is fed (a verify+draft forward counts once; a VFM's prompt forward counts); generated tokens are
the response tokens up to and including EOS; prompt tokens are not counted.

Threshold decoding (Fast-dLLM / d3LLM style): blocks of `student.block_size` counted from the
response start; a block starts fully masked; each forward predicts every masked position of the
open block and commits those whose confidence reaches the threshold (or whose entropy is at most
it). Under `adapter_scope: masked` the first masked position is predicted by the base model from a
clean causal prefix, i.e. it is exactly the AR token, so it is always committed; otherwise the most
confident position is forced when none qualifies. A block stops once EOS is committed and every
position before it is; decoding stops there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from a2d.models.canvas import Canvas
from a2d.models.student import Student, lm_head


@dataclass
class Decoded:
    tokens: list[int]  # generated tokens, EOS included when reached
    forwards: int  # model forward passes
    commit_step: list[int]  # per generated token, the forward (1-based) that committed it
    accepted: list[int] = field(default_factory=list)  # speculative: drafts that held, per verify forward
    drafted: list[int] = field(default_factory=list)  # speculative: drafts fed, per verify forward
    draftable: list[bool] = field(default_factory=list)  # speculative: could that forward have had drafts
    reach: list[int] = field(default_factory=list)  # speculative: the deepest draft fed (a chain: drafted)


OnStep = Callable[[list[int], list[int]], None]  # (response so far, positions this forward committed)


def _predictor(position: int, shifted: bool) -> int:
    """Index of the fed position whose logits predict `position` (AR-style shift, or the position itself)."""
    return position - 1 if shifted else position


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


@torch.no_grad()
def threshold_decode(
    student: Student,
    prompt: list[int],
    max_new_tokens: int,
    threshold: float,
    eos_ids: list[int],
    logit_alignment: str = "shifted",
    criterion: str = "confidence",
    cached: bool = True,
    block_size: int | None = None,
    on_step: OnStep | None = None,
) -> Decoded:
    """Decode one prompt; `criterion` is "confidence" (p >= threshold) or "entropy" (H <= threshold).

    threshold 0 with confidence commits a whole block per forward (head:k1). `block_size` defaults
    to the student's trained one (the only size it was trained for). `on_step(response, committed)`
    is called after every forward with the response committed left to right so far and the
    response positions that forward committed (for streaming and `a2d generate --show-steps`).
    """
    size = block_size or student.block_size
    mask_id, eos = student.info.mask_id, set(eos_ids)
    shifted = logit_alignment == "shifted"
    canvas = Canvas(student, prompt, cached=cached and student.attention == "block")
    exact_first = student.scope.masked and student.attention == "block" and shifted
    out: list[int] = []
    steps: list[int] = []
    done = False
    while len(out) < max_new_tokens and not done:
        n = min(size, max_new_tokens - len(out))
        block: list[int | None] = [None] * n
        block_steps = [0] * n
        first = 0  # first uncommitted block position; block[:first] is committed and on the canvas
        while first < n:
            region = [t if t is not None else mask_id for t in block[first:]]
            hidden = canvas.forward([], region)  # (len(pending) + len(region), H)
            canvas.keep(-1)
            n_pending = hidden.shape[0] - len(region)
            open_idx = [r for r, t in enumerate(block[first:]) if t is None]
            rows = torch.tensor([_predictor(n_pending + r, shifted) for r in open_idx], device=hidden.device)
            logits = lm_head(student)(hidden[rows]).float()  # (m, V)
            logits[:, mask_id] = float("-inf")  # never predict the mask token itself
            probs = torch.softmax(logits, -1)
            conf, pred = probs.max(-1)
            if criterion == "confidence":
                take = conf >= threshold
            else:
                take = -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1) <= threshold
            if exact_first:
                take[0] = True  # the base model's own next token
            elif not bool(take.any()):
                take[int(conf.argmax())] = True  # force the best so the block progresses
            committed = []
            for i in torch.nonzero(take).flatten().tolist():
                block[first + open_idx[i]] = int(pred[i])
                block_steps[first + open_idx[i]] = canvas.forwards
                committed.append(len(out) + first + open_idx[i])
            while first < n and block[first] is not None:
                canvas.commit([block[first]])
                first += 1
                if block[first - 1] in eos:  # EOS with every earlier position committed: the answer ends
                    done, n = True, first
                    break
            if on_step is not None:
                on_step(out + block[:first], committed)
            if done:
                break
        out.extend(block[:n])
        steps.extend(block_steps[:n])
    return Decoded(out, canvas.forwards, steps)


@torch.no_grad()
def forced_commit_steps(
    student: Student,
    prompt: list[int],
    response: list[int],
    threshold: float,
    logit_alignment: str = "shifted",
) -> tuple[list[int], int]:
    """The step at which the student would commit each token of a *given* response.

    Threshold decoding as above, but every committed position receives the response's own token:
    each forward scores the true token at every masked position of the open block and commits
    those with probability >= threshold (at least the best one, or the exact first one). The
    result pairs with the response it was computed on, as the trajectory curriculum needs.
    Returns (steps, forwards).
    """
    size, mask_id = student.block_size, student.info.mask_id
    shifted = logit_alignment == "shifted"
    canvas = Canvas(student, prompt, cached=student.attention == "block")
    exact_first = student.scope.masked and student.attention == "block" and shifted
    steps = [0] * len(response)
    for start in range(0, len(response), size):
        end = min(start + size, len(response))
        open_ = list(range(start, end))
        done: set[int] = set()
        first = start
        while first < end:
            region = [response[i] if i in done else mask_id for i in range(first, end)]
            hidden = canvas.forward([], region)
            canvas.keep(-1)
            n_pending = hidden.shape[0] - len(region)
            open_ = [i for i in range(first, end) if i not in done]
            rows = torch.tensor(
                [_predictor(n_pending + i - first, shifted) for i in open_], device=hidden.device
            )
            probs = torch.softmax(lm_head(student)(hidden[rows]).float(), -1)  # (n, V)
            truth = torch.tensor([response[i] for i in open_], device=hidden.device)
            p_true = probs.gather(-1, truth[:, None]).squeeze(-1)
            take = [i for i, p in zip(open_, p_true.tolist(), strict=True) if p >= threshold]
            if exact_first and open_[0] not in take:
                take.append(open_[0])
            if not take:
                take = [open_[int(p_true.argmax())]]
            for i in take:
                done.add(i)
                steps[i] = canvas.forwards
            while first < end and first in done:
                canvas.commit([response[first]])
                first += 1
    return steps, canvas.forwards
