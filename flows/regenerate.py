"""regenerate-data flow: re-derive the data stages from a config, reusing what has not changed.

prompts → responses → anchors → trajectories, after the teacher (reused when complete). Each stage
is content-addressed, so a run rebuilds exactly the stages whose inputs changed (a new dataset
revision, edited prompt files, a different generation budget) and reuses the rest. Served with a
schedule this keeps the data current:

    a2d serve --config configs/demo.yaml --cron "0 3 * * *"     # regenerate-data/<name> nightly at 03:00

The run ends with a Markdown artifact (`a2d-regenerate-data`) naming what was reused and rebuilt.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from a2d.flows.outcomes import Outcome, observe
from a2d.flows.pipeline import STEPS, Refs, preflight
from a2d.flows.policy import config_parts, refusal
from a2d.flows.run_logs import on_crashed
from a2d.specs import PipelineConfig
from a2d.stores.artifacts import ArtifactStore
from a2d.tasks.runtime import in_prefect_run, logger

# The stages that make training data; the teacher comes first because they all hang off its key.
DATA_STAGES = ("prompts", "responses", "anchors", "trajectories")
ARTIFACT_KEY = "a2d-regenerate-data"


def summary(config: PipelineConfig, outcomes: list[Outcome]) -> str:
    """The Markdown report: one row per stage, then the lists of reused and rebuilt stages."""
    rebuilt = [o.stage for o in outcomes if not o.reused]
    reused = [o.stage for o in outcomes if o.reused]
    lines = [
        f"# regenerate-data `{config.name}`",
        "",
        f"Store: `{config.store}`",
        "",
        "| stage | key | outcome | seconds |",
        "|---|---|---|---|",
    ]
    lines += [f"| {o.stage} | `{o.key}` | {o.outcome} | {o.seconds:.1f} |" for o in outcomes]
    lines += [
        "",
        f"- reused: {', '.join(reused) or 'none'}",
        f"- rebuilt: {', '.join(rebuilt) or 'none'}",
    ]
    return "\n".join(lines)


@flow(name="regenerate-data", on_crashed=[on_crashed], log_prints=True)
def regenerate_data(config: PipelineConfig = PipelineConfig()) -> Refs:
    """Rebuild prompts → responses → anchors → trajectories where their inputs changed; the teacher is reused."""
    refused = refusal(**config_parts(config))  # a served run: before any work
    if refused is not None:
        return refused
    log = logger()
    store = ArtifactStore(config.store)
    refs: Refs = {}
    outcomes: list[Outcome] = []
    preflight(config, ("teacher", *DATA_STAGES), refs)
    for stage in ("teacher", *DATA_STAGES):
        step = STEPS[stage]
        # Decided before the stage runs: a complete manifest means the stage only re-verifies it.
        planned = store.ref_for(step.inputs(config, refs))
        refs[stage], outcome = observe(store, planned, lambda step=step: step.run(config, refs))
        if stage == "teacher":
            preflight(config, ("teacher", *DATA_STAGES), refs)
        outcomes.append(outcome)
        log.info("regenerate-data: %s %s %s", stage, refs[stage].key, outcome.outcome)
    report = summary(config, outcomes)
    if in_prefect_run():
        create_markdown_artifact(key=ARTIFACT_KEY, markdown=report, description="regenerate-data outcome")
    return refs
