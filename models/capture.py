"""Layer capture with forward hooks: the raw residual stream after each selected decoder layer.

Hooks hand each layer's output to a callback as soon as the layer runs, so the caller can copy the
tokens it needs and let the tensor go: memory holds one layer at a time, unlike
`output_hidden_states=True`, which keeps every layer and, for the last one, returns the output of
the final norm instead of the layer (see DESIGN §3, anchors). Teacher anchors and student states
are captured with this same code so that both sides are compared like with like.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from a2d.models.teacher import decoder_layers

OnLayer = Callable[[int, torch.Tensor], None]  # (layer index, hidden (B, T, H))


def resolve_layers(spec: Sequence[int] | str, num_layers: int) -> list[int]:
    """`"all"` or a list of indices (negative counts from the end) to sorted unique indices."""
    if spec == "all":
        return list(range(num_layers))
    if isinstance(spec, str):
        raise ValueError(f"layers must be 'all' or a list of indices, got {spec!r}")
    out = sorted({i + num_layers if i < 0 else i for i in spec})
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad or not out:
        raise ValueError(f"layers {list(spec)} out of range for a model with {num_layers} decoder layers")
    return out


@contextlib.contextmanager
def capture_layers(model: torch.nn.Module, layers: Sequence[int], on_layer: OnLayer) -> Iterator[None]:
    """Call `on_layer(i, hidden)` with decoder layer i's output during every forward this thread
    runs in the block.

    Hooks live on the (shared) model, and shards run in threads of one process on one model (the
    responses stage generates two at once): each hook hands on only the forwards of the thread that
    opened the block, so two threads capture side by side, each seeing its own forwards alone.
    """
    stack = decoder_layers(model)
    owner = threading.get_ident()
    handles = []

    def make_hook(index: int):
        def hook(_module: torch.nn.Module, _inputs: tuple, output: torch.Tensor | tuple) -> None:
            if threading.get_ident() != owner:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            on_layer(index, hidden)

        return hook

    try:
        for i in layers:
            handles.append(stack[i].register_forward_hook(make_hook(i)))
        yield
    finally:
        for h in handles:
            h.remove()


def token_confidence(
    logits: torch.Tensor, targets: torch.Tensor, chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probability of each target and the entropy of the predictive distribution.

    logits (N, V) predicting targets (N,) -> confidence (N,), entropy (N,) in nats, computed in fp32
    in row chunks so that a 250k vocabulary never needs more than one (chunk, V) temporary.
    """
    confs, ents = [], []
    for i in range(0, logits.shape[0], chunk):
        rows = logits[i : i + chunk].float()  # (n, V)
        lse = torch.logsumexp(rows, dim=-1)  # (n,)
        probs = torch.softmax(rows, dim=-1)
        ents.append(lse - torch.linalg.vecdot(probs, rows))  # H = logsumexp - E_p[logit]
        confs.append((rows.gather(-1, targets[i : i + chunk].long().unsqueeze(-1)).squeeze(-1) - lse).exp())
    if not confs:
        return logits.new_zeros(0, dtype=torch.float32), logits.new_zeros(0, dtype=torch.float32)
    return torch.cat(confs), torch.cat(ents)
