"""The registry of named decoders: one name, one decoding, wherever it is asked for.

A name is `family:arg`. The eval stage, the lm-eval model (`decoder=NAME`), `a2d generate
--decoder NAME` and benchmarks/decode.py all build decoders here, so one name gives one token
sequence through all four (a test checks it). Each decoder is one `Family` record in `DECODERS`:
`FAMILIES`, `describe`, `missing` and `build` read those records, and a test ties this table to
them (name, lossless, needs).

| name | lossless | needs | what it does |
|---|---|---|---|
| `ar:greedy` | reference | teacher | the teacher, greedy, KV cache |
| `ar:student-base` | yes | head | the student's base (adapters off), greedy, KV cache |
| `spec:lookup` | yes | head | n-gram lookup drafts from the prompt and response, verified by the base (a2d's loop: any architecture); `ar:prompt-lookup` is its former name |
| `hf:prompt-lookup` | yes | head, attention-only | transformers' prompt-lookup decoding on the base |
| `spec:head` | yes | spec-head | the head's mask runs draft, the base verifies, same forward |
| `spec:head+lookup` | yes | spec-head | the head's runs and n-gram lookup, the better per forward |
| `spec:vfm` | yes | spec-head, vfm | the VFM's one-step block drafts, the base verifies |
| `spec:model` | yes | head, draft-model | an external causal LM drafts greedily, the base verifies |
| `spec:drafter` | yes | head, drafter | the DFlash drafter drafts a block from the verify forward's layer outputs |
| `spec:drafter+lookup` | yes | head, drafter | the drafter's tree and n-gram lookup in one tree, fed as far as measured acceptance pays for a forward's measured cost (`a2d.models.adaptive`); the default where a drafter exists |
| `threshold:P` | no | head | block decoding, commit positions with confidence >= P |
| `entropy:H` | no | head | block decoding, commit positions with entropy <= H (d3LLM) |
| `head:k1` | no | head | a whole block per forward (threshold 0) |
| `vfm:kN` | no | vfm | the VFM in N flow-map steps |
| `untrained:k1` | no | head, untrained | `head:k1` with a fresh adapter (the baseline training must beat) |

Needs: `teacher` the teacher model; `head` the head's student (always there); `spec-head` a head
whose forward can verify (block attention, masked scope, shifted logits); `attention-only` a base
without linear-attention layers; `vfm`, `drafter` those artifacts; `draft-model` an external draft
model; `untrained` a way to build a fresh student.

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
from a2d.models.dflash_drafter import DFlashDrafter
from a2d.models.proposals import HeadDrafter, HeadLookupDrafter, LookupDrafter, ModelDrafter, VFMDrafter
from a2d.models.speculative import speculative_decode
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
    name: str  # the registry's name for it (an alias given is read as the name it stands for)
    family: str
    arg: str
    lossless: bool
    needs: tuple[str, ...]  # keys of NEEDS


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


# need -> (whether `Resources` has it, why a decoder that needs it is refused otherwise)
NEEDS: dict[str, tuple[Callable[[Resources], bool], str]] = {
    "teacher": (lambda r: r.teacher is not None, "needs the teacher"),
    "head": (lambda r: True, ""),  # every Resources holds the head's student
    "spec-head": (
        Resources.can_verify,
        "needs a head with attention: block, adapter_scope: masked and shifted logits "
        "(the base verifies in its forward)",
    ),
    "vfm": (lambda r: r.vfm is not None, "needs a vfm artifact"),
    "draft-model": (lambda r: r.draft_model is not None, "needs a draft model"),
    "drafter": (lambda r: r.drafter is not None, "needs a drafter artifact (the drafter stage)"),
    "attention-only": (
        lambda r: not r.student.hybrid,
        "transformers refuses prompt lookup on stateful (hybrid) models; spec:lookup runs there",
    ),
    "untrained": (
        lambda r: r.untrained is not None,
        "needs the teacher directory to build an untrained student",
    ),
}


@dataclass(frozen=True)
class Context:
    """What a family's builder reads: the resources, the device's profile and the verifier."""

    res: Resources
    prof: Profile
    on_step: OnStep | None
    # drafters that need no adapter verify on the teacher itself where it is the student's base:
    # the same tokens, without PEFT's wrapper around every projection (attention-only: a hybrid's
    # rollback points come from the student's scan wrappers)
    verifier: Student

    @property
    def s(self) -> Student:
        return self.res.student

    def spec(
        self, drafter_factory: Callable[[], Any], student: Student | None = None, draft_len: int | None = None
    ) -> Decoder:
        """The speculative loop over `student` (the head's by default), a fresh drafter per prompt."""
        student = self.s if student is None else student
        res, on_step = self.res, self.on_step
        if draft_len is None:
            draft_len = max(self.prof.draft_len, self.prof.lookup_len)
        return lambda p: speculative_decode(
            student, p, res.max_new_tokens, res.eos, drafter_factory(), on_step=on_step, draft_len=draft_len
        )

    def threshold(
        self, student_of: Callable[[], Student], t: float, criterion: str = "confidence"
    ) -> Decoder:
        """Block decoding that commits positions past `t` (confidence, or entropy below it)."""
        res, on_step = self.res, self.on_step
        return lambda p: threshold_decode(
            student_of(), p, res.max_new_tokens, t, res.eos, res.logit_alignment, criterion, on_step=on_step
        )


def _ar_greedy(c: Context, arg: str) -> Decoder:
    res = c.res
    return lambda p: ar_decode(res.teacher, p, res.max_new_tokens, res.eos)


def _student_base(c: Context, arg: str) -> Decoder:
    s, n, eos = c.s, c.res.max_new_tokens, c.res.eos
    banned = s.info.mask_id if s.info.mask_is_new else None

    def base(p: list[int]) -> Decoded:
        with s.base() as model:
            return ar_decode(model, p, n, eos, banned)

    return base


def _lookup(c: Context, arg: str) -> Decoder:
    prof = c.prof
    return c.spec(lambda: LookupDrafter(prof.ngram, prof.lookup_len), c.verifier)


def _hf_lookup(c: Context, arg: str) -> Decoder:
    s, res, prof = c.s, c.res, c.prof

    def hf_lookup(p: list[int]) -> Decoded:
        with s.base() as model:
            return hf_prompt_lookup(model, p, res.max_new_tokens, res.eos, res.pad_id, prof.lookup_len)

    return hf_lookup


def _head(c: Context, arg: str) -> Decoder:
    return c.spec(lambda: HeadDrafter(c.s, c.prof.masks))


def _head_lookup(c: Context, arg: str) -> Decoder:
    prof = c.prof
    return c.spec(lambda: HeadLookupDrafter(c.s, prof.masks, prof.ngram, prof.lookup_len))


def _vfm_drafts(c: Context, arg: str) -> Decoder:
    adapter, flow_map = c.res.vfm
    return c.spec(lambda: VFMDrafter(flow_map, adapter, c.s.block_size, c.res.shifted))


def _model(c: Context, arg: str) -> Decoder:
    return c.spec(lambda: ModelDrafter(c.res.draft_model, c.prof.draft_len), c.verifier)


def _tree_nodes(c: Context) -> int:
    return max(c.res.drafter.config.block_size - 1, c.prof.tree_nodes)


def _drafter(c: Context, arg: str) -> Decoder:
    verifier, drafter, prof = c.verifier, c.res.drafter, c.prof
    return c.spec(lambda: DFlashDrafter(verifier, drafter, prof.tree_nodes), verifier, _tree_nodes(c))


def _drafter_lookup(c: Context, arg: str) -> Decoder:
    verifier, drafter, prof, nodes = c.verifier, c.res.drafter, c.prof, _tree_nodes(c)
    # the verify forward's cost is timed here, once per model (about 1.5 s of forwards), so no
    # decode's time includes it: in a 9-prompt eval it was 15 % of the decoder's tokens/s
    cost = forward_cost(verifier)

    def adaptive() -> DrafterLookup:
        return DrafterLookup(verifier, drafter, cost, nodes, prof.ngram, ADAPTIVE_LOOKUP_LEN)

    return c.spec(adaptive, verifier, nodes)


def _threshold(c: Context, arg: str) -> Decoder:
    return c.threshold(lambda: c.s, float(arg))


def _entropy(c: Context, arg: str) -> Decoder:
    return c.threshold(lambda: c.s, float(arg), "entropy")


def _whole_block(c: Context, arg: str) -> Decoder:
    return c.threshold(lambda: c.s, 0.0)


def _untrained(c: Context, arg: str) -> Decoder:
    res = c.res

    def untrained() -> Student:
        if res._untrained is None:
            res._untrained = res.untrained()
        return res._untrained

    return c.threshold(untrained, 0.0)


def _vfm_steps(c: Context, arg: str) -> Decoder:
    res = c.res
    adapter, flow_map = res.vfm
    k, length = int(arg.removeprefix("k")), min(res.max_new_tokens, adapter.config["max_len"])
    return lambda p: Decoded(*vfm_generate(flow_map, adapter, p, length, k, res.eos, res.shifted), [])


def _number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _steps(arg: str) -> bool:
    """`kN`, N a whole number of flow-map steps >= 1."""
    if not arg.startswith("k") or not _number(arg[1:]):
        return False
    value = float(arg[1:])
    return value.is_integer() and value >= 1


@dataclass(frozen=True)
class Family:
    """One decoder family: its name, whether it is lossless, what it needs and how it is built."""

    name: str  # a whole decoder name ("spec:head"), or the family of `name:ARG` names ("threshold")
    lossless: bool
    needs: tuple[str, ...]  # keys of NEEDS, checked in this order
    build: Callable[[Context, str], Decoder]  # (context, the name's argument) -> decoder
    arg: Callable[[str], bool] | None = None  # the arguments a `name:ARG` family takes; None: one name
    usage: str = ""  # a `name:ARG` family as the docs write it ("threshold:P")
    aliases: tuple[str, ...] = ()  # former names that still mean this decoder

    @property
    def shown(self) -> str:
        return self.usage or self.name


DECODERS: tuple[Family, ...] = (
    Family("ar:greedy", True, ("teacher",), _ar_greedy),
    Family("ar:student-base", True, ("head",), _student_base),
    Family("spec:lookup", True, ("head",), _lookup, aliases=("ar:prompt-lookup",)),
    Family("hf:prompt-lookup", True, ("head", "attention-only"), _hf_lookup),
    Family("spec:head", True, ("spec-head",), _head),
    Family("spec:head+lookup", True, ("spec-head",), _head_lookup),
    Family("spec:vfm", True, ("spec-head", "vfm"), _vfm_drafts),
    Family("spec:model", True, ("head", "draft-model"), _model),
    Family("spec:drafter", True, ("head", "drafter"), _drafter),
    Family("spec:drafter+lookup", True, ("head", "drafter"), _drafter_lookup),
    Family("threshold", False, ("head",), _threshold, _number, "threshold:P"),
    Family("entropy", False, ("head",), _entropy, _number, "entropy:H"),
    Family("head:k1", False, ("head",), _whole_block),
    Family("vfm", False, ("vfm",), _vfm_steps, _steps, "vfm:kN"),
    Family("untrained:k1", False, ("head", "untrained"), _untrained),
)
FAMILIES: dict[str, Family] = {f.name: f for f in DECODERS}
ALIASES: dict[str, str] = {alias: f.name for f in DECODERS for alias in f.aliases}


def default_decoder(res: Resources) -> str:
    """The lossless decoder a user gets unless they name one: the drafter's tree with n-gram lookup
    where a drafter exists, else the head's drafts with lookup, else the base alone."""
    if res.drafter is not None:
        return "spec:drafter+lookup"
    return "spec:head+lookup" if res.can_verify() else "ar:student-base"


def _family(name: str) -> tuple[Family, str, str]:
    """(record, registry name, argument) of a decoder name; a clear error for a name not known."""
    name = ALIASES.get(name, name)
    whole = FAMILIES.get(name)
    if whole is not None and whole.arg is None:
        return whole, name, name.partition(":")[2]
    family, _, arg = name.partition(":")
    record = FAMILIES.get(family)
    if record is not None and record.arg is not None and arg and record.arg(arg):
        return record, name, arg
    known = ", ".join(f.shown for f in DECODERS)
    raise ValueError(f"unknown decoder {name!r}: use one of {known} (P, H: numbers; N: steps >= 1)")


def describe(name: str) -> DecoderInfo:
    """What a decoder name means; a clear error for a name the registry does not know."""
    record, name, arg = _family(name)
    return DecoderInfo(name, name.partition(":")[0], arg, record.lossless, record.needs)


def missing(info: DecoderInfo, res: Resources) -> str | None:
    """Why `res` cannot build the decoder, or None."""
    for need in info.needs:
        has, why = NEEDS[need]
        if not has(res):
            return why
    return None


def build(name: str, res: Resources, on_step: OnStep | None = None) -> Decoder:
    """The decoder `name` over `res`; ValueError naming what is missing when it cannot be built."""
    record, _, arg = _family(name)
    why = missing(describe(name), res)
    if why:
        raise ValueError(f"decoder {name} {why}")
    s = res.student
    plain = res.teacher is not None and not s.hybrid and base_is(s, res.teacher)
    verifier = plain_view(res.teacher, s) if plain else s
    context = Context(res, res.profile or profile_for(res.device), on_step, verifier)
    return record.build(context, arg)
