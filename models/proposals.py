"""The drafters that need no network of their own beyond the student: the head's masks, n-gram
lookup, both together, an external causal LM, and the VFM's one-step block (`a2d.models.speculative`
verifies each; the module docstring there says what each costs)."""

from __future__ import annotations

import torch

from a2d.models.canvas import Canvas, truncate_attention
from a2d.models.speculative import Drafter, Proposal, Runs
from a2d.models.student import Student, lm_head


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
