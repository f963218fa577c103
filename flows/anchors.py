"""anchors flow: all-layer residual-stream anchors and teacher confidence, one Zarr shard per responses shard."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import ResponsesIn, TeacherIn, admit, run_sharded
from a2d.specs import AnchorSpec, RunOptions, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import anchors as stage


@flow(
    name="anchors", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True
)
def anchors_flow(
    responses: ResponsesIn,
    teacher: TeacherIn,
    spec: AnchorSpec = AnchorSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """One teacher forward per sample; hooks stream each layer's tokens to the shard writer."""
    refs, refused = admit(
        store, {"responses": responses, "teacher": teacher}, teacher=teacher_spec, run=opts
    )  # before any work
    if refused is not None:
        return refused
    responses, teacher = refs["responses"], refs["teacher"]
    st = ArtifactStore(store)
    stage.check_layers(spec, stage.teacher_layer_count(st, teacher))
    return run_sharded(
        st,
        stage.key_inputs(spec, teacher_spec.load, responses.key, teacher.key, opts.device),
        lambda: list(st.manifest(responses)["shards"]),
        stage.anchors_shard,
        lambda ref, shard: dict(
            store_uri=st.root.uri,
            ref=ref,
            shard=shard,
            spec=spec,
            responses=responses,
            teacher=teacher,
            teacher_spec=teacher_spec,
            opts=opts,
        ),
        opts,
        stage.summarise,
    )
