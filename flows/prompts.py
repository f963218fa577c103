"""prompts flow: dataset rows to templated, tokenised Parquet shards with a held-out split."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import TeacherIn, admit, run_sharded
from a2d.specs import PromptSpec, RunOptions, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import prompts as stage


@flow(
    name="prompts", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True
)
def prompts_flow(
    teacher: TeacherIn,
    spec: PromptSpec = PromptSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Tokenise prompts with the teacher's tokenizer; every rejected row is counted by reason."""
    refs, refused = admit(
        store, {"teacher": teacher}, teacher=teacher_spec, prompts=spec, run=opts
    )  # before any work
    if refused is not None:
        return refused
    teacher = refs["teacher"]
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec, teacher.key),
        lambda: stage.shard_names(spec),
        stage.prompts_shard,
        lambda ref, shard: dict(
            store_uri=st.root.uri, ref=ref, shard=shard, spec=spec, teacher=teacher, teacher_spec=teacher_spec
        ),
        opts,
        stage.summarise,
    )
