"""Generation from a trained head in the store, for `a2d generate`: one prompt, streamed, counted."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from a2d.models import decoders as registry
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks.resources import has_drafter, needs_teacher, refs_for, resources_from_store


@dataclass
class Generation:
    text: str
    tokens: list[int]
    forwards: int
    seconds: float
    steps: list[list[int]] = field(default_factory=list)  # per forward, the response positions it committed
    decoder: str = ""  # the registry name that decoded it
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
    decoder: str | None = None,
    max_new_tokens: int = 64,
    device: str = "cpu",
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Answer one prompt (templated with the teacher's chat template) with the head's student and
    the decoder `decoder` from the registry (`a2d.models.decoders`); unset, the default lossless one
    (`registry.default_decoder`: spec:drafter+lookup where the store holds a drafter of the teacher)."""
    teacher = store.ref("teacher", store.manifest(head)["upstream"]["teacher"])
    if decoder is None:
        decoder = "spec:drafter+lookup" if has_drafter(store, teacher) else "spec:head+lookup"
    registry.describe(decoder)  # an unknown name is refused before the model loads
    res, _, tok = resources_from_store(
        store,
        refs_for(store, head, decoder),
        max_new_tokens,
        device,
        teacher=needs_teacher(store, head, decoder),
    )
    ids = prompt_ids(tok, prompt)
    steps: list[list[int]] = []
    shown = [""]

    def on_step(response: list[int], committed: list[int]) -> None:
        steps.append(committed)
        # a trailing U+FFFD is a character whose bytes are still arriving: hold it back
        now = tok.decode(response, skip_special_tokens=True).rstrip("\ufffd")
        if on_text is not None and now.startswith(shown[0]):
            on_text(now[len(shown[0]) :])
            shown[0] = now

    run = registry.build(decoder, res, on_step=on_step)
    start = time.perf_counter()
    out = run(ids)
    seconds = time.perf_counter() - start
    final = tok.decode(out.tokens, skip_special_tokens=True)
    if not steps:  # a decoder without per-forward steps (AR): one token per forward
        steps = [[i] for i in range(len(out.tokens))]
    if on_text is not None and final.startswith(shown[0]):
        on_text(final[len(shown[0]) :])
    pieces = [tok.decode([t]) for t in out.tokens]
    return Generation(final, out.tokens, out.forwards, seconds, steps, pieces, decoder)


def prompt_ids(tok, prompt: str) -> list[int]:
    """A user message as the teacher's chat template frames it (plain tokens without a template)."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(prompt)["input_ids"]


def render_steps(gen: Generation) -> str:
    """One line per forward: the tokens it committed, in position order, with their positions."""
    lines = []
    for i, committed in enumerate(gen.steps, start=1):
        parts = " ".join(f"{p}:{gen.pieces[p]!r}" for p in sorted(committed) if p < len(gen.pieces))
        lines.append(f"forward {i:>3} +{len(committed)}: {parts}")
    return "\n".join(lines)
