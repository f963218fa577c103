"""The pipeline flow: every stage flow chained by artifact references, never tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prefect import flow

from a2d.flows.anchors import anchors_flow
from a2d.flows.drafter import drafter_flow
from a2d.flows.evaluate import eval_flow
from a2d.flows.head import head_flow
from a2d.flows.outcomes import Outcome, observe, table
from a2d.flows.policy import config_parts, refusal
from a2d.flows.prompts import prompts_flow
from a2d.flows.responses import responses_flow
from a2d.flows.run_logs import on_crashed
from a2d.flows.teacher import teacher_flow
from a2d.flows.trajectories import trajectories_flow
from a2d.flows.vfm import vfm_flow
from a2d.specs import STAGES, PipelineConfig
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.stores.keys import KeyInputs
from a2d.tasks import anchors, drafter, evaluate, head, prompts, responses, teacher, trajectories, vfm
from a2d.tasks.runtime import in_prefect_run, logger

StageName = Literal[
    "teacher", "prompts", "responses", "anchors", "drafter", "trajectories", "head", "vfm", "eval"
]
Refs = dict[str, ArtifactRef]
SUMMARY_KEY = "a2d-pipeline"  # the pipeline run's own table: one row per stage


@dataclass(frozen=True)
class Step:
    """One stage: its key inputs from the config and upstream refs (nothing runs), and how to run it.

    `inputs` calls the same `a2d.tasks.<stage>.key_inputs` the stage's flow calls, so the planned
    artifact and the built one are the same.
    """

    inputs: Callable[[PipelineConfig, Refs], KeyInputs]
    run: Callable[[PipelineConfig, Refs], ArtifactRef]


STEPS: dict[str, Step] = {
    "teacher": Step(
        lambda c, r: teacher.key_inputs(c.teacher),
        lambda c, r: teacher_flow(c.teacher, c.store, c.run),
    ),
    "prompts": Step(
        lambda c, r: prompts.key_inputs(c.prompts, r["teacher"].key),
        lambda c, r: prompts_flow(r["teacher"], c.prompts, c.teacher, c.store, c.run),
    ),
    "responses": Step(
        lambda c, r: responses.key_inputs(c.responses, c.teacher.load, r["prompts"].key, r["teacher"].key),
        lambda c, r: responses_flow(
            r["prompts"], r["teacher"], c.responses, c.teacher, c.store, c.run, c.anchors
        ),  # `anchors.source: generation` captures the anchors as it generates
    ),
    "anchors": Step(
        lambda c, r: anchors.key_inputs(
            c.anchors, c.teacher.load, r["responses"].key, r["teacher"].key, c.run.device
        ),
        lambda c, r: anchors_flow(r["responses"], r["teacher"], c.anchors, c.teacher, c.store, c.run),
    ),
    "drafter": Step(
        lambda c, r: drafter.key_inputs(c.drafter, r["teacher"].key, r["responses"].key, r["anchors"].key),
        lambda c, r: drafter_flow(
            r["teacher"], r["responses"], r["anchors"], c.drafter, c.train, c.store, c.run
        ),
    ),
    "trajectories": Step(
        lambda c, r: trajectories.key_inputs(c.trajectories, r["responses"].key, r["anchors"].key),
        lambda c, r: trajectories_flow(r["responses"], r["anchors"], c.trajectories, c.store, c.run),
    ),
    "head": Step(
        lambda c, r: head.key_inputs(c.head, r["teacher"].key, r["anchors"].key, r["trajectories"].key),
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
        lambda c, r: vfm.key_inputs(c.vfm, r["head"].key, r["responses"].key),
        lambda c, r: vfm_flow(r["head"], r["responses"], c.vfm, c.train, c.store, c.run),
    ),
    "eval": Step(
        lambda c, r: evaluate.key_inputs(
            c.eval, {k: r[k].key for k in ("teacher", "responses", "head", "vfm", "drafter") if k in r}
        ),
        lambda c, r: eval_flow(
            r["teacher"],
            r["responses"],
            r["head"],
            r["vfm"],
            c.eval,
            c.store,
            c.run,
            drafter=r.get("drafter"),
        ),
    ),
}


def preflight(config: PipelineConfig, stages: tuple[str, ...], refs: Refs) -> None:
    """Checks that need the teacher's shape, run as soon as it is known (before any later stage works):
    from the spec for a random teacher, else from the materialised teacher's record."""
    if "anchors" not in stages:
        return
    if "teacher" in refs:
        layers = anchors.teacher_layer_count(ArtifactStore(config.store), refs["teacher"])
    elif config.teacher.source == "random":
        layers = config.teacher.layers
    else:
        return
    anchors.check_layers(config.anchors, layers)
    if "drafter" in stages and config.drafter is not None:
        drafter.check_config(config.drafter, config.anchors, layers)


def checked(config: PipelineConfig, stages: tuple[str, ...], refs: Refs):
    """`preflight` as a run's first step: a config it refuses ends the run Failed with one line
    naming the field and the fix (no traceback; a retry fails the same way), else None."""
    try:
        preflight(config, stages, refs)
    except ValueError as e:
        from prefect.states import Failed

        message = f"config refused before the stages that need it ran: {e}"
        logger().error(message)
        return Failed(message=message)
    return None


def stages_until(until: str, config: PipelineConfig | None = None) -> tuple[str, ...]:
    """The stages a run up to `until` builds; the drafter only where the config has one."""
    if until not in STAGES:
        raise ValueError(f"unknown stage {until!r}: choose one of {', '.join(STAGES)}")
    if config is not None and config.drafter is None and until == "drafter":
        raise ValueError("--until drafter, but the config sets drafter: null (no drafter stage)")
    stages = STAGES[: STAGES.index(until) + 1]
    if config is not None and config.drafter is None:
        stages = tuple(s for s in stages if s != "drafter")
    return stages


def plan(config: PipelineConfig, until: str = STAGES[-1]) -> Refs:
    """The artifact every stage up to `until` would produce, computed from specs alone."""
    store = ArtifactStore(config.store)
    refs: Refs = {}
    for stage in stages_until(until, config):
        refs[stage] = store.ref_for(STEPS[stage].inputs(config, refs))
    return refs


@flow(name="pipeline", on_crashed=[on_crashed], log_prints=True)
def pipeline(config: PipelineConfig = PipelineConfig(), until: StageName = STAGES[-1]) -> Refs:
    """teacher → prompts → responses → anchors → drafter → trajectories → head → vfm → eval: each stage reuses a complete artifact and resumes a partial one."""
    refused = refusal(**config_parts(config))  # a served run: before any work
    if refused is not None:
        return refused
    store = ArtifactStore(config.store)
    refs: Refs = {}
    done: list[Outcome] = []
    stages = stages_until(until, config)
    refused = checked(config, stages, refs)
    if refused is not None:
        return refused
    for stage in stages:
        planned = store.ref_for(STEPS[stage].inputs(config, refs))
        refs[stage], outcome = observe(store, planned, lambda stage=stage: STEPS[stage].run(config, refs))
        done.append(outcome)
        if stage == "teacher" and (refused := checked(config, stages, refs)) is not None:
            return refused
    if in_prefect_run():
        from prefect.artifacts import create_table_artifact

        create_table_artifact(
            key=SUMMARY_KEY,
            table=table(done),
            description=f"pipeline `{config.name}` up to {until}: per stage its key, what the run did "
            f"(built, reused, resumed), seconds, size and where it lives ({config.store})",
        )
    return refs
