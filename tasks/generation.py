"""Generation from a trained head in the store, for `a2d generate`: one prompt, streamed, counted."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from a2d.models.generate import eos_ids, generate_batch
from a2d.models.sampler import Decoded, speculative_decode, threshold_decode
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks.students import load_student

SAMPLERS = ("spec", "threshold", "ar")


@dataclass
class Generation:
    text: str
    tokens: list[int]
    forwards: int
    seconds: float
    steps: list[list[int]] = field(default_factory=list)  # per forward, the response positions it committed
    pieces: list[str] = field(default_factory=list)  # per response position, its text

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def find_head(store: ArtifactStore, key: str | None) -> ArtifactRef:
    """The head `key` names (a unique prefix), or the newest complete head; errors say what to run."""
    if key:
        try:
            ref = store.find(f"head/{key}")
        except KeyError:
            raise KeyError(
                f"no head artifact with key {key!r} in {store.root.uri}: `a2d ls --stage head` lists them"
            ) from None
        if not store.is_complete(ref):
            raise ValueError(f"head {ref.key} is partial: rerun `a2d run CONFIG --until head` to finish it")
        return ref
    heads = [r for r in store.iter_refs("head") if store.is_complete(r)]
    if not heads:
        raise ValueError(
            f"no trained head in {store.root.uri}: run `a2d run configs/demo.yaml --until head` "
            "(or point --store at a store that has one)"
        )
    return max(heads, key=lambda r: store.manifest(r)["created"])


def generate(
    store: ArtifactStore,
    head: ArtifactRef,
    prompt: str,
    sampler: str = "spec",
    max_new_tokens: int = 64,
    threshold: float = 0.9,
    device: str = "cpu",
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Answer one prompt (templated with the teacher's chat template) with the head's student."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}: use one of {', '.join(SAMPLERS)}")
    student, dspec = load_student(store, head, device)
    tok = student.tok
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(prompt)["input_ids"]
    eos = eos_ids(student.inner, tok)
    steps: list[list[int]] = []
    shown = [""]

    def on_step(response: list[int], committed: list[int]) -> None:
        steps.append(committed)
        now = tok.decode(response, skip_special_tokens=True)
        if on_text is not None and now.startswith(shown[0]):
            on_text(now[len(shown[0]) :])
            shown[0] = now

    start = time.perf_counter()
    if sampler == "spec":
        out = speculative_decode(student, ids, max_new_tokens, eos, on_step=on_step, lookup=3)
    elif sampler == "threshold":
        out = threshold_decode(
            student, ids, max_new_tokens, threshold, eos, dspec["logit_alignment"], on_step=on_step
        )
    else:
        with student.base() as base:
            tokens = generate_batch(base, [ids], max_new_tokens, eos, tok.pad_token_id).response_ids[0]
        out = Decoded(tokens, len(tokens), list(range(1, len(tokens) + 1)))
        steps = [[i] for i in range(len(tokens))]
        if on_text is not None:
            on_text(tok.decode(tokens, skip_special_tokens=True))
    seconds = time.perf_counter() - start
    final = tok.decode(out.tokens, skip_special_tokens=True)
    if on_text is not None and final.startswith(shown[0]) and sampler != "ar":
        on_text(final[len(shown[0]) :])
    pieces = [tok.decode([t]) for t in out.tokens]
    return Generation(final, out.tokens, out.forwards, seconds, steps, pieces)


def render_steps(gen: Generation) -> str:
    """One line per forward: the tokens it committed, in position order, with their positions."""
    lines = []
    for i, committed in enumerate(gen.steps, start=1):
        parts = " ".join(f"{p}:{gen.pieces[p]!r}" for p in sorted(committed) if p < len(gen.pieces))
        lines.append(f"forward {i:>3} +{len(committed)}: {parts}")
    return "\n".join(lines)
