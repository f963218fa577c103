"""Training objectives: what one model's training is, apart from the loop that runs it.

An objective owns its model's trainable parameters, optimizer and learning-rate schedule, draws
the batch of a step (every draw a function of the seed, the step and the micro-batch), runs the
forward and backward of this process's share of it, reports the step's figures, measures held-out
marks, and says what a checkpoint holds and how it is loaded back. The one loop that drives all
three (`a2d.tasks.train`) does the rest: processes, gradient averaging, clipping, the optimizer and
schedule steps, tracking, progress, checkpoint publishing and SIGTERM.

Specs are read by attribute (the spec layer sits below the tasks that pass them in).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Saved:
    """What one checkpoint holds beyond the optimizer, scheduler and RNG (see stores.checkpoints)."""

    model: Any  # has save_pretrained(folder): a PEFT model, the noise adapter, the drafter
    extras: dict[str, torch.Tensor]
    cursor: int  # samples consumed so far, the data cursor
    info: dict[str, Any] = field(default_factory=dict)  # more fields of state.json


class Objective:
    """One model's training, as the loop sees it; the subclasses are the head, the VFM and the drafter."""

    stage: str
    max_grad_norm: float
    precision: str = "no"

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every trained parameter, in the optimizer's order (gradients are averaged over them)."""
        raise NotImplementedError

    def optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def schedule(self) -> Callable[[int], float]:
        """The learning-rate factor of each step (LambdaLR)."""
        return constant

    def forward_backward(self, step: int, rank: int, world: int) -> dict[str, Any]:
        """This process's share of `step`'s batch through the model, gradients accumulated so that
        their mean over the `world` processes is the step's gradient; the step's raw figures."""
        raise NotImplementedError

    def record(
        self, stats: dict[str, Any], lr: float, grad_norm: float
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(history row, figures only the tracker gets) of one step."""
        raise NotImplementedError

    def held_out(self, step: int) -> dict[str, Any] | None:
        """Held-out figures measured after `step` (rank 0 only), or None at steps without a mark."""
        return None

    def saved(self, step: int, world: int) -> Saved:
        raise NotImplementedError

    def load(self, folder: Path, state: dict[str, Any], extras: dict[str, torch.Tensor]) -> None:
        """Load the weights of the checkpoint in `folder` (its optimizer, scheduler and RNG are loaded)."""
        raise NotImplementedError

    def tracked(self) -> dict[str, Any]:
        """More of the tracker's run config, beside the spec and the run options."""
        return {}

    def summary(self) -> dict[str, Any]:
        """More of the training's result, beside step, stopped and history."""
        return {}


def constant(step: int) -> float:
    return 1.0


def lr_lambda(spec: Any) -> Callable[[int], float]:
    """Linear warmup over `warmup_steps`, then `lr_schedule` (cosine, linear or constant) to `steps`."""

    def f(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        if spec.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if spec.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return f


def mean_over_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    """The mean of a tensor over the training processes (gloo has no AVG: a SUM, divided)."""
    if world > 1:
        values = values.clone()
        torch.distributed.all_reduce(values)
        values.div_(world)
    return values
