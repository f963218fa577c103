"""A whole run's configuration: one spec per stage plus run options, loaded from YAML.

Unknown keys and out-of-range values fail before any work starts, naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from a2d.specs.stages import (
    AnchorSpec,
    EvalSpec,
    PromptSpec,
    ResponseSpec,
    Spec,
    TeacherSpec,
    TrajectorySpec,
)
from a2d.specs.training import DrafterSpec, HeadSpec, VFMSpec


class TrainOptions(Spec):
    """How training runs; never part of a key."""

    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints (also on SIGTERM)")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward")
    num_processes: int = Field(1, ge=1, le=1024, description="Processes (GPUs) per machine for accelerate")
    num_machines: int = Field(1, ge=1, le=1024, description="Machines for accelerate")
    distributed: Literal["ddp"] = Field(
        "ddp", description="Multi-process strategy (gradient mean over ranks)"
    )
    mixed_precision: Literal["auto", "native", "bf16", "no"] = Field(
        "auto",
        description=(
            "bf16 autocast of forward passes; auto = on GPUs that support bf16, off on CPU; "
            "native = wherever bf16 runs in hardware (GPU, CPU with AMX or AVX512-BF16), off elsewhere"
        ),
    )
    log_every: int = Field(5, ge=1, description="Steps between log lines")
    wandb_project: str | None = Field(
        None, description="W&B project; unset = no W&B. Mode from WANDB_MODE, offline when unset"
    )


class RunOptions(Spec):
    """How to run; never part of a key."""

    batch_size: int = Field(8, ge=1, le=4096, description="Samples per forward pass")
    workers: int = Field(
        2, ge=1, le=256, description="Shard tasks in flight at once (threads, or local Dask workers)"
    )
    runner: Literal["threads", "dask"] = Field(
        "threads", description="Where shard tasks run: this process, or Dask"
    )
    dask_address: str | None = Field(
        None, description="dask: scheduler address of an existing cluster (default: a local one)"
    )
    device: str = Field("auto", description="torch device: auto, cpu, cuda, cuda:1, mps")
    verify_reuse: bool = Field(True, description="Re-hash finished shards before reusing them")
    progress: bool = Field(True, description="Show progress bars")


STAGES = ("teacher", "prompts", "responses", "anchors", "drafter", "trajectories", "head", "vfm", "eval")


class PipelineConfig(Spec):
    """A whole run: one spec per stage plus run options."""

    name: str = Field("a2d", description="Run name shown in logs and artifacts")
    store: str = Field(
        "./a2d-store", description="Artifact store root: a path or a URI (file://, s3://, memory://)"
    )
    teacher: TeacherSpec = Field(default_factory=TeacherSpec)
    prompts: PromptSpec = Field(default_factory=PromptSpec)
    responses: ResponseSpec = Field(default_factory=ResponseSpec)
    anchors: AnchorSpec = Field(default_factory=AnchorSpec)
    drafter: DrafterSpec | None = Field(
        default_factory=DrafterSpec,
        description="The DFlash drafter stage (needs anchors.tokens: all); null = no drafter stage",
    )
    trajectories: TrajectorySpec = Field(default_factory=TrajectorySpec)
    head: HeadSpec = Field(default_factory=HeadSpec)
    vfm: VFMSpec = Field(default_factory=VFMSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    train: TrainOptions = Field(default_factory=TrainOptions)
    run: RunOptions = Field(default_factory=RunOptions)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the fix."""


def _parse_value(raw: str) -> Any:
    """`--set` values are YAML scalars: `3`, `0.5`, `true`, `null`, `[1, 2]`, or plain strings."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to nested config data (copying what it changes)."""
    out = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} is not of the form a.b=value")
        path, raw = item.split("=", 1)
        parts = path.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = _parse_value(raw)
    return out


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config {origin}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key {loc!r}: check its spelling (see configs/tiny.yaml for every key)")
        else:
            lines.append(f"  - {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load a YAML config (or the defaults when `path` is None) and apply overrides."""
    data: dict[str, Any] = {}
    origin = "(defaults)"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; the shipped ones are in configs/")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"config file {p} is not valid YAML{where}: {what}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded or {}
        origin = str(p)
    data = apply_overrides(data, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, origin)) from None
