"""Batched autoregressive generation with the KV cache (greedy by default), for teacher responses.

Sampling never touches torch's global RNG: responses shards generate concurrently in threads of one
process, so a global seed would make a sample depend on thread timing. Each sample draws from its own
generator (seeded per sample by the caller), via the Gumbel-max trick over the temperature/top-p
scores: the argmax of scores + Gumbel noise is an exact sample from their softmax, so one greedy
loop (KV cache, EOS handling) does the sampling, and a sample is the same whichever batch, shard
or thread it is generated in.

The loop is a2d's own, not transformers' `generate`: it numbers positions and pads as `generate`
does (the same tokens), and it can keep the selected layers' outputs at every token it feeds, so
the anchors of a response come out of the forwards that generated it (`capture`), not a second
forward over prompt + response.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import DynamicLayer


@dataclass
class Generated:
    response_ids: list[list[int]]  # per sample, EOS included when generation stopped on it
    finish_reason: list[str]  # "eos" or "length"
    forwards: int  # decoder forward passes used for the batch
    states: GeneratedStates | None = None  # what `capture` asked for, when it asked


@dataclass
class GeneratedStates:
    """The selected layers' outputs at every token a batch's generation fed, as bf16.

    Sample b's prompt is `prefill[:, b, width - len(prompt):]` (left padding) and its response
    token j is `steps[:, b, j]`: the forward that fed token j. The last forward feeds the last
    tokens chosen, so every response token has its state, as a forward over prompt + response
    gives it. `confidence`/`entropy[b, j]` are the teacher's probability of response token j and
    the entropy of the distribution it was chosen from (the raw logits, before any sampler)."""

    layers: list[int]
    width: int  # W, the left-padded prompt width
    prefill: torch.Tensor  # (L, B, W, H) bfloat16
    steps: torch.Tensor  # (L, B, N, H) bfloat16, N = the tokens chosen for the longest response
    confidence: torch.Tensor  # (B, N) float32
    entropy: torch.Tensor  # (B, N) float32


class _BufferedLayer(DynamicLayer):
    """A `DynamicLayer` without its copy: the keys and values go into buffers sized for the whole
    generation, and the layer holds views of the filled part (so its length, masks and crops are
    `DynamicLayer`'s own).

    `DynamicLayer` concatenates the whole cache with each new token: at a batch of 30 (the demo's
    responses) that copied ~230 MB a decode step of the 135M teacher, and one generation of 30
    code prompts x 64 tokens took 1.17x as long with it on 2 CPU cores (main thread, 2026-12-07).
    Two shards generating at once in threads (the demo's `workers: 2`) hide most of the copy
    behind each other's compute (`benchmarks/responses.py`). The views hold the same values in the
    same shapes, so attention reads what it read."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = key_states.new_empty((*key_states.shape[:-2], self.capacity, key_states.shape[-1]))
        self.value_buffer = value_states.new_empty(
            (*value_states.shape[:-2], self.capacity, value_states.shape[-1])
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        if start and self.keys.data_ptr() != self.key_buffer.data_ptr():
            # DynamicLayer's batch select, repeat or reorder replaced the views with new tensors (a
            # crop keeps them): buffers of their batch take them over, or the next step would drop them
            keys, values = self.keys, self.values
            self.lazy_initialization(keys, values)
            self.key_buffer[..., :start, :], self.value_buffer[..., :start, :] = keys, values
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"generation fed {end} tokens into a cache sized for {self.capacity}")
        self.key_buffer[..., start:end, :] = key_states
        self.value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values


def preallocated_cache(model: torch.nn.Module, capacity: int):
    """A `DynamicCache` for `model` whose full-attention layers write into buffers of `capacity`
    tokens (`_BufferedLayer`); other layer kinds (sliding windows, linear attention) are kept."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.layers = [_BufferedLayer(capacity) if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (B, T): generation appends on the right."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def sample_seed(seed: int, sample_id: str) -> int:
    """The seed of one sample's generator: a function of the run's seed and the sample alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{sample_id}".encode()).digest()[:8], "big") >> 1


class GumbelSampler(LogitsProcessor):
    """Adds Gumbel(0, 1) noise to each row's scores from that row's own generator (B rows, B seeds)."""

    def __init__(self, seeds: Sequence[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores (B, V); uniform u in [0, 1) per row -> -log(-log u); -inf scores (top-p cut) stay -inf
        u = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
        return scores + gumbel.to(device=scores.device, dtype=scores.dtype)


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
    capture: Sequence[int] | None = None,
) -> Generated:
    """Generate continuations for a batch of prompts (left-padded, one KV cache); stops each sample
    at its first EOS and the batch when every sample has stopped.

    Sampling (`do_sample`) needs one seed per prompt (`sample_seed`); it applies the temperature
    and top-p given here and nothing else (no top-k or penalty from the model's generation config).
    `capture` (decoder layer indices) keeps those layers' outputs at every token fed, and one
    forward more feeds the last tokens chosen: `Generated.states`, the anchors of the batch.
    """
    from a2d.models.capture import capture_layers, token_confidence

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    processors = None
    if do_sample:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError("sampled generation needs one seed per prompt (see sample_seed)")
        processors = LogitsProcessorList(
            [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p), GumbelSampler(seeds)]
        )
    kept: dict[int, list[torch.Tensor]] = {layer: [] for layer in capture or []}
    scored: list[tuple[torch.Tensor, torch.Tensor]] = []
    eos = torch.tensor(sorted(set(eos_ids)), device=device)
    cache = preallocated_cache(model, ids.shape[1] + max_new_tokens)
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as transformers' generate numbers them
    seq = feed = ids
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    chosen: list[torch.Tensor] = []
    forwards, finished = 0, max_new_tokens == 0 or bool(done.all())
    with capture_layers(model, list(kept), lambda i, h: kept[i].append(h.to(torch.bfloat16))):
        while True:
            out = model(
                input_ids=feed,
                attention_mask=mask,
                position_ids=position,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
            forwards += 1
            if finished:
                break  # this forward fed the last tokens chosen (run only for the capture)
            scores = processors(seq, logits) if processors is not None else logits
            token = torch.where(done, torch.full_like(done, pad_id, dtype=torch.long), scores.argmax(-1))
            if capture is not None:
                scored.append(token_confidence(logits, token))
            done = done | torch.isin(token, eos)
            chosen.append(token)
            seq = torch.cat([seq, token[:, None]], dim=1)
            finished = len(chosen) == max_new_tokens or bool(done.all())
            if finished and capture is None:
                break  # without a capture the last tokens need no forward of their own
            feed, position = token[:, None], position[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
    responses, reasons = _cut_at_eos(torch.stack(chosen, dim=1).tolist(), eos_ids)
    states = None
    if capture is not None:
        states = GeneratedStates(
            layers=list(kept),
            width=ids.shape[1],
            prefill=torch.stack([kept[layer][0] for layer in kept]),
            steps=torch.stack([torch.cat(kept[layer][1:], dim=1) for layer in kept]),
            confidence=torch.stack([c for c, _ in scored], dim=1),
            entropy=torch.stack([e for _, e in scored], dim=1),
        )
    return Generated(responses, reasons, forwards=forwards, states=states)


def _cut_at_eos(rows: list[list[int]], eos_ids: list[int]) -> tuple[list[list[int]], list[str]]:
    """Each row up to and with its first EOS ("eos"), or whole ("length")."""
    eos = set(eos_ids)
    responses, reasons = [], []
    for row in rows:
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        responses.append(row if cut is None else row[: cut + 1])
        reasons.append("length" if cut is None else "eos")
    return responses, reasons


def eos_ids(model: torch.nn.Module, tok) -> list[int]:
    """Every token id that ends a response: the generation config's EOS ids plus the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = (
        list(ids) if isinstance(ids, list) else [ids] if ids is not None else []
    )  # a copy: never edit the config
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    if not ids:
        raise ValueError("the teacher has no EOS token: set eos_token_id in its generation_config")
    return ids
