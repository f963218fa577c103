"""The diffusion student: teacher weights (NF4 or bf16/fp32) + LoRA on every projection + a trained
mask-token embedding, run on the decode state (`a2d.models.attention` says what each position sees).

- `attention: block` (default): the prompt and committed tokens are a causal prefix and the open
  block attends to the prefix and to itself; `bidirectional`: every token sees every token (full
  A2D conversion, no exact cache).
- `adapter_scope: masked` (default): the adapter acts only at open positions, so every prefix
  position computes the base model exactly; `all`: the adapter acts everywhere.
- Hybrid models (Gated DeltaNet layers in qwen3_5) state `linear_attention`: `causal` keeps the
  scan left to right; `bidirectional` adds a reversed scan over the open block through a learned
  per-layer gate initialised at zero, so the untrained student equals the teacher.

Making one from a teacher (LoRA targets, the mask token, NF4) lives in `a2d.models.student_build`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from a2d.models.attention import BidirectionalScan, Scope, attention_masks, position_ids
from a2d.models.teacher import decoder_layers


def has_linear_attention(model: nn.Module) -> bool:
    return any(hasattr(layer, "linear_attn") for layer in decoder_layers(model))


class MaskEmbedding(nn.Module):
    """A trained embedding for the mask token, injected after the (frozen) input embedding at the
    open positions only: a committed token that happens to share the id (a tiny random base can
    predict an unused row) stays the base model's own token."""

    def __init__(self, init: torch.Tensor, mask_id: int, scope: Scope):
        super().__init__()
        self.weight = nn.Parameter(init.detach().clone().float())  # (H,)
        self.mask_id = mask_id
        self.scope = scope

    def hook(self, _module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        ids = inputs[0]  # (B, T)
        opened = self.scope.open
        if opened is None or opened.shape != ids.shape:
            return output  # plain generation: no open positions
        where = (ids == self.mask_id) & opened
        return torch.where(where[..., None], self.weight.to(output.dtype), output)


@dataclass
class StudentInfo:
    mask_id: int
    lora_modules: int
    target_names: list[str]
    linear_attention_layers: int
    quantization: str
    mask_is_new: bool = (
        False  # the mask id is a row added to the teacher's vocabulary (never a teacher token)
    )
    fallback: str | None = None  # why NF4 was asked for but the base was loaded unquantized


@dataclass(frozen=True)
class DiffusionSpec:
    """What a head's diffusion_spec.json holds: how it was trained, so decoding runs it the same way."""

    mask_id: int
    attention: str  # "block" | "bidirectional"
    adapter_scope: str  # "masked" | "all"
    linear_attention: str  # "causal" | "bidirectional" | "n/a" (no linear-attention layers)
    linear_attention_layers: int
    logit_alignment: str  # "shifted" | "aligned"
    block_size: int
    teacher_key: str
    quantization: str
    lora_modules: int
    lora_targets: tuple[str, ...]
    steps: int
    quantization_fallback: str | None = None

    @classmethod
    def from_json(cls, doc: dict) -> DiffusionSpec:
        """Read diffusion_spec.json; a missing field is named (the head predates it: rebuild it)."""
        from dataclasses import fields

        required = [f.name for f in fields(cls) if f.name != "quantization_fallback"]
        absent = [name for name in required if name not in doc]
        if absent:
            raise ValueError(f"diffusion_spec.json lacks {absent}: rebuild the head with this a2d version")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        return cls(**{**values, "lora_targets": tuple(values["lora_targets"])})

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "lora_targets": list(self.lora_targets)}

    @property
    def shifted(self) -> bool:
        return self.logit_alignment == "shifted"


@dataclass
class Student:
    model: nn.Module  # PeftModel (or the plain causal LM of `plain_view`)
    tok: object
    mask: MaskEmbedding | None
    info: StudentInfo
    scope: Scope
    attention: str  # "block" | "bidirectional"
    block_size: int

    @property
    def inner(self) -> nn.Module:
        """The CausalLM with the LoRA layers injected (a plain view's model itself)."""
        get = getattr(self.model, "get_base_model", None)
        return get() if get is not None else self.model

    @property
    def hybrid(self) -> bool:
        return has_linear_attention(self.inner)

    def extras(self) -> dict[str, torch.Tensor]:
        """Trained tensors outside the LoRA adapter: the mask embedding and the scan gates."""
        return {"mask_embedding": self.mask.weight, **scan_gates(self.inner)}

    def load_extras(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.mask.weight.copy_(tensors["mask_embedding"])
            for name, gate in scan_gates(self.inner).items():
                if name in tensors:
                    gate.copy_(tensors[name])

    @contextlib.contextmanager
    def base(self) -> Iterator[nn.Module]:
        """The student's base model (adapters off, no open positions): plain causal generation."""
        self.scope.clear()
        with self.model.disable_adapter() if self.mask is not None else contextlib.nullcontext():
            yield self.inner


def plain_view(model: nn.Module, student: Student) -> Student:
    """`model` (a plain attention-only causal LM equal to the student's base: see `base_is`) in the
    student's decode layout, with no adapter to gate: a verify forward with no open rows, without
    PEFT's wrappers around every projection. Its logits have no added mask row, so none is ever
    emitted. (A hybrid's cache rollback needs the student's scan wrappers: not for hybrids.)"""
    info = StudentInfo(student.info.mask_id, 0, [], student.info.linear_attention_layers, "none")
    return Student(model, student.tok, None, info, Scope(masked=True), "block", student.block_size)


def base_is(student: Student, model: nn.Module) -> bool:
    """Whether the student's base (adapters off) is `model` itself (the teacher it was built from):
    unquantized weights in that model's dtype, so both compute the same greedy tokens."""
    return student.info.quantization == "none" and compute_dtype(student.inner) == compute_dtype(model)


def scan_gates(model: nn.Module) -> dict[str, nn.Parameter]:
    """The reverse-scan gates of a student's layers, named `scan_gate.<layer>`."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        scan = getattr(layer, "linear_attn", None)
        if isinstance(scan, BidirectionalScan) and scan.gate is not None:
            out[f"scan_gate.{i}"] = scan.gate
    return out


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The float dtype masks are built in (NF4 weights report uint8: use fp32 then)."""
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32


def student_forward(
    student: Student,
    input_ids: torch.Tensor | None,
    pad: torch.Tensor,
    open_: torch.Tensor,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    segments: list[int] | None = None,
    past_pad: torch.Tensor | None = None,
    tree=None,
) -> torch.Tensor:
    """Final-norm hidden states (B, T, H) of one student forward over T new tokens.

    pad (B, T) marks real tokens (rows left-padded); open_ (B, T) the open positions, a suffix of
    each row. With `cache` (a transformers Cache holding the committed prefix), the T tokens follow
    the cached ones and the cache is updated: the caller crops what must not stay. `segments` (with
    a cache) are the lengths of the clean prefix's parts after which linear-attention states are
    saved for a rollback (see `BidirectionalScan`). `past_pad` (B, past) marks the real tokens of a
    left-padded cached prefix (training computes the prefix once without grad, then the open block).
    `tree` (an `a2d.models.attention.Tree`, decoding) lays the open region out as several runs.
    """
    inner = student.inner
    past = cache.get_seq_length() if cache is not None else 0
    mode = student.attention
    if mode == "bidirectional":
        window = pad.shape[1]
        open_ = pad.bool()
    else:
        window = int(open_.sum(1).max()) if open_.numel() else 0
    gate = (
        open_.to(compute_dtype(inner)) if student.scope.masked else torch.ones_like(pad, dtype=torch.float32)
    )
    runs = tree.runs if tree is not None and cache is not None else None
    student.scope.set(open_, window, gate, segments if cache is not None else None, runs)
    mask = attention_masks(pad, open_, mode, compute_dtype(inner), past, student.hybrid, past_pad, tree)
    positions = position_ids(pad, past if past_pad is None else past_pad.long().sum(1, keepdim=True))
    if tree is not None:
        positions = tree.positions.to(pad.device) + past
    decoder = getattr(inner, inner.base_model_prefix)
    out = decoder(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=cache is not None,
    )
    return out.last_hidden_state


def lm_head(student: Student) -> nn.Module:
    return student.inner.get_output_embeddings()


def lora_parameters(student: Student) -> dict[str, torch.nn.Parameter]:
    """The student's LoRA parameters by name."""
    return {n: p for n, p in student.model.named_parameters() if "lora_" in n}


def apply_lora(lora: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved LoRA tensors into the student's parameters; the names must match exactly."""
    if set(tensors) != set(lora):
        missing, extra = sorted(set(lora) - set(tensors))[:3], sorted(set(tensors) - set(lora))[:3]
        raise ValueError(
            f"saved LoRA tensors do not fit this student (missing {missing}, unexpected {extra}); "
            "they were trained on another head: rerun the stage that saved them"
        )
    with torch.no_grad():
        for name, t in tensors.items():
            lora[name].copy_(t.to(lora[name].device, lora[name].dtype))
