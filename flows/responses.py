"""responses flow: teacher responses for every prompt, one Parquet shard per prompts shard."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import ResponseSpec, RunOptions, TeacherSpec
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import responses as stage
from tasks.stage import run_sharded


def responses_ref(
    store: ArtifactStore,
    spec: ResponseSpec,
    teacher_spec: TeacherSpec,
    prompts: ArtifactRef,
    teacher: ArtifactRef,
) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, teacher_spec.load, prompts.key, teacher.key))


@flow(name="responses", task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True)
def responses_flow(
    prompts: ArtifactRef,
    teacher: ArtifactRef,
    spec: ResponseSpec = ResponseSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Greedy (or seeded sampled) teacher generation with the KV cache, or the dataset's responses."""
    st = ArtifactStore(store)
    ref = responses_ref(st, spec, teacher_spec, prompts, teacher)
    shards = list(st.manifest(prompts)["shards"])
    return run_sharded(
        st,
        ref,
        stage.key_spec(spec, teacher_spec.load),
        {"prompts": prompts.key, "teacher": teacher.key},
        shards,
        stage.responses_shard,
        lambda shard: dict(
            store_uri=store,
            ref=ref,
            shard=shard,
            spec=spec,
            prompts=prompts,
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
