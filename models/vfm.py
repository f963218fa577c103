"""Variational flow map (arXiv 2603.07276): learn the initial noise, map it to data in one step.

A noise adapter q_φ(z | prompt) reads the student's prompt representations and, through learned
completion-position queries, outputs the mean and log-variance of z in the student's
input-embedding space for each completion position. The trained diffusion student is the flow map:
[prompt embeddings ; z] → completion logits in ONE forward. Objective:

    CE(teacher response | one-step logits) / (2 τ²) + β · KL(q_φ(z | prompt) ‖ N(m, I))

with reparameterised z and the prior centred on m, the mask embedding in z units (where the flow
map's input lives). The flow map is trained jointly with q_φ by default, as the paper trains it.
Generation uses z = mean (or a sample) for K = 1, or K > 1 refinement steps (trained by committing
a random share of true tokens) that replace z by the embeddings of confidently committed tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from a2d.models.canvas import freeze_linear_states, new_cache, truncate_attention
from a2d.models.student import Student, lm_head, student_forward


class NoiseAdapter(nn.Module):
    """q_φ(z | prompt): a small transformer decoder whose queries are the completion positions."""

    def __init__(self, hidden: int, max_len: int, width: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.config = {"hidden": hidden, "max_len": max_len, "width": width, "layers": layers, "heads": heads}
        self.inp = nn.Linear(hidden, width)
        self.queries = nn.Parameter(torch.randn(max_len, width) * 0.02)  # (L, d)
        block = nn.TransformerDecoderLayer(
            width, heads, dim_feedforward=2 * width, batch_first=True, dropout=0.0
        )
        self.decoder = nn.TransformerDecoder(block, layers)
        self.mu = nn.Linear(width, hidden)
        self.logvar = nn.Linear(width, hidden)
        nn.init.zeros_(self.mu.weight)
        nn.init.zeros_(self.logvar.weight)
        nn.init.constant_(self.logvar.bias, -6.0)  # start nearly deterministic, as castlehill's VFM ran
        # z lives in units of the embedding matrix's RMS, so that the unit-variance prior means
        # "noise as large as a token embedding" whatever the model's embedding scale.
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("prior_mean", torch.zeros(hidden))  # the mask embedding, in z units

    def init_mean(self, mask_embedding: torch.Tensor, embedding_rms: float) -> None:
        """Centre z and its prior on the mask embedding: the untrained flow map is the student's
        all-masked one-step decode, and the prior sits where the flow map's input lives."""
        with torch.no_grad():
            self.scale.fill_(embedding_rms)
            self.prior_mean.copy_(mask_embedding.float() / embedding_rms)
            self.mu.bias.copy_(self.prior_mean)

    def embed(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised z (B, L, H) -> the student's input-embedding space."""
        return z * self.scale

    def forward(
        self, prompt_hidden: torch.Tensor, prompt_pad: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt_hidden (B, P, H), prompt_pad (B, P) 1 for real tokens -> mu, logvar (B, length, H)."""
        memory = self.inp(prompt_hidden.float())  # (B, P, d)
        q = self.queries[:length].unsqueeze(0).expand(prompt_hidden.shape[0], -1, -1)  # (B, L, d)
        h = self.decoder(q, memory, memory_key_padding_mask=~prompt_pad.bool())
        return self.mu(h), self.logvar(h).clamp(-12.0, 4.0)

    def save_pretrained(self, path: Path, safe_serialization: bool = True) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()},
            path / "noise_adapter.safetensors",
        )
        (path / "noise_adapter.json").write_text(json.dumps(self.config, sort_keys=True))

    @classmethod
    def from_pretrained(cls, path: Path) -> NoiseAdapter:
        path = Path(path)
        adapter = cls(**json.loads((path / "noise_adapter.json").read_text()))
        adapter.load_state_dict(load_file(path / "noise_adapter.safetensors"))
        return adapter


def kl_to_prior(mu: torch.Tensor, logvar: torch.Tensor, prior_mean: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, σ²) ‖ N(prior_mean, I)) summed over the embedding dim, averaged over positions: (B, L, H) -> ().

    The prior is centred on the mask embedding (in z units): where the flow map's input lives, so
    "no information" costs nothing and a z that moves away from the mask pays for it.
    """
    return 0.5 * ((mu - prior_mean).pow(2) + logvar.exp() - 1.0 - logvar).sum(-1).mean()


@dataclass
class Prompt:
    """One no-grad forward of the student's base over the (left-padded) prompts: the states q(z | prompt)
    reads, and the cache the flow map continues from (the prompt is the causal prefix of every step)."""

    states: torch.Tensor  # (B, P, H) final hidden states
    pad: torch.Tensor  # (B, P) real prompt tokens
    cache: object  # transformers cache over the P prompt positions


@torch.no_grad()
def encode_prompt(student: Student, prompt_ids: torch.Tensor, prompt_pad: torch.Tensor) -> Prompt:
    """The prompt forward. No position is open, so under `adapter_scope: masked` it is the base model
    exactly; its cache's linear-attention states are made read-only so flow-map steps can share it."""
    cache = new_cache(student.inner)
    closed = torch.zeros_like(prompt_pad, dtype=torch.bool)
    states = student_forward(student, prompt_ids, prompt_pad, closed, cache=cache)
    freeze_linear_states(cache)
    return Prompt(states, prompt_pad, cache)


def flow_map_logits(student: Student, prompt: Prompt, z: torch.Tensor, shifted: bool) -> torch.Tensor:
    """One flow-map forward over z (B, L, H) after the cached prompt -> logits (B, L, V).

    The z positions are the open block: they attend to the prompt and to each other. With shifted
    logits the first completion position is predicted from the last prompt state (the base model's
    own next-token logits); the rest from the z states. The cache is put back to the prompt after.
    """
    b, length = z.shape[:2]
    ones = torch.ones((b, length), dtype=prompt.pad.dtype, device=z.device)
    p = prompt.pad.shape[1]
    try:
        hidden = student_forward(
            student, None, ones, ones.bool(), cache=prompt.cache, inputs_embeds=z, past_pad=prompt.pad
        )  # (B, L, H)
    finally:
        truncate_attention(prompt.cache, p)
    rows = torch.cat([prompt.states[:, -1:].to(hidden.dtype), hidden[:, :-1]], dim=1) if shifted else hidden
    return lm_head(student)(rows)  # (B, L, V)


@torch.no_grad()
def vfm_generate(
    student: Student,
    adapter: NoiseAdapter,
    prompt: list[int],
    length: int,
    steps: int,
    eos_ids: list[int],
    shifted: bool,
    sample: bool = False,
    seed: int = 0,
) -> tuple[list[int], int]:
    """K-step VFM decoding of one prompt; returns (tokens up to and including EOS, forwards).

    Forwards: the prompt forward that conditions q(z | prompt), then one flow-map forward per step.
    """
    device = next(adapter.parameters()).device
    ids = torch.tensor([prompt], device=device)
    pad = torch.ones_like(ids)
    prompt_pass = encode_prompt(student, ids, pad)
    mu, logvar = adapter(prompt_pass.states, pad, length)
    forwards = 1
    z = mu
    if sample:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        z = mu + (0.5 * logvar).exp() * torch.randn(mu.shape, generator=gen).to(device)
    z = adapter.embed(z)
    embed = student.inner.get_input_embeddings()
    committed = torch.zeros(length, dtype=torch.bool, device=device)
    tokens = torch.zeros(length, dtype=torch.long, device=device)
    eos = set(eos_ids)
    for k in range(steps):
        logits = flow_map_logits(student, prompt_pass, z, shifted)[0].float()  # (L, V)
        logits[:, student.info.mask_id] = float("-inf")
        forwards += 1
        conf, pred = torch.softmax(logits, -1).max(-1)
        open_ = ~committed
        remaining = int(open_.sum())
        n = (
            remaining if k == steps - 1 else max(1, -(-remaining // (steps - k)))
        )  # ceil share of what is left
        order = torch.where(open_, conf, torch.full_like(conf, -1.0)).argsort(descending=True)[:n]
        tokens[order] = pred[order]
        committed[order] = True
        z = z.clone()
        z[0, order] = embed(pred[order]).to(z.dtype)  # committed positions become real tokens
        # Stop once EOS is committed with every earlier position committed: later steps change nothing kept.
        hits = [i for i, t in enumerate(tokens.tolist()) if committed[i] and t in eos]
        if hits and bool(committed[: hits[0]].all()):
            break
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t in eos:
            break
    return out, forwards
