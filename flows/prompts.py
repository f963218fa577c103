"""prompts flow: dataset rows to templated, tokenised Parquet shards with a held-out split."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import PromptSpec, RunOptions, TeacherSpec
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import prompts as stage
from tasks.stage import run_sharded


def prompts_ref(store: ArtifactStore, spec: PromptSpec, teacher: ArtifactRef) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, teacher.key))


@flow(name="prompts", task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True)
def prompts_flow(
    teacher: ArtifactRef,
    spec: PromptSpec = PromptSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Tokenise prompts with the teacher's tokenizer; every rejected row is counted by reason."""
    st = ArtifactStore(store)
    ref = prompts_ref(st, spec, teacher)
    shards = [] if st.is_complete(ref) else stage.shard_names(spec)
    key_spec = {**spec.model_dump(mode="json"), **stage.source_identity(spec)}
    return run_sharded(
        st,
        ref,
        key_spec,
        {"teacher": teacher.key},
        shards,
        stage.prompts_shard,
        lambda shard: dict(
            store_uri=store, ref=ref, shard=shard, spec=spec, teacher=teacher, teacher_spec=teacher_spec
        ),
        workers=opts.workers,
        verify_reuse=opts.verify_reuse,
        runner=opts.runner,
        dask_address=opts.dask_address,
        metrics=stage.summarise,
    )
