"""teacher flow: materialise the teacher checkpoint as a content-addressed artifact."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.policy import refusal
from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import run_sharded
from a2d.specs import RunOptions, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import teacher as stage


@flow(
    name="teacher", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=True
)
def teacher_flow(
    spec: TeacherSpec = TeacherSpec(), store: str = "./a2d-store", opts: RunOptions = RunOptions()
) -> ArtifactRef:
    """Build or convert the teacher into `{store}/teacher/{key}/model` (reused when complete)."""
    refused = refusal(store=store, teacher=spec, run=opts)  # a served run: before any work
    if refused is not None:
        return refused
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec),
        [stage.SHARD],
        stage.materialise,
        lambda ref, shard: {"store_uri": st.root.uri, "ref": ref, "spec": spec},
        opts,
        lambda markers: {"architecture": markers[stage.SHARD]["architecture"]},
        fan_out=False,
    )
