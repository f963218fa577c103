"""head flow: QLoRA diffusion head trained on anchors and trajectories; resumes from checkpoints."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import HeadSpec, RunOptions, TeacherSpec, TrainOptions
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import head as stage
from tasks.stage import run_sharded


def head_ref(
    store: ArtifactStore,
    spec: HeadSpec,
    teacher: ArtifactRef,
    anchors: ArtifactRef,
    trajectories: ArtifactRef,
) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, teacher.key, anchors.key, trajectories.key))


@flow(name="head", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def head_flow(
    teacher: ArtifactRef,
    responses: ArtifactRef,
    anchors: ArtifactRef,
    trajectories: ArtifactRef,
    spec: HeadSpec = HeadSpec(),
    teacher_spec: TeacherSpec = TeacherSpec(),
    train: TrainOptions = TrainOptions(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Masked-diffusion + trajectory curriculum + anchor alignment; publishes a PEFT adapter."""
    st = ArtifactStore(store)
    ref = head_ref(st, spec, teacher, anchors, trajectories)
    upstream = {"teacher": teacher.key, "anchors": anchors.key, "trajectories": trajectories.key}
    return run_sharded(
        st,
        ref,
        spec,
        upstream,
        [stage.SHARD],
        stage.head_train,
        lambda shard: dict(
            store_uri=store,
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
        workers=1,
        verify_reuse=opts.verify_reuse,
        metrics=stage.summarise,
    )
