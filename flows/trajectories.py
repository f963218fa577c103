"""trajectories flow: d3LLM pseudo-trajectories from the anchors stage's teacher confidence."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import RunOptions, TrajectorySpec
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import trajectories as stage
from tasks.stage import run_sharded


def trajectories_ref(
    store: ArtifactStore, spec: TrajectorySpec, responses: ArtifactRef, anchors: ArtifactRef
) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, responses.key, anchors.key))


@flow(name="trajectories", task_runner=ThreadPoolTaskRunner(max_workers=8), log_prints=True)
def trajectories_flow(
    responses: ArtifactRef,
    anchors: ArtifactRef,
    spec: TrajectorySpec = TrajectorySpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """One record per sample: the step at which each response position is committed."""
    st = ArtifactStore(store)
    ref = trajectories_ref(st, spec, responses, anchors)
    shards = list(st.manifest(responses)["shards"])
    return run_sharded(
        st,
        ref,
        stage.key_spec(spec),
        {"responses": responses.key, "anchors": anchors.key},
        shards,
        stage.trajectories_shard,
        lambda shard: dict(
            store_uri=store, ref=ref, shard=shard, spec=spec, responses=responses, anchors=anchors
        ),
        workers=opts.workers,
        verify_reuse=opts.verify_reuse,
        runner=opts.runner,
        dask_address=opts.dask_address,
        metrics=stage.summarise,
    )
