"""The pipeline flow: every stage flow chained by artifact references, never tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prefect import flow

from flows.anchors import anchors_flow, anchors_ref
from flows.config import STAGES, PipelineConfig
from flows.evaluate import eval_flow, eval_ref
from flows.head import head_flow, head_ref
from flows.prompts import prompts_flow, prompts_ref
from flows.responses import responses_flow, responses_ref
from flows.teacher import teacher_flow, teacher_ref
from flows.trajectories import trajectories_flow, trajectories_ref
from flows.vfm import vfm_flow, vfm_ref
from stores.artifacts import ArtifactRef, ArtifactStore

StageName = Literal["teacher", "prompts", "responses", "anchors", "trajectories", "head", "vfm", "eval"]
Refs = dict[str, ArtifactRef]


@dataclass(frozen=True)
class Step:
    """One stage: how to name its artifact without running it, and how to run it."""

    ref: Callable[[ArtifactStore, PipelineConfig, Refs], ArtifactRef]
    run: Callable[[PipelineConfig, Refs], ArtifactRef]


STEPS: dict[str, Step] = {
    "teacher": Step(
        lambda st, c, r: teacher_ref(st, c.teacher),
        lambda c, r: teacher_flow(c.teacher, c.store, c.run),
    ),
    "prompts": Step(
        lambda st, c, r: prompts_ref(st, c.prompts, r["teacher"]),
        lambda c, r: prompts_flow(r["teacher"], c.prompts, c.teacher, c.store, c.run),
    ),
    "responses": Step(
        lambda st, c, r: responses_ref(st, c.responses, c.teacher, r["prompts"], r["teacher"]),
        lambda c, r: responses_flow(r["prompts"], r["teacher"], c.responses, c.teacher, c.store, c.run),
    ),
    "anchors": Step(
        lambda st, c, r: anchors_ref(st, c.anchors, c.teacher, r["responses"], r["teacher"]),
        lambda c, r: anchors_flow(r["responses"], r["teacher"], c.anchors, c.teacher, c.store, c.run),
    ),
    "trajectories": Step(
        lambda st, c, r: trajectories_ref(st, c.trajectories, r["responses"], r["anchors"]),
        lambda c, r: trajectories_flow(r["responses"], r["anchors"], c.trajectories, c.store, c.run),
    ),
    "head": Step(
        lambda st, c, r: head_ref(st, c.head, r["teacher"], r["anchors"], r["trajectories"]),
        lambda c, r: head_flow(
            r["teacher"],
            r["responses"],
            r["anchors"],
            r["trajectories"],
            c.head,
            c.teacher,
            c.train,
            c.store,
            c.run,
        ),
    ),
    "vfm": Step(
        lambda st, c, r: vfm_ref(st, c.vfm, r["head"], r["responses"]),
        lambda c, r: vfm_flow(r["head"], r["responses"], c.vfm, c.train, c.store, c.run),
    ),
    "eval": Step(
        lambda st, c, r: eval_ref(st, c.eval, {k: r[k] for k in ("teacher", "responses", "head", "vfm")}),
        lambda c, r: eval_flow(r["teacher"], r["responses"], r["head"], r["vfm"], c.eval, c.store, c.run),
    ),
}


def stages_until(until: str) -> tuple[str, ...]:
    if until not in STAGES:
        raise ValueError(f"unknown stage {until!r}: choose one of {', '.join(STAGES)}")
    return STAGES[: STAGES.index(until) + 1]


def plan(config: PipelineConfig, until: str = STAGES[-1]) -> Refs:
    """The artifact every stage up to `until` would produce, computed from specs alone."""
    store = ArtifactStore(config.store)
    refs: Refs = {}
    for stage in stages_until(until):
        refs[stage] = STEPS[stage].ref(store, config, refs)
    return refs


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig = PipelineConfig(), until: StageName = STAGES[-1]) -> Refs:
    """teacher → prompts → responses → anchors → trajectories → head → vfm → eval: each stage reuses a complete artifact and resumes a partial one."""
    refs: Refs = {}
    for stage in stages_until(until):
        refs[stage] = STEPS[stage].run(config, refs)
    return refs
