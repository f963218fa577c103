"""Losses of the diffusion head: masked-diffusion CE (stated alignment, weighting, normaliser) and
representation alignment between student and teacher residual streams."""

from __future__ import annotations

import torch

MIN_SNR_GAMMA = 5.0


def time_weight(t: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample weight from the mask ratio t (B,).

    none: 1; inv_t: 1/t (the MDLM ELBO weight); min_snr: min(1/t, γ=5), the ELBO weight capped so
    that nearly-clean samples (small t) cannot dominate, as min-SNR-γ does for Gaussian diffusion.
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
    loss_mask: torch.Tensor,
    supervised: torch.Tensor,
    t: torch.Tensor,
    weighting: str,
    normaliser: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CE over masked positions.

    logits (N, V) are the predictions for the N rows where `loss_mask` (B, T) is True, in row-major
    order (the caller selected them, with the logit alignment already applied); targets (B, T);
    supervised (B, T) marks positions that could be supervised (the denominator for `supervised`);
    t (B,) the mask ratio per sample.
    """
    b_idx, _ = loss_mask.nonzero(as_tuple=True)
    ce = torch.nn.functional.cross_entropy(logits.float(), targets[loss_mask], reduction="none")  # (N,)
    w = time_weight(t.float(), weighting)[b_idx]  # (N,)
    total = (ce * w).sum()
    if normaliser == "masked":
        denom = loss_mask.sum()
    elif normaliser == "supervised":
        denom = supervised.sum()
    else:
        raise ValueError(f"unknown normaliser {normaliser!r}: use masked or supervised")
    loss = total / denom.clamp(min=1)
    with torch.no_grad():
        acc = (logits.argmax(-1) == targets[loss_mask]).float().mean().item() if len(ce) else 0.0
    return loss, {
        "ce": ce.mean().item() if len(ce) else 0.0,
        "masked_tokens": int(loss_mask.sum()),
        "masked_acc": acc,
    }


def alignment_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean (1 − cosine) over every pair of (n, H) student/teacher states at the same capture point."""
    terms = [
        1.0 - torch.nn.functional.cosine_similarity(s.float(), t.float(), dim=-1)
        for s, t in zip(student, teacher, strict=True)
    ]
    flat = torch.cat(terms) if terms else torch.zeros(0)
    return flat.mean() if flat.numel() else torch.zeros(())
