"""The pipeline flow: every stage flow chained by artifact references, never tensors."""

from __future__ import annotations

from typing import Literal

from prefect import flow

from flows.config import STAGES, PipelineConfig
from flows.prompts import prompts_flow, prompts_ref
from flows.teacher import teacher_flow, teacher_ref
from stores.artifacts import ArtifactRef, ArtifactStore

StageName = Literal["teacher", "prompts"]


def stages_until(until: str) -> tuple[str, ...]:
    if until not in STAGES:
        raise ValueError(f"unknown stage {until!r}: choose one of {', '.join(STAGES)}")
    return STAGES[: STAGES.index(until) + 1]


def plan(config: PipelineConfig, until: str = STAGES[-1]) -> dict[str, ArtifactRef]:
    """The artifact every stage up to `until` would produce, computed from specs alone."""
    store = ArtifactStore(config.store)
    refs: dict[str, ArtifactRef] = {}
    wanted = stages_until(until)
    refs["teacher"] = teacher_ref(store, config.teacher)
    if "prompts" in wanted:
        refs["prompts"] = prompts_ref(store, config.prompts, refs["teacher"])
    return refs


@flow(name="pipeline", log_prints=True)
def pipeline(
    config: PipelineConfig = PipelineConfig(), until: StageName = STAGES[-1]
) -> dict[str, ArtifactRef]:
    """teacher → prompts → …: each stage reuses its artifact when complete and resumes when partial."""
    wanted = stages_until(until)
    refs: dict[str, ArtifactRef] = {}
    refs["teacher"] = teacher_flow(config.teacher, config.store, config.run)
    if "prompts" in wanted:
        refs["prompts"] = prompts_flow(
            refs["teacher"], config.prompts, config.teacher, config.store, config.run
        )
    return refs
