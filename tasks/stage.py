"""The one way a stage runs: reuse a complete artifact, else plan, map unfinished shards, commit.

Flows call `run_sharded`; each stage supplies a Prefect task that writes one shard and its marker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from stores.artifacts import ArtifactRef, ArtifactStore, Timer
from tasks.report import publish_stage_table

ShardArgs = Callable[[str], dict[str, Any]]


def _run_on_dask(shard_task: Any, kwargs: list[dict[str, Any]], workers: int, address: str | None) -> None:
    """Run shard tasks on a Dask cluster: an existing one at `address`, or a local one of `workers` processes."""
    from prefect_dask import DaskTaskRunner

    options: dict[str, Any] = (
        {"address": address}
        if address
        else {
            "cluster_kwargs": {
                "n_workers": workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            }
        }
    )
    with DaskTaskRunner(**options) as runner:
        futures = [runner.submit(shard_task, parameters=kw) for kw in kwargs]
        for future in futures:
            future.result()


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, the module logger outside one (plain unit tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("a2d")


def run_sharded(
    store: ArtifactStore,
    ref: ArtifactRef,
    spec: Any,
    upstream: Mapping[str, str],
    shards: Sequence[str],
    shard_task: Any,
    shard_kwargs: ShardArgs,
    workers: int,
    verify_reuse: bool = True,
    runner: str = "threads",
    dask_address: str | None = None,
    metrics: Callable[[dict[str, dict]], dict[str, Any]] | None = None,
) -> ArtifactRef:
    """Build `ref` shard by shard with at most `workers` shard tasks in flight.

    A complete artifact (manifest present) is returned at once. Otherwise finished shards whose
    checksums still verify are kept and only the rest run; the manifest is written last.
    """
    log = logger()
    timer = Timer()
    if store.reusable(ref, verify=verify_reuse):
        log.info("%s %s: reused complete artifact at %s", ref.stage, ref.key, ref.uri)
        publish_stage_table(store, ref, seconds=timer.seconds, reused=True)
        return ref
    plan = store.plan(ref)
    if plan and not shards:
        shards = plan["shards"]  # a demoted artifact: same shards as planned
    store.write_plan(ref, spec, upstream, list(shards))
    pending = []
    for shard in shards:
        if store.finished_shard(ref, shard, verify=verify_reuse) is None:
            store.discard_shard(ref, shard)
            pending.append(shard)
    log.info(
        "%s %s: %d of %d shards already finished, running %d",
        ref.stage,
        ref.key,
        len(shards) - len(pending),
        len(shards),
        len(pending),
    )
    if runner == "dask" and pending:
        _run_on_dask(shard_task, [shard_kwargs(s) for s in pending], workers, dask_address)
        pending = []
    # Submit in waves of `workers`: the bound holds whatever task runner the flow was given.
    for start in range(0, len(pending), workers):
        wave = pending[start : start + workers]
        if hasattr(shard_task, "submit"):
            futures = [shard_task.submit(**shard_kwargs(s)) for s in wave]
            for future in futures:
                future.result()
        else:
            for s in wave:
                shard_task(**shard_kwargs(s))
    markers = {s: store.marker(ref, s) for s in shards}
    stage_metrics = metrics(markers) if metrics else {}
    stage_metrics["seconds"] = round(timer.seconds, 3)
    store.commit(ref, stage_metrics)
    log.info("%s %s: committed %s", ref.stage, ref.key, ref.uri)
    publish_stage_table(store, ref, seconds=timer.seconds, reused=False)
    return ref
