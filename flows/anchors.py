"""anchors flow: all-layer residual-stream anchors and teacher confidence, one Zarr shard per responses shard."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import AnchorSpec, RunOptions, TeacherSpec
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import anchors as stage
from tasks.stage import run_sharded


def anchors_ref(
    store: ArtifactStore,
    spec: AnchorSpec,
    teacher_spec: TeacherSpec,
    responses: ArtifactRef,
    teacher: ArtifactRef,
) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, teacher_spec.load, responses.key, teacher.key))


@flow(name="anchors", task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True)
def anchors_flow(
    responses: ArtifactRef,
    teacher: ArtifactRef,
    spec: AnchorSpec = AnchorSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """One teacher forward per sample; hooks stream each layer's tokens to the shard writer."""
    st = ArtifactStore(store)
    ref = anchors_ref(st, spec, teacher_spec, responses, teacher)
    shards = list(st.manifest(responses)["shards"])
    return run_sharded(
        st,
        ref,
        stage.key_spec(spec, teacher_spec.load),
        {"responses": responses.key, "teacher": teacher.key},
        shards,
        stage.anchors_shard,
        lambda shard: dict(
            store_uri=store,
            ref=ref,
            shard=shard,
            spec=spec,
            responses=responses,
            teacher=teacher,
            teacher_spec=teacher_spec,
            opts=opts,
        ),
        workers=opts.workers,
        verify_reuse=opts.verify_reuse,
        runner=opts.runner,
        dask_address=opts.dask_address,
        metrics=stage.summarise,
    )
