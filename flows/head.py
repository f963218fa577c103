"""head flow: QLoRA diffusion head trained on anchors and trajectories; resumes from checkpoints."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import AnchorsIn, ResponsesIn, TeacherIn, TrajectoriesIn, admit, run_sharded
from a2d.specs import HeadSpec, RunOptions, TeacherSpec, TrainOptions
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import head as stage


@flow(name="head", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def head_flow(
    teacher: TeacherIn,
    responses: ResponsesIn,
    anchors: AnchorsIn,
    trajectories: TrajectoriesIn,
    spec: HeadSpec = HeadSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    train: TrainOptions = TrainOptions(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Masked-diffusion + trajectory curriculum + anchor alignment; publishes a PEFT adapter."""
    refs, refused = admit(
        store,
        {"teacher": teacher, "responses": responses, "anchors": anchors, "trajectories": trajectories},
        teacher=teacher_spec,
        run=opts,
    )  # before any work
    if refused is not None:
        return refused
    teacher, responses, anchors, trajectories = (
        refs["teacher"],
        refs["responses"],
        refs["anchors"],
        refs["trajectories"],
    )
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec, teacher.key, anchors.key, trajectories.key),
        [stage.SHARD],
        stage.head_train,
        lambda ref, shard: dict(
            store_uri=st.root.uri,
            ref=ref,
            spec=spec,
            train=train,
            teacher=teacher,
            teacher_spec=teacher_spec,
            responses=responses,
            anchors=anchors,
            trajectories=trajectories,
            device=opts.device,
        ),
        opts,
        stage.summarise,
        fan_out=False,
        stoppable=True,
    )
