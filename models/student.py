"""The diffusion student: teacher weights (NF4 or bf16/fp32) + LoRA on every projection + a trained
mask-token embedding, run with an explicit attention mode.

Attention modes (DESIGN §3 head):
- `bidirectional`: every token sees every real token.
- `block`: bidirectional inside a block of `block_size` tokens, causal across blocks (BD3LM-style).
Hybrid models (Gated DeltaNet layers in qwen3_5) also state `linear_attention`:
- `causal`: the recurrent scan stays left-to-right (a token sees later tokens only through the
  full-attention layers).
- `bidirectional`: the scan also runs over the reversed sequence (inside each block in `block`
  mode) and adds it through a learned per-layer gate initialised at zero, so the untrained student
  equals the teacher.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from a2d.models.teacher import decoder_layers

log = logging.getLogger("a2d")

ROUTER_NAMES = ("router", "gate", "shared_expert_gate")  # MoE routers: never adapted
LINEAR_TYPES = ("Linear", "Linear4bit", "Linear8bitLt")
MASK_TOKEN = "<|mask|>"


def linear_targets(model: nn.Module) -> tuple[list[str], int]:
    """Leaf names of every linear projection inside the decoder layers (routers excluded) and their count."""
    names, count = set(), 0
    for layer in decoder_layers(model):
        for full, module in layer.named_modules():
            leaf = full.rsplit(".", 1)[-1]
            if type(module).__name__ in LINEAR_TYPES and leaf not in ROUTER_NAMES and "lora_" not in full:
                names.add(leaf)
                count += 1
    if not names:
        raise ValueError(f"no linear projections found in the decoder layers of {type(model).__name__}")
    return sorted(names), count


def has_linear_attention(model: nn.Module) -> bool:
    return any(hasattr(layer, "linear_attn") for layer in decoder_layers(model))


class BidirectionalScan(nn.Module):
    """Wraps a causal linear-attention module: forward scan + tanh(gate) · reversed scan."""

    def __init__(self, inner: nn.Module, block_size: int | None):
        super().__init__()
        self.inner = inner
        self.block_size = block_size
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        fwd = self.inner(hidden_states=hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)
        if self.block_size is None:
            bwd = self.inner(hidden_states=hidden_states.flip(1), cache=None, attention_mask=None).flip(1)
        else:
            b, t, h = hidden_states.shape
            pad = (-t) % self.block_size
            xp = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))  # (B, T', H)
            blocks = xp.reshape(b * (t + pad) // self.block_size, self.block_size, h).flip(1)
            out = self.inner(hidden_states=blocks, cache=None, attention_mask=None).flip(1)
            bwd = out.reshape(b, t + pad, h)[:, :t]
        return fwd + torch.tanh(self.gate).to(fwd.dtype) * bwd


def wrap_linear_attention(model: nn.Module, block_size: int | None) -> int:
    """Make every linear-attention layer bidirectional; returns how many were wrapped."""
    n = 0
    for layer in decoder_layers(model):
        if hasattr(layer, "linear_attn") and not isinstance(layer.linear_attn, BidirectionalScan):
            layer.linear_attn = BidirectionalScan(layer.linear_attn, block_size)
            n += 1
    return n


def attention_mask(
    model: nn.Module, pad_mask: torch.Tensor, mode: str, block_size: int, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The mask for a student forward: a 4D additive mask, or a per-layer-type dict for hybrids.

    pad_mask (B, T) is 1 for real tokens. Full-attention layers get (B, 1, T, T) with 0 where a
    query may attend and the dtype minimum elsewhere; linear-attention layers get the 2D padding mask.
    """
    b, t = pad_mask.shape
    idx = torch.arange(t, device=pad_mask.device)
    if mode == "bidirectional":
        allowed = torch.ones(t, t, dtype=torch.bool, device=pad_mask.device)
    elif mode == "block":
        allowed = (idx[None, :] // block_size) <= (
            idx[:, None] // block_size
        )  # (T, T): key block <= query block
    else:
        raise ValueError(f"unknown attention mode {mode!r}: use bidirectional or block")
    allowed = allowed[None] & pad_mask.bool()[:, None, :]  # (B, T, T)
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=pad_mask.device)[None]  # no empty rows
    full = torch.zeros(b, 1, t, t, dtype=dtype, device=pad_mask.device)
    full.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    if has_linear_attention(model):
        linear = None if bool(pad_mask.all()) else pad_mask
        return {"full_attention": full, "linear_attention": linear}
    return full


class MaskEmbedding(nn.Module):
    """A trained embedding for the mask token, injected after the (frozen) input embedding."""

    def __init__(self, init: torch.Tensor, mask_id: int):
        super().__init__()
        self.weight = nn.Parameter(init.detach().clone().float())  # (H,)
        self.mask_id = mask_id

    def hook(self, _module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        ids = inputs[0]  # (B, T)
        return torch.where((ids == self.mask_id)[..., None], self.weight.to(output.dtype), output)


@dataclass
class StudentInfo:
    mask_id: int
    lora_modules: int
    target_names: list[str]
    linear_attention_layers: int
    quantization: str
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


@dataclass
class Student:
    model: nn.Module  # PeftModel
    tok: object
    mask: MaskEmbedding
    info: StudentInfo

    def extras(self) -> dict[str, torch.Tensor]:
        """Trained tensors outside the LoRA adapter: the mask embedding and the scan gates."""
        out = {"mask_embedding": self.mask.weight}
        for i, layer in enumerate(decoder_layers(self.model.get_base_model())):
            if isinstance(getattr(layer, "linear_attn", None), BidirectionalScan):
                out[f"scan_gate.{i}"] = layer.linear_attn.gate
        return out

    def load_extras(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.mask.weight.copy_(tensors["mask_embedding"])
            for i, layer in enumerate(decoder_layers(self.model.get_base_model())):
                if f"scan_gate.{i}" in tensors:
                    layer.linear_attn.gate.copy_(tensors[f"scan_gate.{i}"])


def build_student(
    teacher_dir,
    quantization: str,
    dtype: str,
    device: str,
    lora: dict,
    attention: str,
    linear_attention: str,
    block_size: int,
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
    gradient_checkpointing: bool = False,
    adapter_dir=None,
) -> Student:
    """Teacher weights + LoRA on every projection + mask embedding, ready to train (or load an adapter)."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    from a2d.models.teacher import disable_cpu_nf4_packing

    disable_cpu_nf4_packing(model, everywhere=True)
    mask_id, _ = mask_token_id(tok, model)
    scans = 0
    if linear_attention == "bidirectional" and has_linear_attention(model):
        scans = wrap_linear_attention(model, block_size if attention == "block" else None)
    names, expected = linear_targets(model)
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
    matched = sum(1 for _, m in peft_model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0)
    if matched != expected:
        raise RuntimeError(
            f"LoRA matched {matched} modules but the decoder layers hold {expected} projections ({names}): "
            "some projections would silently stay untrained"
        )
    embed = peft_model.get_input_embeddings()
    mask = MaskEmbedding(embed.weight.float().mean(0), mask_id).to(embed.weight.device)
    embed.register_forward_hook(mask.hook)
    for layer in decoder_layers(peft_model.get_base_model()):
        if isinstance(getattr(layer, "linear_attn", None), BidirectionalScan):
            layer.linear_attn.gate.requires_grad_(adapter_dir is None)
    info = StudentInfo(mask_id, matched, names, scans, quantization)
    return Student(peft_model, tok, mask, info)


def student_hidden(
    student: Student, input_ids: torch.Tensor, pad_mask: torch.Tensor, attention: str, block_size: int
):
    """Final-norm hidden states (B, T, H) of the student under its attention mode."""
    inner = student.model.get_base_model()  # the CausalLM with LoRA layers injected
    dtype = next(p for p in inner.parameters() if p.is_floating_point()).dtype
    dtype = torch.float32 if dtype not in (torch.float16, torch.bfloat16, torch.float32) else dtype
    mask = attention_mask(inner, pad_mask, attention, block_size, dtype)
    decoder = getattr(inner, inner.base_model_prefix)
    return decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state


def lm_head(student: Student) -> nn.Module:
    return student.model.get_base_model().get_output_embeddings()


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
