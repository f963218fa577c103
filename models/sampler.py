"""Decoding with a diffusion student: threshold/entropy block decoding (lossy) and lossless
self-speculative decoding, both on the exact prefix cache of `a2d.models.canvas`.

Counting rules (every sampler, every report): a forward is one call of the model over whatever it
is fed (a verify+draft forward counts once; a VFM's prompt forward counts); generated tokens are
the response tokens up to and including EOS; prompt tokens are not counted.

Threshold decoding (Fast-dLLM / d3LLM style): blocks of `student.block_size` counted from the
response start; a block starts fully masked; each forward predicts every masked position of the
open block and commits those whose confidence reaches the threshold (or whose entropy is at most
it). Under `adapter_scope: masked` the first masked position is predicted by the base model from a
clean causal prefix, i.e. it is exactly the AR token, so it is always committed; otherwise the most
confident position is forced when none qualifies. A block stops once EOS is committed and every
position before it is; decoding stops there.

Self-speculative decoding: one forward feeds [newest token, drafts d_1..d_k, B masks]. The clean
positions are the base model: their logits verify the drafts (greedy: the longest prefix equal to
the base's argmax, plus the base's own next token; temperature > 0: the speculative-sampling rule,
so the output distribution is the base's). The masks draft the next block. The output is the
student's base model's own, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from a2d.models.canvas import Canvas
from a2d.models.generate import generate_batch
from a2d.models.student import Student, lm_head


@dataclass
class Decoded:
    tokens: list[int]  # generated tokens, EOS included when reached
    forwards: int  # model forward passes
    commit_step: list[int]  # per generated token, the forward (1-based) that committed it
    accepted: list[int] = field(default_factory=list)  # speculative: tokens gained per forward


OnStep = Callable[[list[int], list[int]], None]  # (response so far, positions this forward committed)


def ar_decode(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int | None,
    lookup: int = 0,
) -> Decoded:
    """Greedy AR decoding with transformers' KV cache, every model call counted; with `lookup`,
    transformers' prompt-lookup decoding (drafts copied from the prompt, verified; `lookup` tokens)."""
    count = [0]

    def hook(*_: object) -> None:
        count[0] += 1

    handle = model.register_forward_hook(hook)
    try:
        if lookup:
            ids = torch.tensor([prompt], device=next(model.parameters()).device)
            new = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=pad_id,
                prompt_lookup_num_tokens=lookup,
            )[0, len(prompt) :].tolist()
            tokens = new[: next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))]
        else:
            tokens = generate_batch(model, [prompt], max_new_tokens, eos_ids, pad_id).response_ids[0]
    finally:
        handle.remove()
    return Decoded(tokens, count[0], [])


def _predictor(position: int, shifted: bool) -> int:
    """Index of the fed position whose logits predict `position` (AR-style shift, or the position itself)."""
    return position - 1 if shifted else position


def _cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
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
def speculative_decode(
    student: Student,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    drafter: Callable[[list[int]], list[int]] | None = None,
    on_step: OnStep | None = None,
    lookup: int = 0,
    draft_len: int | None = None,
) -> Decoded:
    """Lossless self-speculative decoding: the head drafts a block, the base verifies it in the same forward.

    Greedy (temperature 0): the output equals the base model's greedy decode. Sampling: drafts are
    drawn from the head's distributions q and accepted by the speculative-sampling rule against
    the base's p, so every token is distributed as the base model's (at that temperature).
    `drafter` (greedy only) replaces the mask block: given the response so far it returns the next
    drafts (a VFM's one-step completion, say), and each forward only verifies.
    `lookup` (greedy only; the longest n-gram tried, 0 = off): where the newest tokens occurred
    earlier in the prompt or the output, the tokens that followed them there are the drafts instead
    of the head's (prompt-lookup drafting, in the same verifying forward that also drafts by masks).
    `draft_len` (default the head's block) masks draft per forward: fewer make each forward cheaper
    where the forward's cost grows with its tokens (a CPU), at the price of shorter drafts.
    """
    if student.attention != "block" or not student.scope.masked:
        raise ValueError("speculative decoding needs a head with attention: block and adapter_scope: masked")
    if (drafter is not None or lookup) and temperature > 0:
        raise ValueError(
            "an external or lookup drafter gives no draft distribution: use it with temperature 0"
        )
    mask_id, eos, size = student.info.mask_id, set(eos_ids), student.block_size
    canvas = Canvas(student, prompt, cached=True)
    head = lm_head(student)
    out: list[int] = []
    steps: list[int] = []
    accepted: list[int] = []
    drafts: list[int] = []
    draft_q: torch.Tensor | None = None  # (k, V) distributions the drafts were drawn from
    size = min(draft_len or size, size)
    masks = [] if drafter is not None else [mask_id] * size
    if drafter is not None:
        drafts = list(drafter([]))[:size]
    elif lookup:
        drafts = ngram_drafts(prompt, lookup, size)
    while len(out) < max_new_tokens:
        hidden = canvas.forward(drafts, masks)
        n_pending = hidden.shape[0] - len(drafts) - len(masks)
        # base logits at the newest token and at each draft: predictions for the next k + 1 positions
        verify = head(hidden[n_pending - 1 : n_pending + len(drafts)]).float()  # (k + 1, V)
        draft_logits = head(
            hidden[n_pending + len(drafts) :]
        ).float()  # (B, V): positions after the correction
        draft_logits[:, mask_id] = float("-inf")  # a draft is never the mask token; the base may emit any id
        if temperature <= 0:
            best = verify.argmax(-1).tolist()
            j = 0
            while j < len(drafts) and drafts[j] == best[j]:
                j += 1
            new = drafts[:j] + [best[j]]
        else:
            j, correction = _speculative_accept(drafts, draft_q, verify, temperature, generator)
            new = drafts[:j] + [correction]
        canvas.keep(j)
        new, stop = _cut_at_eos(new[: max_new_tokens - len(out)], eos)
        canvas.commit(new)
        if on_step is not None:
            on_step(out + new, list(range(len(out), len(out) + len(new))))
        out.extend(new)
        steps.extend([canvas.forwards] * len(new))
        accepted.append(len(new))
        if stop or len(out) >= max_new_tokens:
            break
        if drafter is not None:
            drafts = list(drafter(out))[:size]
        elif j == len(drafts):  # every draft held: the masks, which followed them, draft the next block
            if temperature <= 0:
                drafts, draft_q = draft_logits.argmax(-1).tolist(), None
            else:
                draft_q = torch.softmax(draft_logits / temperature, -1)
                drafts = torch.multinomial(draft_q, 1, generator=generator).flatten().tolist()
        else:  # a draft was rejected: the mask drafts assumed it; the next forward drafts afresh
            drafts, draft_q = [], None
        if lookup and drafter is None:
            drafts = ngram_drafts(prompt + out, lookup, size) or drafts
    return Decoded(out, canvas.forwards, steps, accepted)


def ngram_drafts(context: list[int], max_ngram: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the context's last n
    tokens, for the longest n <= max_ngram that occurred; [] where none did."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + count]
    return []


def _speculative_accept(
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
