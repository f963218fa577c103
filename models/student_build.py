"""Making a student from a teacher: LoRA on every projection (routers excluded), the mask token's
id and embedding, the hybrid layers' scan wrappers, NF4 where bitsandbytes can serve it.

`build_student` loads the teacher from its directory; `make_student` converts a loaded model (the
27B GPU benchmarks build theirs from random weights). What a student is and how it runs a forward
live in `a2d.models.student`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from a2d.models.attention import BidirectionalScan, Scope
from a2d.models.student import MaskEmbedding, Student, StudentInfo, scan_gates
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
