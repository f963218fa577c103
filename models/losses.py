"""Losses of the diffusion head: masked-diffusion CE (stated weighting and normaliser), d3LLM's
entropy-on-correct sharpening term, and mean-centred representation alignment."""

from __future__ import annotations

import torch

MIN_SNR_GAMMA = 5.0
SHARPEN_TEMPERATURE = 0.5  # d3LLM: the entropy of correct predictions is taken at temperature 0.5


def time_weight(t: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-row weight from the mask ratio t (R,).

    none: 1; inv_t: 1/t (the MDLM ELBO weight); min_snr: min(1/t, γ=5), the ELBO weight capped so
    that nearly-clean rows (small t) cannot dominate, as min-SNR-γ does for Gaussian diffusion.
    """
    if weighting == "none":
        return torch.ones_like(t)
    if weighting == "inv_t":
        return 1.0 / t
    if weighting == "min_snr":
        return torch.clamp(1.0 / t, max=MIN_SNR_GAMMA)
    raise ValueError(f"unknown weighting {weighting!r}: use none, inv_t or min_snr")


def masked_diffusion_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    time_w: torch.Tensor,
    norm: torch.Tensor,
    entropy_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CE over the N masked positions plus `entropy_weight` × entropy of the correct ones.

    logits (N, V) predict targets (N,); time_w (N,) is each position's row weight from its t;
    norm (N,) is 1 / the normaliser of the view the position belongs to (its masked or its
    supervised count), so a primary view and its complement each average to one term.
    Sharpening: the entropy of softmax(logits / 0.5) at positions already predicted right, with the
    same normaliser; it pushes confident-and-correct positions over a decoder's threshold (d3LLM).
    """
    logits = logits.float()
    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # (N,)
    loss = (ce * time_w * norm).sum()
    correct = logits.argmax(-1) == targets  # (N,)
    entropy = torch.zeros((), device=logits.device)
    if entropy_weight > 0 and bool(correct.any()):
        logp = torch.log_softmax(logits[correct] / SHARPEN_TEMPERATURE, dim=-1)
        entropy = (-(logp.exp() * logp).sum(-1) * norm[correct]).sum()
        loss = loss + entropy_weight * entropy
    n = max(len(ce), 1)
    return loss, {
        "ce": float(ce.detach().sum()) / n,
        "masked_tokens": len(ce),
        "masked_acc": float(correct.float().sum()) / n,
        "sharpen": float(entropy.detach()),
    }


def alignment_loss(
    student: list[torch.Tensor], teacher: list[torch.Tensor], centre: list[torch.Tensor]
) -> torch.Tensor:
    """Mean (1 − cosine) between mean-centred student and teacher states at the same capture point.

    Each entry is (n, H) states of one layer; `centre` is that layer's teacher mean (H,). Raw
    residual streams share a large common offset (two unrelated tokens have cosine 0.3-0.7), so an
    uncentred cosine rewards matching the offset; centred, unrelated tokens have cosine ≈ 0.
    """
    terms = [
        1.0 - torch.nn.functional.cosine_similarity((s.float() - c), (t.float() - c), dim=-1)
        for s, t, c in zip(student, teacher, centre, strict=True)
    ]
    flat = torch.cat(terms) if terms else torch.zeros(0)
    return flat.mean() if flat.numel() else torch.zeros(())
