"""Parallel decoding for diffusion students: confidence- or entropy-threshold commits, block by block.

Fast-dLLM style: the current block starts fully masked; each forward predicts every masked position
of the block and commits those whose confidence exceeds the threshold (or whose entropy is below
it, d3LLM style), always at least the single best one so a block never stalls. Decoding stops at
EOS. Returns the tokens, the number of forwards, and the step at which each position was committed
(the record the trajectories stage stores for its `diffusion-decode` source).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a2d.models.student import Student, lm_head, student_hidden


@dataclass
class Decoded:
    tokens: list[int]  # generated tokens, EOS included when reached
    forwards: int  # student forward passes
    commit_step: list[int]  # per generated token, the forward (1-based) that committed it


@torch.no_grad()
def threshold_decode(
    student: Student,
    prompt: list[int],
    max_new_tokens: int,
    block_size: int,
    threshold: float,
    eos_ids: list[int],
    attention: str,
    logit_alignment: str,
    criterion: str = "confidence",
) -> Decoded:
    """Decode one prompt; `criterion` is "confidence" (p >= threshold) or "entropy" (H <= threshold)."""
    device = next(p for p in student.model.parameters()).device
    mask_id = student.info.mask_id
    seq = list(prompt)
    out: list[int] = []
    steps: list[int] = []
    forwards = 0
    done = False
    while len(out) < max_new_tokens and not done:
        n = min(block_size, max_new_tokens - len(out))
        start = len(seq)
        seq.extend([mask_id] * n)
        committed = torch.zeros(n, dtype=torch.bool)
        while not bool(committed.all()):
            ids = torch.tensor([seq], device=device)
            pad = torch.ones_like(ids)
            hidden = student_hidden(student, ids, pad, attention, block_size)[0]  # (T, H)
            forwards += 1
            pos = torch.arange(start, start + n, device=device)
            src = pos - 1 if logit_alignment == "shifted" else pos
            logits = lm_head(student)(hidden[src]).float()  # (n, V)
            logits[:, mask_id] = float("-inf")  # never predict the mask token itself
            probs = torch.softmax(logits, -1)
            conf, pred = probs.max(-1)
            score = (
                conf if criterion == "confidence" else -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1)
            )
            open_ = ~committed.to(device)
            ok = (score >= threshold) if criterion == "confidence" else (score <= threshold)
            take = ok & open_
            if not bool(take.any()):  # force the best open position so the block progresses
                best = torch.where(open_, conf, torch.full_like(conf, -1.0)).argmax()
                take = torch.zeros_like(open_)
                take[best] = True
            for j in take.nonzero().flatten().tolist():
                seq[start + j] = int(pred[j])
                committed[j] = True
                steps_idx = len(out) + j
                while len(steps) <= steps_idx:
                    steps.append(0)
                steps[steps_idx] = forwards
        block = seq[start : start + n]
        for tok in block:
            out.append(tok)
            if tok in eos_ids:
                done = True
                break
    steps = steps[: len(out)]
    return Decoded(out, forwards, steps)


@torch.no_grad()
def forced_commit_steps(
    student: Student,
    prompt: list[int],
    response: list[int],
    block_size: int,
    threshold: float,
    attention: str,
    logit_alignment: str,
) -> tuple[list[int], int]:
    """The step at which a diffusion model would commit each token of a *given* response.

    Threshold decoding as above, but every committed position receives the response's own token:
    each forward scores the true token at every masked position of the current block and commits
    those with probability >= threshold (at least the best one). The result pairs with the response
    it was computed on, which is what the trajectory curriculum needs. Returns (steps, forwards).
    """
    device = next(p for p in student.model.parameters()).device
    mask_id = student.info.mask_id
    steps = [0] * len(response)
    forwards = 0
    for start in range(0, len(response), block_size):
        end = min(start + block_size, len(response))
        seq = list(prompt) + list(response[:start]) + [mask_id] * (end - start)
        open_ = list(range(start, end))
        while open_:
            ids = torch.tensor([seq], device=device)
            hidden = student_hidden(student, ids, torch.ones_like(ids), attention, block_size)[0]  # (T, H)
            forwards += 1
            pos = torch.tensor([len(prompt) + i for i in open_], device=device)
            src = pos - 1 if logit_alignment == "shifted" else pos
            probs = torch.softmax(lm_head(student)(hidden[src]).float(), -1)  # (n, V)
            truth = torch.tensor([response[i] for i in open_], device=device)
            p_true = probs.gather(-1, truth[:, None]).squeeze(-1)
            take = [i for i, p in zip(open_, p_true.tolist(), strict=True) if p >= threshold]
            if not take:
                take = [open_[int(p_true.argmax())]]
            for i in take:
                seq[len(prompt) + i] = response[i]
                steps[i] = forwards
            open_ = [i for i in open_ if i not in take]
    return steps, forwards
