"""Trained students read back from the store: the head's student, the VFM's noise adapter and flow map.

The head, VFM, trajectories (diffusion-decode source) and eval stages all decode with these.
"""

from __future__ import annotations

import json

from safetensors.torch import load_file

from a2d.models import cpu_kernels, fast_lora
from a2d.models.drafter import DFlashDraftModel
from a2d.models.student import DiffusionSpec, Student, apply_lora, lora_parameters
from a2d.models.student_build import build_student
from a2d.models.vfm import NoiseAdapter
from a2d.specs import HeadSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore, cache_root
from a2d.tasks import teacher as teacher_stage

HEAD_SHARD = "adapter"  # the head artifact's one shard: PEFT adapter, extras, diffusion_spec.json
VFM_SHARD = "noise_adapter"  # the vfm artifact's one shard
DRAFTER_SHARD = "drafter"  # the drafter artifact's one shard: a DFlash checkpoint directory
DRAFTER_PROVENANCE = "drafter_spec.json"  # beside it: the spec and the teacher key it was trained for
FLOW_MAP_LORA = "flow_map_lora.safetensors"  # jointly tuned LoRA tensors, by parameter name


def head_student(
    teacher_dir,
    spec: HeadSpec,
    device: str,
    trust_remote_code: bool,
    adapter_dir=None,
    dropout: float | None = None,
    rank: int | None = None,
    gradient_checkpointing: bool = False,
) -> Student:
    """The one place a head's student is built from its spec: for training (fresh adapter), for
    decoding (`adapter_dir`, dropout 0) and for the eval's untrained baseline (`rank`)."""
    lora = {
        "rank": rank or spec.lora_rank,
        "alpha": rank or spec.lora_alpha,
        "dropout": spec.lora_dropout if dropout is None else dropout,
        "rslora": spec.rslora,
        "targets": spec.lora_targets or None,
    }
    return build_student(
        teacher_dir,
        spec.quantization,
        spec.dtype,
        device,
        lora,
        spec.attention,
        spec.linear_attention,
        spec.block_size,
        spec.adapter_scope,
        gradient_checkpointing,
        adapter_dir=adapter_dir,
        trust_remote_code=trust_remote_code,
    )


def load_student(
    store: ArtifactStore, ref: ArtifactRef, device: str = "cpu"
) -> tuple[Student, DiffusionSpec]:
    """The trained student of a complete head artifact, ready for decoding, and its diffusion spec.

    Under `adapter_scope: masked` its LoRA runs the lean decode path (`a2d.models.fast_lora`).
    """
    manifest = store.manifest(ref)
    dspec = DiffusionSpec.from_json(manifest["metrics"]["diffusion_spec"])
    spec = HeadSpec.model_validate(manifest["spec"])
    teacher_ref = store.ref("teacher", manifest["upstream"]["teacher"])
    adapter = store.local_copy(ref, HEAD_SHARD, cache_root())
    # A damaged adapter or teacher file (reused unverified) is named, not a safetensors error.
    with store.reading(ref), store.reading(teacher_ref):
        remote = teacher_stage.trusts_remote_code(store, teacher_ref)
        student = head_student(
            teacher_stage.local_dir(store, teacher_ref),
            spec,
            device,
            remote,
            adapter_dir=adapter,
            dropout=0.0,
        )
        student.load_extras(load_file(adapter / "extras.safetensors"))
    student.model.eval()
    if student.scope.masked:
        fast_lora.install(student.model, student.scope)
    cpu_kernels.pack(student.model)  # decoding feeds a few rows per forward: oneDNN on the CPU
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


def load_drafter(
    store: ArtifactStore, ref: ArtifactRef, teacher: ArtifactRef, device: str = "cpu"
) -> DFlashDraftModel:
    """The DFlash drafter of a complete drafter artifact, refused when it was trained for another teacher."""
    with store.reading(ref):
        folder = store.local_copy(ref, DRAFTER_SHARD, cache_root())
        provenance = json.loads((folder / DRAFTER_PROVENANCE).read_text())
        if provenance["teacher_key"] != teacher.key:
            raise ValueError(
                f"drafter {ref.key} was trained for teacher {provenance['teacher_key']}, not {teacher.key}: "
                "rebuild the drafter stage for this teacher"
            )
        drafter = DFlashDraftModel.load(folder, device)
    cpu_kernels.pack(drafter)
    return drafter
