"""vfm flow: one-step variational flow map distillation of the trained diffusion head."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import HeadIn, ResponsesIn, admit, run_sharded
from a2d.specs import RunOptions, TrainOptions, VFMSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import vfm as stage


@flow(name="vfm", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def vfm_flow(
    head: HeadIn,
    responses: ResponsesIn,
    spec: VFMSpec = VFMSpec(),
    train: TrainOptions = TrainOptions(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Noise adapter q_φ(z | prompt) trained so the frozen student decodes the teacher's response in one step."""
    refs, refused = admit(store, {"head": head, "responses": responses}, run=opts)  # before any work
    if refused is not None:
        return refused
    head, responses = refs["head"], refs["responses"]
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec, head.key, responses.key),
        [stage.SHARD],
        stage.vfm_train,
        lambda ref, shard: dict(
            store_uri=st.root.uri,
            ref=ref,
            spec=spec,
            train=train,
            head=head,
            responses=responses,
            device=opts.device,
        ),
        opts,
        stage.summarise,
        fan_out=False,
        stoppable=True,
    )
