"""The registry of named decoders: one name, one decoding, wherever it is asked for.

A name is `family:arg`. The eval stage, the lm-eval model (`sampler=NAME`), `a2d generate
--decoder NAME` and benchmarks/decode.py all build decoders here, so one name gives one token
sequence through all four (a test checks it).

| name | lossless | needs | what it does |
|---|---|---|---|
| `ar:greedy` | reference | teacher | the teacher, greedy, KV cache |
| `ar:student-base` | yes | head | the student's base (adapters off), greedy, KV cache |
| `ar:prompt-lookup` | yes | head | n-gram lookup drafts verified by the base (a2d's loop: any architecture) |
| `hf:prompt-lookup` | yes | head, attention-only base | transformers' prompt-lookup decoding on the base |
| `spec:head` | yes | block/masked head | the head's mask runs draft, the base verifies, same forward |
| `spec:head+lookup` | yes | block/masked head | the head's runs and n-gram lookup, the better per forward |
| `spec:vfm` | yes | vfm | the VFM's one-step block drafts, the base verifies |
| `spec:model` | yes | a draft model | an external causal LM drafts greedily, the base verifies |
| `spec:drafter` | yes | drafter | the DFlash drafter drafts a block from the verify forward's layer outputs |
| `spec:drafter+lookup` | yes | drafter | the drafter's tree and n-gram lookup in one tree, fed as far as measured acceptance pays for a forward's measured cost (`a2d.models.adaptive`); the default where a drafter exists |
| `threshold:P` | no | head | block decoding, commit positions with confidence >= P |
| `entropy:H` | no | head | block decoding, commit positions with entropy <= H (d3LLM) |
| `head:k1` | no | head | a whole block per forward (threshold 0) |
| `vfm:kN` | no | vfm | the VFM in N flow-map steps |
| `untrained:k1` | no | head | `head:k1` with a fresh adapter (the baseline training must beat) |

Lossless means token-identical to the student's base (greedy); with an unquantized base that is
the teacher. How many drafts and masks a speculative forward is fed follows the device's measured
forward cost (`Profile`): on a CPU a forward's cost grows with what it is fed, so few.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from a2d.models.adaptive import DrafterLookup, forward_cost
from a2d.models.ar import ar_decode, hf_prompt_lookup
from a2d.models.block_decode import Decoded, OnStep, threshold_decode
from a2d.models.speculative import (
    DFlashDrafter,
    HeadDrafter,
    HeadLookupDrafter,
    LookupDrafter,
    ModelDrafter,
    VFMDrafter,
    speculative_decode,
)
from a2d.models.student import Student, base_is, plain_view
from a2d.models.vfm import vfm_generate

Decoder = Callable[[list[int]], Decoded]  # prompt ids -> tokens and counts


@dataclass(frozen=True)
class Profile:
    """What one speculative forward is fed: masks per open run, drafts per forward, lookup n-gram.

    cpu: measured on the demo (SmolLM2-135M, 2 cores): drafts past the 2nd were almost never
    reached and a forward's cost grows with its tokens, so 2 masks per run. gpu: a forward of a few
    dozen tokens costs what one costs, so the head's whole block.
    """

    masks: int
    draft_len: int
    ngram: int = 3
    lookup_len: int = 4
    tree_nodes: int = 0  # spec:drafter: drafts per verify as a tree (0: one chain of block - 1)


PROFILES = {
    "cpu": Profile(masks=2, draft_len=4, lookup_len=4, tree_nodes=10),
    "gpu": Profile(masks=16, draft_len=16, lookup_len=10, tree_nodes=32),
}


ADAPTIVE_LOOKUP_LEN = 8  # lookup drafts spec:drafter+lookup may feed: its measured rates decide how many


def profile_for(device: str) -> Profile:
    return PROFILES["cpu" if str(device).startswith("cpu") else "gpu"]


@dataclass(frozen=True)
class DecoderInfo:
    name: str
    family: str
    arg: str
    lossless: bool
    needs: tuple[str, ...]  # "teacher", "head", "spec-head", "vfm", "draft-model", "attention-only"


FAMILIES: dict[str, tuple[bool, tuple[str, ...]]] = {
    "ar:greedy": (True, ("teacher",)),
    "ar:student-base": (True, ("head",)),
    "ar:prompt-lookup": (True, ("head",)),
    "hf:prompt-lookup": (True, ("head", "attention-only")),
    "spec:head": (True, ("spec-head",)),
    "spec:head+lookup": (True, ("spec-head",)),
    "spec:vfm": (True, ("spec-head", "vfm")),
    "spec:model": (True, ("head", "draft-model")),
    "spec:drafter": (True, ("head", "drafter")),
    "spec:drafter+lookup": (True, ("head", "drafter")),
    "threshold": (False, ("head",)),
    "entropy": (False, ("head",)),
    "head:k1": (False, ("head",)),
    "vfm": (False, ("vfm",)),
    "untrained:k1": (False, ("head",)),
}


def default_decoder(res: Resources) -> str:
    """The lossless decoder a user gets unless they name one: the drafter's tree with n-gram lookup
    where a drafter exists, else the head's drafts with lookup, else the base alone."""
    if res.drafter is not None:
        return "spec:drafter+lookup"
    return "spec:head+lookup" if res.can_verify() else "ar:student-base"


def describe(name: str) -> DecoderInfo:
    """What a decoder name means; a clear error for a name the registry does not know."""
    family, _, arg = name.partition(":")
    if name in FAMILIES:
        return DecoderInfo(name, family, arg, *FAMILIES[name])
    if family in FAMILIES and arg:
        try:
            value = float(arg.removeprefix("k")) if family == "vfm" else float(arg)
        except ValueError:
            value = None
        if value is not None and (
            family != "vfm" or (arg.startswith("k") and value.is_integer() and value >= 1)
        ):
            return DecoderInfo(name, family, arg, *FAMILIES[family])
    known = ", ".join(n if ":" in n else f"{n}:<value>" for n in FAMILIES).replace("vfm:<value>", "vfm:k<N>")
    raise ValueError(f"unknown decoder {name!r}: use one of {known}")


@dataclass
class Resources:
    """What decoders are built from; a decoder that needs what is missing is refused by name."""

    student: Student
    eos: list[int]
    max_new_tokens: int
    device: str = "cpu"
    teacher: nn.Module | None = None
    vfm: tuple[Any, Student] | None = None  # (noise adapter, flow map)
    draft_model: nn.Module | None = None
    drafter: nn.Module | None = None  # a DFlash drafter (a2d.models.drafter) for this teacher
    untrained: Callable[[], Student] | None = None
    pad_id: int | None = None
    profile: Profile | None = None
    logit_alignment: str = "shifted"  # the head's (DiffusionSpec.logit_alignment)
    _untrained: Student | None = field(default=None, repr=False)

    @property
    def shifted(self) -> bool:
        return self.logit_alignment == "shifted"

    def can_verify(self) -> bool:
        s = self.student
        return s.attention == "block" and s.scope.masked and self.shifted


def missing(info: DecoderInfo, res: Resources) -> str | None:
    """Why `res` cannot build the decoder, or None."""
    for need in info.needs:
        if need == "teacher" and res.teacher is None:
            return "needs the teacher"
        if need == "spec-head" and not res.can_verify():
            return (
                "needs a head with attention: block, adapter_scope: masked and shifted logits "
                "(the base verifies in its forward)"
            )
        if need == "vfm" and res.vfm is None:
            return "needs a vfm artifact"
        if need == "draft-model" and res.draft_model is None:
            return "needs a draft model"
        if need == "drafter" and res.drafter is None:
            return "needs a drafter artifact (the drafter stage)"
        if need == "attention-only" and res.student.hybrid:
            return (
                "transformers refuses prompt lookup on stateful (hybrid) models; ar:prompt-lookup runs there"
            )
        if need == "head" and info.family == "untrained" and res.untrained is None:
            return "needs the teacher directory to build an untrained student"
    return None


def build(name: str, res: Resources, on_step: OnStep | None = None) -> Decoder:
    """The decoder `name` over `res`; ValueError naming what is missing when it cannot be built."""
    info = describe(name)
    why = missing(info, res)
    if why:
        raise ValueError(f"decoder {name} {why}")
    s, n, eos = res.student, res.max_new_tokens, res.eos
    prof = res.profile or profile_for(res.device)
    banned = s.info.mask_id if s.info.mask_is_new else None

    # drafters that need no adapter verify on the teacher itself where it is the student's base: the
    # same tokens, without PEFT's wrapper around every projection (attention-only: a hybrid's rollback
    # points come from the student's scan wrappers)
    plain = res.teacher is not None and not s.hybrid and base_is(s, res.teacher)
    verifier = plain_view(res.teacher, s) if plain else s

    def spec(
        drafter_factory, student: Student = s, draft_len: int = max(prof.draft_len, prof.lookup_len)
    ) -> Decoder:
        return lambda p: speculative_decode(
            student, p, n, eos, drafter_factory(), on_step=on_step, draft_len=draft_len
        )

    def threshold(student_of: Callable[[], Student], t: float, criterion: str = "confidence") -> Decoder:
        return lambda p: threshold_decode(
            student_of(), p, n, t, eos, res.logit_alignment, criterion, on_step=on_step
        )

    def base(p: list[int]) -> Decoded:
        with s.base() as model:
            return ar_decode(model, p, n, eos, banned)

    def hf_lookup(p: list[int]) -> Decoded:
        with s.base() as model:
            return hf_prompt_lookup(model, p, n, eos, res.pad_id, prof.lookup_len)

    family, arg = info.family, info.arg
    if name == "ar:greedy":
        return lambda p: ar_decode(res.teacher, p, n, eos)
    if name == "ar:student-base":
        return base
    if name == "ar:prompt-lookup":
        return spec(lambda: LookupDrafter(prof.ngram, prof.lookup_len), verifier)
    if name == "hf:prompt-lookup":
        return hf_lookup
    if name == "spec:head":
        return spec(lambda: HeadDrafter(s, prof.masks))
    if name == "spec:head+lookup":
        return spec(lambda: HeadLookupDrafter(s, prof.masks, prof.ngram, prof.lookup_len))
    if name == "spec:vfm":
        adapter, flow_map = res.vfm
        return spec(lambda: VFMDrafter(flow_map, adapter, s.block_size, res.shifted))
    if name == "spec:model":
        return spec(lambda: ModelDrafter(res.draft_model, prof.draft_len), verifier)
    if name == "spec:drafter":
        nodes = max(res.drafter.config.block_size - 1, prof.tree_nodes)
        return spec(lambda: DFlashDrafter(verifier, res.drafter, prof.tree_nodes), verifier, nodes)
    if name == "spec:drafter+lookup":
        nodes = max(res.drafter.config.block_size - 1, prof.tree_nodes)

        # the verify forward's cost is timed here, once per model (about 1.5 s of forwards), so no
        # decode's time includes it: in a 9-prompt eval it was 15 % of the decoder's tokens/s
        cost = forward_cost(verifier)

        def adaptive() -> DrafterLookup:
            return DrafterLookup(verifier, res.drafter, cost, nodes, prof.ngram, ADAPTIVE_LOOKUP_LEN)

        return spec(adaptive, verifier, nodes)
    if family == "threshold":
        return threshold(lambda: s, float(arg))
    if family == "entropy":
        return threshold(lambda: s, float(arg), "entropy")
    if name == "head:k1":
        return threshold(lambda: s, 0.0)
    if name == "untrained:k1":

        def untrained() -> Student:
            if res._untrained is None:
                res._untrained = res.untrained()
            return res._untrained

        return threshold(untrained, 0.0)
    if family == "vfm":
        adapter, flow_map = res.vfm
        k, length = int(arg.removeprefix("k")), min(n, adapter.config["max_len"])
        return lambda p: Decoded(*vfm_generate(flow_map, adapter, p, length, k, eos, res.shifted), [])
    raise AssertionError(f"registry entry {name} has no builder")  # describe() let through a family unbuilt
