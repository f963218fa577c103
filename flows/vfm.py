"""vfm flow: one-step variational flow map distillation of the trained diffusion head."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import RunOptions, TrainOptions, VFMSpec
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import vfm as stage
from tasks.stage import run_sharded


def vfm_ref(store: ArtifactStore, spec: VFMSpec, head: ArtifactRef, responses: ArtifactRef) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, head.key, responses.key))


@flow(name="vfm", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def vfm_flow(
    head: ArtifactRef,
    responses: ArtifactRef,
    spec: VFMSpec = VFMSpec(),
    train: TrainOptions = TrainOptions(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Noise adapter q_φ(z | prompt) trained so the frozen student decodes the teacher's response in one step."""
    st = ArtifactStore(store)
    ref = vfm_ref(st, spec, head, responses)
    return run_sharded(
        st,
        ref,
        spec,
        {"head": head.key, "responses": responses.key},
        [stage.SHARD],
        stage.vfm_train,
        lambda shard: dict(
            store_uri=store,
            ref=ref,
            spec=spec,
            train=train,
            head=head,
            responses=responses,
            device=opts.device,
        ),
        workers=1,
        verify_reuse=opts.verify_reuse,
        metrics=stage.summarise,
    )
