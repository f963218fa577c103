"""The decoders' inputs from a store, assembled in one place for every entry point.

The eval stage, `a2d generate`, the lm-eval model and the decode benchmarks all decode with
registry decoders (`a2d.models.decoders`) over a `Resources`. Each used to assemble its own, and
the copies drifted: the lm-eval model left out the head's `logit_alignment`, so a head trained
`aligned` decoded other tokens there than in the eval. `resources_from_store` is the one assembly.
"""

from __future__ import annotations

from typing import NamedTuple

from a2d.models import decoders as registry
from a2d.models.generate import eos_ids
from a2d.models.student import DiffusionSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import teacher as teacher_stage
from a2d.tasks.students import load_drafter, load_flow_map, load_student, load_vfm


class Loaded(NamedTuple):
    res: registry.Resources
    dspec: DiffusionSpec  # the head's diffusion spec (what the report shows)
    tok: object  # the teacher's tokenizer


def resources_from_store(
    store: ArtifactStore,
    refs: dict[str, ArtifactRef],
    max_new_tokens: int,
    device: str = "cpu",
    *,
    teacher: bool = True,
    student=None,
    dspec: DiffusionSpec | None = None,
) -> Loaded:
    """The `Resources` of `refs` (a `head`, optionally its `teacher`, a `drafter` and a `vfm`).

    The head's student and diffusion spec (`logit_alignment` included) are loaded unless given;
    the teacher model is loaded when `teacher` (AR's reference, and the plain verifier of the
    lossless decoders where the student's base is the teacher); the drafter is checked against the
    head's teacher. A missing piece is left None, so a decoder that needs it is refused by name.
    """
    head = refs["head"]
    teacher_ref = refs.get("teacher") or store.ref("teacher", store.manifest(head)["upstream"]["teacher"])
    if student is None:
        student, dspec = load_student(store, head, device)
    elif dspec is None:
        raise ValueError("resources_from_store: a given student needs its dspec too")
    plain = None
    if teacher:
        remote = teacher_stage.trusts_remote_code(store, teacher_ref)
        plain, _ = teacher_stage.tm.load_teacher(
            teacher_stage.local_dir(store, teacher_ref), device=device, trust_remote_code=remote
        )
    vfm = None
    if "vfm" in refs:
        vfm = (load_vfm(store, refs["vfm"], device), load_flow_map(store, refs["vfm"], student, device))
    drafter = load_drafter(store, refs["drafter"], teacher_ref, device) if "drafter" in refs else None
    tok = student.tok
    res = registry.Resources(
        student,
        eos_ids(student.inner, tok),
        max_new_tokens,
        device=device,
        teacher=plain,
        vfm=vfm,
        drafter=drafter,
        pad_id=tok.pad_token_id,
        logit_alignment=dspec.logit_alignment,
    )
    return Loaded(res, dspec, tok)


def refs_for(store: ArtifactStore, head: ArtifactRef, decoder: str) -> dict[str, ArtifactRef]:
    """The artifacts `decoder` reads besides the head: the newest vfm of the head, the newest
    drafter of its teacher, where the decoder needs them."""
    teacher = store.ref("teacher", store.manifest(head)["upstream"]["teacher"])
    refs = {"head": head, "teacher": teacher}
    info = registry.describe(decoder)
    if info.family == "vfm" or "vfm" in info.needs:
        refs["vfm"] = newest_vfm(store, head)
    if "drafter" in info.needs:
        refs["drafter"] = newest_drafter(store, teacher)
    return refs


def needs_teacher(store: ArtifactStore, head: ArtifactRef, decoder: str) -> bool:
    """Whether `decoder` loads the teacher model besides the student: AR's reference needs it, and a
    drafter's verify runs on it where the student's base is the teacher (no PEFT wrappers)."""
    info = registry.describe(decoder)
    unquantized = store.manifest(head)["spec"].get("quantization", "none") == "none"
    return "teacher" in info.needs or ("drafter" in info.needs and unquantized)


def newest_vfm(store: ArtifactStore, head: ArtifactRef) -> ArtifactRef:
    """The newest complete vfm artifact trained on `head`; an error saying what to run when none is."""
    vfms = [
        r
        for r in store.iter_refs("vfm")
        if store.is_complete(r) and store.manifest(r)["upstream"].get("head") == head.key
    ]
    if not vfms:
        raise ValueError(f"no vfm artifact of head {head.key}: run `a2d run CONFIG --until vfm` first")
    return max(vfms, key=lambda r: store.manifest(r)["created"])


def has_drafter(store: ArtifactStore, teacher: ArtifactRef) -> bool:
    try:
        newest_drafter(store, teacher)
    except ValueError:
        return False
    return True


def newest_drafter(store: ArtifactStore, teacher: ArtifactRef) -> ArtifactRef:
    """The newest complete drafter artifact of `teacher`; an error saying what to run when none is."""
    found = [
        r
        for r in store.iter_refs("drafter")
        if store.is_complete(r) and store.manifest(r)["upstream"].get("teacher") == teacher.key
    ]
    if not found:
        raise ValueError(
            f"no drafter artifact of teacher {teacher.key}: run `a2d run CONFIG --until drafter` first"
        )
    return max(found, key=lambda r: store.manifest(r)["created"])
