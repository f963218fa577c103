"""Trained students read back from the store: the head's student, the VFM's noise adapter and flow map.

The head, VFM, trajectories (diffusion-decode source) and eval stages all decode with these.
"""

from __future__ import annotations

from typing import Any

from safetensors.torch import load_file

from a2d.models.student import Student, apply_lora, build_student, lora_parameters
from a2d.models.vfm import NoiseAdapter
from a2d.specs import HeadSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, cache_root
from a2d.tasks import teacher as teacher_stage

HEAD_SHARD = "adapter"  # the head artifact's one shard: PEFT adapter, extras, diffusion_spec.json
VFM_SHARD = "noise_adapter"  # the vfm artifact's one shard
FLOW_MAP_LORA = "flow_map_lora.safetensors"  # jointly tuned LoRA tensors, by parameter name


def load_student(
    store: ArtifactStore, ref: ArtifactRef, device: str = "cpu"
) -> tuple[Student, dict[str, Any]]:
    """The trained student of a complete head artifact, ready for decoding, and its diffusion spec."""
    manifest = store.manifest(ref)
    dspec = manifest["metrics"]["diffusion_spec"]
    spec = HeadSpec.model_validate(manifest["spec"])
    teacher_ref = store.ref("teacher", manifest["upstream"]["teacher"])
    adapter = store.local_copy(ref, HEAD_SHARD, cache_root())
    # A damaged adapter or teacher file (reused unverified) is named, not a safetensors error.
    with store.reading(ref), store.reading(teacher_ref):
        student = build_student(
            teacher_stage.local_dir(store, teacher_ref),
            spec.quantization,
            spec.dtype,
            device,
            {"rank": spec.lora_rank, "alpha": spec.lora_alpha, "dropout": 0.0, "rslora": spec.rslora},
            spec.attention,
            spec.linear_attention,
            spec.block_size,
            spec.adapter_scope,
            adapter_dir=adapter,
            trust_remote_code=teacher_stage.trusts_remote_code(store, teacher_ref),
        )
        student.load_extras(load_file(adapter / "extras.safetensors"))
    student.model.eval()
    return student, dspec


def load_vfm(store: ArtifactStore, ref: ArtifactRef, device: str = "cpu") -> NoiseAdapter:
    """The noise adapter q(z | prompt) of a complete vfm artifact."""
    with store.reading(ref):
        return NoiseAdapter.from_pretrained(store.local_copy(ref, VFM_SHARD, cache_root())).to(device).eval()


def load_flow_map(
    store: ArtifactStore, ref: ArtifactRef, head_student: Student, device: str = "cpu"
) -> Student:
    """The student that maps [prompt ; z] to tokens for this VFM: the head's own when it was kept
    frozen, else a fresh copy of the head's student carrying the jointly tuned LoRA weights."""
    tuned = store.local_copy(ref, VFM_SHARD, cache_root()) / FLOW_MAP_LORA
    if not tuned.is_file():
        return head_student
    student, _ = load_student(store, store.ref("head", store.manifest(ref)["upstream"]["head"]), device)
    apply_lora(lora_parameters(student), load_file(tuned))
    return student
