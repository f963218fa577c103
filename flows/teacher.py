"""teacher flow: materialise the teacher checkpoint as a content-addressed artifact."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import RunOptions, TeacherSpec
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import teacher as stage
from tasks.stage import run_sharded


def teacher_ref(store: ArtifactStore, spec: TeacherSpec) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec))


@flow(name="teacher", task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=True)
def teacher_flow(
    spec: TeacherSpec = TeacherSpec(), store: str = "./a2d-store", opts: RunOptions = RunOptions()
) -> ArtifactRef:
    """Build or convert the teacher into `{store}/teacher/{key}/model` (reused when complete)."""
    st = ArtifactStore(store)
    ref = teacher_ref(st, spec)
    return run_sharded(
        st,
        ref,
        {**spec.key_fields(), **stage.source_identity(spec)},
        {},
        [stage.SHARD],
        stage.materialise,
        lambda shard: {"store_uri": store, "ref": ref, "spec": spec},
        workers=1,
        verify_reuse=opts.verify_reuse,
        metrics=lambda markers: {"architecture": markers[stage.SHARD]["architecture"]},
    )
