"""responses flow: teacher responses for every prompt, one Parquet shard per prompts shard."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import PromptsIn, TeacherIn, admit, run_sharded
from a2d.specs import ResponseSpec, RunOptions, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import responses as stage


@flow(
    name="responses",
    on_crashed=[on_crashed],
    task_runner=ThreadPoolTaskRunner(max_workers=8),
    log_prints=True,
)
def responses_flow(
    prompts: PromptsIn,
    teacher: TeacherIn,
    spec: ResponseSpec = ResponseSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Greedy (or seeded sampled) teacher generation with the KV cache, or the dataset's responses."""
    refs, refused = admit(
        store, {"prompts": prompts, "teacher": teacher}, teacher=teacher_spec, run=opts
    )  # before any work
    if refused is not None:
        return refused
    prompts, teacher = refs["prompts"], refs["teacher"]
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec, teacher_spec.load, prompts.key, teacher.key),
        lambda: list(st.manifest(prompts)["shards"]),
        stage.responses_shard,
        lambda ref, shard: dict(
            store_uri=st.root.uri,
            ref=ref,
            shard=shard,
            spec=spec,
            prompts=prompts,
            teacher=teacher,
            teacher_spec=teacher_spec,
            opts=opts,
        ),
        opts,
        stage.summarise,
    )
