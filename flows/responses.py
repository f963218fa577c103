"""responses flow: teacher responses for every prompt, one Parquet shard per prompts shard."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import PromptsIn, TeacherIn, admit, run_sharded
from a2d.specs import AnchorSpec, ResponseSpec, RunOptions, TeacherSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import anchors as anchor_stage
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
    anchor_spec: AnchorSpec | None = None,
) -> ArtifactRef:
    """Greedy (or seeded sampled) teacher generation with the KV cache, or the dataset's responses.

    `anchor_spec` (a spec with `source: generation`, as the pipeline passes it) also captures that
    anchors artifact's shards from the generation's own forwards; the anchors stage then finds
    them finished and runs its forward only for shards this run did not capture."""
    refs, refused = admit(
        store, {"prompts": prompts, "teacher": teacher}, teacher=teacher_spec, run=opts
    )  # before any work
    if refused is not None:
        return refused
    prompts, teacher = refs["prompts"], refs["teacher"]
    st = ArtifactStore(store)
    inputs = stage.key_inputs(spec, teacher_spec.load, prompts.key, teacher.key)
    with capturing(st, anchor_spec, inputs.key, teacher, teacher_spec, prompts, opts) as target:
        return run_sharded(
            st,
            inputs,
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
                anchors=target,
                anchor_spec=anchor_spec if target is not None else None,
            ),
            opts,
            stage.summarise,
        )


@contextlib.contextmanager
def capturing(
    st: ArtifactStore,
    spec: AnchorSpec | None,
    responses_key: str,
    teacher: ArtifactRef,
    teacher_spec: TeacherSpec,
    prompts: ArtifactRef,
    opts: RunOptions,
) -> Iterator[ArtifactRef | None]:
    """The anchors artifact the generation captures into, held (its lock, its plan written) while
    the responses are generated; None when there is nothing to capture: no spec, `source:
    forward`, or that artifact already complete."""
    if spec is None or spec.source != "generation":
        yield None
        return
    anchor_stage.check_layers(spec, anchor_stage.teacher_layer_count(st, teacher))
    inputs = anchor_stage.key_inputs(spec, teacher_spec.load, responses_key, teacher.key, opts.device)
    ref = st.ref_for(inputs)
    with st.lock(ref):
        if st.is_complete(ref):
            yield None
            return
        st.clean_scratch(ref)
        st.plan_shards(ref, inputs, lambda: list(st.manifest(prompts)["shards"]))  # the responses' shards
        yield ref
