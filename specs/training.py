"""The specs of the three trained models (the diffusion head, the VFM, the DFlash drafter); every field
is part of its stage's artifact key. Their optimisation fields are made by the functions below, so a
bound or a shared description is written once; each spec keeps its own defaults, its own order and
only the fields it uses (a field added to a spec would change its key).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from a2d.specs.stages import Spec

LRSchedule = Literal["cosine", "linear", "constant"]


def steps_field(default: int) -> Any:
    """Optimizer steps, 1 to ten million."""
    return Field(default, ge=1, le=10_000_000, description="Optimizer steps")


def micro_batch_field(default: int, description: str) -> Any:
    """Samples per micro-batch (what a sample is, the spec says)."""
    return Field(default, ge=1, le=1024, description=description)


def lr_field(default: float, description: str) -> Any:
    """A learning rate in (0, 1]."""
    return Field(default, gt=0.0, le=1.0, description=description)


def warmup_field(default: int) -> Any:
    """Steps of linear warmup before the schedule."""
    return Field(default, ge=0, description="Linear warmup steps")


def lr_schedule_field() -> Any:
    """The decay after warmup (cosine by default)."""
    return Field("cosine", description="Decay after warmup")


def weight_decay_field() -> Any:
    """AdamW weight decay in [0, 1]."""
    return Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")


def max_grad_norm_field() -> Any:
    """The gradient norm clipped to (1 by default)."""
    return Field(1.0, gt=0.0, description="Gradient clipping")


def seed_field(description: str) -> Any:
    """A seed (0 by default); the spec says what it draws."""
    return Field(0, ge=0, description=description)


class HeadSpec(Spec):
    """The QLoRA diffusion head: student, attention, losses and optimisation; all part of the head key."""

    quantization: Literal["nf4", "none"] = Field(
        "nf4", description="Base weights in NF4 (QLoRA) or the teacher dtype"
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype (bfloat16 on GPU)")
    lora_rank: int = Field(16, ge=1, le=1024, description="LoRA rank")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha")
    lora_targets: list[str] = Field(
        default_factory=list,
        description="Projections the LoRA adapts, by leaf name (e.g. q_proj): empty for every linear "
        "projection of the decoder layers. Fewer targets make a decode forward cheaper on a CPU",
    )
    rslora: bool = Field(False, description="Rank-stabilised LoRA scaling alpha/sqrt(r)")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    attention: Literal["block", "bidirectional"] = Field(
        "block",
        description="block: causal prefix + open block (the decode state); bidirectional: full A2D conversion",
    )
    adapter_scope: Literal["masked", "all"] = Field(
        "masked",
        description="masked: LoRA, mask embedding and reverse scan act only in the open block, so every "
        "committed position is the base model exactly; all: everywhere",
    )
    linear_attention: Literal["causal", "bidirectional"] = Field(
        "bidirectional", description="Hybrid models: linear-attention scan direction(s)"
    )
    block_size: int = Field(
        32,
        ge=1,
        le=8192,
        description="Open-block size, the same for training and decoding (diffusion_spec.json)",
    )
    logit_alignment: Literal["shifted", "aligned"] = Field(
        "shifted", description="shifted: logits at i predict token i+1 (AR-style); aligned: token i"
    )
    mask_schedule: Literal["trajectory", "uniform"] = Field(
        "trajectory", description="d3LLM trajectory curriculum, or t ~ U(eps, 1) per sequence"
    )
    eps: float = Field(1e-3, gt=0.0, lt=1.0, description="uniform: smallest mask ratio")
    r_min_start: float = Field(0.0, ge=0.0, le=1.0, description="trajectory: lower bound of r at the start")
    r_min_end: float = Field(0.8, ge=0.0, le=1.0, description="trajectory: lower bound of r at the end")
    r_max: float = Field(
        1.0, gt=0.0, le=1.0, description="trajectory: upper bound of r (decode blocks start at 1)"
    )
    complementary: bool = Field(True, description="Also train on the complementary mask (its own t)")
    entropy_weight: float = Field(
        0.1, ge=0.0, le=100.0, description="Weight of d3LLM's entropy-on-correct sharpening term (0 disables)"
    )
    weighting: Literal["none", "inv_t", "min_snr"] = Field("none", description="Per-sample CE weight from t")
    normaliser: Literal["masked", "supervised"] = Field(
        "masked", description="Divide by masked or supervised tokens"
    )
    align_weight: float = Field(0.25, ge=0.0, le=100.0, description="λ of the anchor alignment (0 disables)")
    align_schedule: Literal["constant", "linear_decay"] = Field("constant", description="λ(step)")
    align_layers: int = Field(4, ge=1, le=1024, description="Stored layers sampled per step for alignment")
    align_token_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of a view's masked tokens aligned"
    )
    align_from: float = Field(
        0.75,
        ge=0.0,
        lt=1.0,
        description="Only layers at or past this share of the depth are aligned (late layers)",
    )
    steps: int = steps_field(100)
    micro_batch_size: int = micro_batch_field(4, "Samples per micro-batch per process")
    grad_accum: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step per process")
    lr: float = lr_field(2e-4, "Peak learning rate")
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="AdamW, or plain SGD (exact cross-world comparisons)"
    )
    lr_schedule: LRSchedule = lr_schedule_field()
    warmup_steps: int = warmup_field(5)
    weight_decay: float = weight_decay_field()
    max_grad_norm: float = max_grad_norm_field()
    max_seq_len: int = Field(
        512, ge=8, le=131_072, description="Prompt+response tokens per sample (longer are cut)"
    )
    seed: int = seed_field("Seed of data order, masks and layer sampling")


class VFMSpec(Spec):
    """The one-step variational flow map distillation; all part of the vfm key."""

    max_len: int = Field(32, ge=1, le=8192, description="Completion positions the noise adapter emits")
    width: int = Field(128, ge=16, le=8192, description="Noise adapter width")
    layers: int = Field(2, ge=1, le=48, description="Noise adapter transformer layers")
    heads: int = Field(4, ge=1, le=64, description="Noise adapter attention heads")
    tau: float = Field(1.0, gt=0.0, description="CE is divided by 2τ²")
    beta: float = Field(1e-4, ge=0.0, description="KL weight at the end of its warmup")
    beta_warmup: float = Field(0.5, ge=0.0, le=1.0, description="Share of steps over which β ramps from 0")
    refine_fraction: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="Max share of true tokens committed in refinement training (trains K > 1 steps; 0 = K = 1 only)",
    )
    steps: int = steps_field(100)
    micro_batch_size: int = micro_batch_field(4, "Samples per step")
    lr: float = lr_field(1e-3, "AdamW learning rate")
    seed: int = seed_field("Seed of data order and noise")
    tune_lora: bool = Field(
        True, description="Train the flow map's LoRA adapters jointly with q(z | prompt), as the paper does"
    )
    lora_lr: float = lr_field(1e-5, "Learning rate of the LoRA adapters when tuned")


class DrafterSpec(Spec):
    """The DFlash block-diffusion drafter trained from the anchors; every field is part of the drafter key."""

    layers: int = Field(1, ge=1, le=64, description="Draft decoder layers (the hidden size is the teacher's)")
    target_layers: tuple[int, ...] | None = Field(
        None,
        description="Teacher layers whose outputs the drafter reads (0-based, 'output of layer k'); "
        "unset = `feature_layers` layers spread over the depth as DFlash does",
    )
    feature_layers: int = Field(
        4, ge=1, le=64, description="How many teacher layers when target_layers is unset"
    )
    block_size: int = Field(
        8, ge=2, le=64, description="Block: the last committed token and block_size-1 masks"
    )
    intermediate_size: int | None = Field(
        None, ge=16, le=131_072, description="MLP width; unset = the teacher's"
    )
    gamma: float = Field(
        4.0,
        gt=0.0,
        le=1000.0,
        description="CE weight of block offset k is exp(-(k-1)/γ) (DFlash: 7 at block 16)",
    )
    blocks_per_sample: int = Field(
        16, ge=1, le=1024, description="Random block starts per response per step (each sees only its prefix)"
    )
    distill: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Weight of the teacher's own next-token distribution (its top tokens, from the anchors' "
        "last layer) in each offset's CE, the rest on the greedy token; 0 = the greedy token alone",
    )
    vocab: Literal["full", "train"] = Field(
        "full",
        description="Draft softmax over the whole vocabulary, or only tokens of the training prompts and "
        "responses (cheap on CPU; a2d's decoder drafts from the same set, engines use the full head)",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Drafter weights (bfloat16 on GPU)")
    steps: int = steps_field(200)
    micro_batch_size: int = micro_batch_field(8, "Responses per step")
    lr: float = lr_field(1e-3, "Peak AdamW learning rate")
    warmup_steps: int = warmup_field(10)
    lr_schedule: LRSchedule = lr_schedule_field()
    weight_decay: float = weight_decay_field()
    max_grad_norm: float = max_grad_norm_field()
    seed: int = seed_field("Seed of initialisation, data order and block starts")
