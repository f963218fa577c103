"""drafter flow: a DFlash block-diffusion drafter trained from the anchors, servable by vLLM and SGLang."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import AnchorsIn, ResponsesIn, TeacherIn, admit, run_sharded
from a2d.specs import DrafterSpec, RunOptions, TrainOptions
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import drafter as stage


@flow(
    name="drafter", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True
)
def drafter_flow(
    teacher: TeacherIn,
    responses: ResponsesIn,
    anchors: AnchorsIn,
    spec: DrafterSpec = DrafterSpec(),
    train: TrainOptions = TrainOptions(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Block drafter over the teacher's layer outputs (anchors with tokens: all); a DFlash checkpoint."""
    refs, refused = admit(
        store, {"teacher": teacher, "responses": responses, "anchors": anchors}, run=opts
    )  # before any work
    if refused is not None:
        return refused
    teacher, responses, anchors = refs["teacher"], refs["responses"], refs["anchors"]
    st = ArtifactStore(store)
    refs = {"teacher": teacher, "responses": responses, "anchors": anchors}
    return run_sharded(
        st,
        stage.key_inputs(spec, teacher.key, responses.key, anchors.key),
        [stage.SHARD],
        stage.drafter_train,
        lambda ref, shard: dict(
            store_uri=st.root.uri, ref=ref, spec=spec, train=train, refs=refs, device=opts.device
        ),
        opts,
        stage.summarise,
        fan_out=False,
        stoppable=True,
    )
