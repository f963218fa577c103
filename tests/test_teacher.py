"""teacher stage: every source materialises a loadable HF directory whose key tracks its content."""

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5Config, Qwen3_5TextConfig

from a2d.flows.teacher import teacher_flow
from a2d.models.teacher import (
    build_random_teacher,
    byte_tokenizer,
    copy_pretrained,
    decoder_layers,
    load_teacher,
    with_top_level_rope_theta,
)
from a2d.specs import TeacherSpec
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks import teacher as stage


def test_random_qwen3_5_has_the_real_hybrid_layout(tiny_store):
    store = ArtifactStore(tiny_store)
    ref = store.ref("teacher", stage.key_inputs(TeacherSpec()).key)
    manifest = store.manifest(ref)
    arch = manifest["metrics"]["architecture"]
    assert arch["model_type"].startswith("qwen3_5") and arch["layers"] == 64
    assert arch["layer_types"] == {"full_attention": 16, "linear_attention": 48}
    model, tok = load_teacher(stage.local_dir(store, ref))
    assert len(decoder_layers(model)) == 64
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>user"
    )


def test_random_llama_is_deterministic_per_seed(tmp_path):
    build_random_teacher("llama", 2, 32, 7, tmp_path / "a", "float32")
    build_random_teacher("llama", 2, 32, 7, tmp_path / "b", "float32")
    build_random_teacher("llama", 2, 32, 8, tmp_path / "c", "float32")
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_local_source_key_follows_content(tmp_path):
    src = tmp_path / "src"
    build_random_teacher("llama", 2, 32, 0, src, "float32")
    spec = TeacherSpec(source="local", path=str(src))
    key = stage.key_inputs(spec).key
    ref = teacher_flow(spec, str(tmp_path / "store"))
    assert ref.key == key
    model, _ = load_teacher(stage.local_dir(ArtifactStore(str(tmp_path / "store")), ref))
    assert model.config.num_hidden_layers == 2
    (src / "config.json").write_text(
        (src / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
    )
    assert stage.key_inputs(spec).key != key
    with pytest.raises(ValueError, match="not a model directory"):
        stage.key_inputs(TeacherSpec(source="local", path=str(tmp_path / "nope")))


def test_hub_source_loads_a_pinned_revision_from_the_hub_cache(tmp_path, monkeypatch):
    """The real hub code path (repo id + revision), served offline from a hub-layout cache."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--a2d--tiny-llama" / "snapshots" / revision
    build_random_teacher("llama", 2, 32, 3, snapshot, "float32")
    (tmp_path / "hub" / "models--a2d--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--a2d--tiny-llama" / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = TeacherSpec(source="hub", repo_id="a2d/tiny-llama", revision=revision)
    store = ArtifactStore(str(tmp_path / "store"))
    ref = teacher_flow(spec, str(tmp_path / "store"))
    out = stage.local_dir(store, ref)
    assert (out / "model.safetensors").read_bytes() == (snapshot / "model.safetensors").read_bytes()
    with pytest.raises(ValidationError, match="pinned teacher.revision"):
        TeacherSpec(source="hub", repo_id="a2d/tiny-llama")  # a revision is required


def test_nf4_teacher_loads_and_runs(tiny_store):
    store = ArtifactStore(tiny_store)
    path = stage.local_dir(store, store.ref("teacher", stage.key_inputs(TeacherSpec()).key))
    model, _ = load_teacher(path, quantization="nf4", device="cpu")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


@pytest.mark.slow
def test_smollm2_gguf_converts_once_into_the_store(tmp_path):
    spec = TeacherSpec(source="smollm2")
    store = ArtifactStore(str(tmp_path))
    ref = teacher_flow(spec, str(tmp_path))
    arch = store.manifest(ref)["metrics"]["architecture"]
    assert (arch["model_type"], arch["layers"], arch["hidden"], arch["vocab_size"]) == (
        "llama",
        30,
        576,
        49152,
    )
    out = stage.local_dir(store, ref)
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in out.iterdir())
    assert teacher_flow(spec, str(tmp_path)) == ref  # reused, not converted again


# rope_theta unlike every class default (llama, qwen3: 10000; the DFlash drafter's: 1e6), so a reader
# that fell back to its default would fail.
ROPE_THETA = 100_000.0


def teacher_with_rope_theta(tmp_path: Path) -> Path:
    """A 2-layer llama saved by transformers alone (rope_theta only inside rope_parameters),
    materialised as a teacher through the local-copy path."""
    src, out = tmp_path / "src", tmp_path / "teacher"
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    LlamaForCausalLM(config).save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    copy_pretrained(str(src), out, "float32", False, None)
    return out


def rope_theta_readings(folder: Path, config_class) -> dict[str, float]:
    """rope_theta as each reader sees config.json: transformers 5 (from the file, from the dict) and a
    4.x reader, which knows only the top-level key (emulated: the dict without rope_parameters)."""
    doc = json.loads((folder / "config.json").read_text())
    without = {k: v for k, v in doc.items() if k != "rope_parameters"}
    return {
        "from_pretrained": config_class.from_pretrained(folder).rope_parameters["rope_theta"],
        "from_dict": config_class.from_dict(doc).rope_parameters["rope_theta"],
        "json top level": doc.get("rope_theta"),
        "json rope_parameters": doc["rope_parameters"]["rope_theta"],
        "without rope_parameters": config_class.from_dict(without).rope_parameters["rope_theta"],
    }


def test_a_teacher_config_carries_rope_theta_in_both_spellings(tmp_path):
    readings = rope_theta_readings(teacher_with_rope_theta(tmp_path), LlamaConfig)
    assert readings == dict.fromkeys(readings, ROPE_THETA)
    for arch in ("llama", "qwen3_5"):  # the random teachers write through the same helper
        build_random_teacher(arch, 2, 32, 0, tmp_path / arch, "float32")
        doc = json.loads((tmp_path / arch / "config.json").read_text())
        assert doc["rope_theta"] == doc["rope_parameters"]["rope_theta"]


def test_a_nested_text_config_gets_rope_theta_beside_its_own_rope_parameters():
    """Qwen3.5's composite config keeps the decoder's fields (and its rope) in text_config."""
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.25}
    doc = with_top_level_rope_theta(Qwen3_5Config(text_config={"rope_parameters": rope}).to_dict())
    text = doc["text_config"]
    assert text["rope_theta"] == text["rope_parameters"]["rope_theta"] == 5_000_000.0
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert "rope_theta" not in doc  # the composite level has no rope of its own
    without = {k: v for k, v in text.items() if k != "rope_parameters"}
    assert Qwen3_5TextConfig.from_dict(without).rope_parameters["rope_theta"] == 5_000_000.0
