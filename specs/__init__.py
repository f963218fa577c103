"""a2d.specs: the pydantic specs every layer shares (the bottom of the import graph)."""

from a2d.specs.config import (
    STAGES,
    ConfigError,
    PipelineConfig,
    RunOptions,
    TrainOptions,
    apply_overrides,
    load_config,
)
from a2d.specs.policy import ServePolicy
from a2d.specs.stages import (
    AnchorSpec,
    EvalSpec,
    LoadSpec,
    PromptSpec,
    ResponseSpec,
    Spec,
    TeacherSpec,
    TrajectorySpec,
)
from a2d.specs.training import DrafterSpec, HeadSpec, VFMSpec

__all__ = [
    "STAGES",
    "AnchorSpec",
    "ConfigError",
    "DrafterSpec",
    "EvalSpec",
    "HeadSpec",
    "LoadSpec",
    "PipelineConfig",
    "PromptSpec",
    "ResponseSpec",
    "RunOptions",
    "ServePolicy",
    "Spec",
    "TeacherSpec",
    "TrainOptions",
    "TrajectorySpec",
    "VFMSpec",
    "apply_overrides",
    "load_config",
]
