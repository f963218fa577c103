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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from a2d.models.attention import BidirectionalScan, Scope, attention_masks, position_ids
from a2d.models.teacher import decoder_layers

log = logging.getLogger("a2d")

ROUTER_NAMES = ("router", "gate", "shared_expert_gate")  # MoE routers: never adapted
LINEAR_TYPES = ("Linear", "Linear4bit", "Linear8bitLt")
MASK_TOKEN = "<|mask|>"


def linear_targets(model: nn.Module, only: list[str] | None = None) -> tuple[list[str], int]:
    """Leaf names of the linear projections inside the decoder layers (routers excluded) and their
    count: every one, or those named in `only` (each must name projections of this model)."""
    names, count, found = set(), 0, set()
    for layer in decoder_layers(model):
        for full, module in layer.named_modules():
            leaf = full.rsplit(".", 1)[-1]
            if type(module).__name__ in LINEAR_TYPES and leaf not in ROUTER_NAMES and "lora_" not in full:
                found.add(leaf)
                if only is None or leaf in only:
                    names.add(leaf)
                    count += 1
    if not found:
        raise ValueError(f"no linear projections found in the decoder layers of {type(model).__name__}")
    unknown = sorted(set(only or ()) - found)
    if unknown:
        raise ValueError(
            f"head.lora_targets names {unknown}, which are not projections of {type(model).__name__}'s "
            f"decoder layers: use some of {sorted(found)} (or leave lora_targets empty for all of them)"
        )
    return sorted(names), count


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


def mask_token_id(tok, model: nn.Module) -> tuple[int, bool]:
    """The mask id: the tokenizer's own, an unused embedding row, or a new row. Returns (id, resized)."""
    if tok.mask_token_id is not None:
        return tok.mask_token_id, False
    rows = model.get_input_embeddings().weight.shape[0]
    tok.add_special_tokens({"mask_token": MASK_TOKEN})
    if tok.mask_token_id < rows:
        return tok.mask_token_id, False
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    # The new rows start at zero, not random: the same base then rebuilds bit-identical rows on
    # every load, so checkpoints need not carry the whole embedding matrix (the mask token's input
    # embedding is trained separately, and its output logit is never sampled).
    with torch.no_grad():
        model.get_input_embeddings().weight[rows:] = 0
        out = model.get_output_embeddings()
        if out is not None:
            out.weight[rows:] = 0
    return tok.mask_token_id, True


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


def build_student(
    teacher_dir,
    quantization: str,
    dtype: str,
    device: str,
    lora: dict,
    attention: str,
    linear_attention: str,
    block_size: int,
    adapter_scope: str = "masked",
    gradient_checkpointing: bool = False,
    adapter_dir=None,
    trust_remote_code: bool = False,
) -> Student:
    """Load the teacher from `teacher_dir` (NF4 or `dtype`) and make it a student (see `make_student`).

    NF4 on a device bitsandbytes cannot serve falls back to the unquantized base (bf16 when the
    compute dtype is bf16), with the reason kept in `info.fallback` and logged.
    """
    from a2d.models.teacher import load_teacher, resolve_device

    fallback = nf4_unavailable(resolve_device(device)) if quantization == "nf4" else None
    if fallback is not None:
        log.warning("NF4 is not available (%s); loading the base in %s instead", fallback, dtype)
        quantization = "none"
    model, tok = load_teacher(teacher_dir, dtype, quantization, device, trust_remote_code)
    student = make_student(
        model,
        tok,
        quantization,
        lora,
        attention,
        linear_attention,
        block_size,
        adapter_scope,
        gradient_checkpointing,
        adapter_dir,
    )
    student.info.fallback = fallback
    return student


def nf4_unavailable(device: torch.device) -> str | None:
    """Why bitsandbytes NF4 cannot run on `device`, or None when it can."""
    if device.type not in ("cuda", "cpu", "xpu"):
        return f"bitsandbytes has no 4-bit kernels for {device.type} devices"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # an ImportError, or a failed native-library setup at import time
        return f"bitsandbytes does not load here ({type(exc).__name__}: {exc})"
    return None


def make_student(
    model: nn.Module,
    tok,
    quantization: str,
    lora: dict,
    attention: str,
    linear_attention: str,
    block_size: int,
    adapter_scope: str = "masked",
    gradient_checkpointing: bool = False,
    adapter_dir=None,
) -> Student:
    """Teacher weights + LoRA on every projection (or those `lora["targets"]` names) + mask
    embedding, ready to train (or load an adapter)."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    from a2d.models.teacher import disable_cpu_nf4_packing

    if attention not in ("block", "bidirectional"):
        raise ValueError(f"unknown attention mode {attention!r}: use block or bidirectional")
    if adapter_scope not in ("masked", "all"):
        raise ValueError(f"unknown adapter_scope {adapter_scope!r}: use masked or all")
    disable_cpu_nf4_packing(model, everywhere=True)
    mask_id, resized = mask_token_id(tok, model)
    scope = Scope(masked=adapter_scope == "masked")
    scans = 0
    reverse = linear_attention == "bidirectional"
    for layer in decoder_layers(
        model
    ):  # every Gated DeltaNet layer: decode-cache segments, maybe a reverse scan
        if hasattr(layer, "linear_attn") and not isinstance(layer.linear_attn, BidirectionalScan):
            layer.linear_attn = BidirectionalScan(layer.linear_attn, scope, reverse)
            scans += int(reverse)
    names, expected = linear_targets(model, lora.get("targets"))
    if quantization == "nf4":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if adapter_dir is not None:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    else:
        config = LoraConfig(
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            use_rslora=lora["rslora"],
            target_modules=names,
            bias="none",
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, config)
    lora_layers = [m for _, m in peft_model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0]
    if len(lora_layers) != expected:
        raise RuntimeError(
            f"LoRA matched {len(lora_layers)} modules but the decoder layers hold {expected} projections "
            f"({names}): some projections would silently stay untrained"
        )
    if scope.masked:  # every LoRA delta is gated by the open positions of the current forward
        for layer in lora_layers:
            for b in layer.lora_B.values():
                b.register_forward_hook(scope.lora_hook)
    embed = peft_model.get_input_embeddings()
    mask = MaskEmbedding(embed.weight.float().mean(0), mask_id, scope).to(embed.weight.device)
    embed.register_forward_hook(mask.hook)
    for gate in scan_gates(peft_model.get_base_model()).values():
        gate.requires_grad_(adapter_dir is None)
    info = StudentInfo(mask_id, len(lora_layers), names, scans, quantization, mask_is_new=resized)
    return Student(peft_model, tok, mask, info, scope, attention, block_size)


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
