"""trajectories flow: d3LLM pseudo-trajectories from the anchors stage's teacher confidence."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import AnchorsIn, ResponsesIn, admit, run_sharded
from a2d.specs import RunOptions, TrajectorySpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import trajectories as stage


@flow(
    name="trajectories",
    on_crashed=[on_crashed],
    task_runner=ThreadPoolTaskRunner(max_workers=8),
    log_prints=True,
)
def trajectories_flow(
    responses: ResponsesIn,
    anchors: AnchorsIn,
    spec: TrajectorySpec = TrajectorySpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """One record per sample: the step at which each response position is committed."""
    refs, refused = admit(store, {"responses": responses, "anchors": anchors}, run=opts)  # before any work
    if refused is not None:
        return refused
    responses, anchors = refs["responses"], refs["anchors"]
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec, responses.key, anchors.key),
        lambda: list(st.manifest(responses)["shards"]),
        stage.trajectories_shard,
        lambda ref, shard: dict(
            store_uri=st.root.uri, ref=ref, shard=shard, spec=spec, responses=responses, anchors=anchors
        ),
        opts,
        stage.summarise,
    )
