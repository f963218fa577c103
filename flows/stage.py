"""The one way a stage runs: reuse a complete artifact, else plan, map unfinished shards, commit.

Flows call `run_sharded` with the stage's key inputs (from the one `key_inputs` function of
`a2d.tasks.<stage>`); each stage supplies a Prefect task that writes one shard and its marker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import WithJsonSchema

from a2d.specs import RunOptions
from a2d.stores.artifacts import KEY_PATTERN, ArtifactRef, ArtifactStore, Timer
from a2d.stores.keys import KeyInputs
from a2d.tasks.interrupt import forward_sigterm
from a2d.tasks.report import publish_stage_table
from a2d.tasks.runtime import logger

ShardArgs = Callable[[ArtifactRef, str], dict[str, Any]]  # (artifact, shard) -> the shard task's kwargs


def stage_title(stage: str) -> str:
    """A stage's name as a form shows it: "Teacher", "VFM"."""
    return "VFM" if stage == "vfm" else stage.capitalize()


def key_title(stage: str) -> str:
    """The form title of a stage's artifact key: "Teacher artifact key", "VFM artifact key"."""
    return f"{stage_title(stage)} artifact key"


def _key_field(stage: str) -> dict[str, Any]:
    return {
        "type": "string",
        "pattern": KEY_PATTERN.pattern,
        "title": key_title(stage),
        "description": f"Key of the complete {stage} artifact to read (16 hex digits): "
        f"`a2d ls --stage {stage}` lists them",
    }


def upstream(stage: str, optional: bool = False) -> Any:
    """The type of a stage flow's input artifact: an ArtifactRef where the pipeline calls the flow,
    a key (one text field in the deployment's form) where a person starts it; `admit` resolves both."""
    if optional:
        schema = {"anyOf": [_key_field(stage), {"type": "null"}], "title": key_title(stage)}
        return Annotated[ArtifactRef | str | None, WithJsonSchema(schema)]
    return Annotated[ArtifactRef | str, WithJsonSchema(_key_field(stage))]


def admit(
    store: str, inputs: dict[str, ArtifactRef | str | None], **policy: Any
) -> tuple[dict[str, ArtifactRef], Any]:
    """A stage flow's first step, before any work: its input artifacts as refs, and a Failed state
    (one line, no retry helps) when the serve policy refuses the run (`policy`: its parts, as
    `a2d.flows.policy.refusal` takes them) or a key names no complete artifact of its stage in
    `store`; the state is None when the run may go on. Inputs given as None are left out."""
    from prefect.states import Failed

    from a2d.flows.policy import refusal

    given = {stage: v for stage, v in inputs.items() if v is not None}
    refused = refusal(
        store=store, refs=tuple(v for v in given.values() if isinstance(v, ArtifactRef)), **policy
    )
    if refused is not None:
        return {}, refused
    st = ArtifactStore(store)
    refs, problems = {}, []
    for stage, value in given.items():
        if isinstance(value, ArtifactRef):
            refs[stage] = value
        elif not KEY_PATTERN.fullmatch(value):
            problems.append(f"{stage} {value!r} is not an artifact key (16 hex digits)")
        elif not st.is_complete(ref := st.ref(stage, value)):
            problems.append(f"no complete {stage} artifact {value} in {st.root.uri}")
        else:
            refs[stage] = ref
    if not problems:
        return refs, None
    message = "; ".join(problems) + f": `a2d ls --store {st.root.uri}` lists the artifacts there"
    logger().error(message)
    return refs, Failed(message=message)


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


def run_sharded(
    store: ArtifactStore,
    inputs: KeyInputs,
    shards: Sequence[str] | Callable[[], Sequence[str]],
    shard_task: Any,
    shard_kwargs: ShardArgs,
    opts: RunOptions,
    metrics: Callable[[dict[str, dict]], dict[str, Any]] | None = None,
    fan_out: bool = True,
    stoppable: bool = False,
) -> ArtifactRef:
    """Build the artifact `inputs` names, shard by shard, with at most `opts.workers` shard tasks in flight.

    A complete artifact (manifest present) is returned at once. Otherwise finished shards whose
    checksums still verify are kept and only the rest run; the manifest is written last. `shards`
    may be a callable, evaluated only when there is work to do (listing them can read a dataset).
    `fan_out=False` runs the shards one at a time in this process (single-shard training stages).
    `stoppable=True` (training stages) hands SIGTERM from this, the flow's main thread, to the shard
    task's stop action (`a2d.tasks.interrupt`): it checkpoints and fails with a "rerun to resume" error.
    """
    log = logger()
    timer = Timer()
    ref = store.ref_for(inputs)
    # One run builds an artifact at a time: a second run waits here, then finds it complete.

    def waiting() -> None:
        log.info("%s %s: another run is building it; waiting for it to finish", ref.stage, ref.key)

    with store.lock(ref, on_wait=waiting):
        store.clean_scratch(ref)  # what a killed run left behind
        if store.reusable(ref, verify=opts.verify_reuse):
            log.info("%s %s: reused complete artifact at %s", ref.stage, ref.key, ref.uri)
            publish_stage_table(store, ref, seconds=timer.seconds, reused=True)
            return ref
        shards = store.plan_shards(ref, inputs, shards)  # a partial artifact keeps its planned shards
        pending = store.pending_shards(ref, shards, verify=opts.verify_reuse)
        kept = len(shards) - len(pending)
        log.info(
            "%s %s: %d of %d shards already finished, running %d",
            ref.stage,
            ref.key,
            kept,
            len(shards),
            len(pending),
        )
        workers = opts.workers if fan_out else 1
        if fan_out and opts.runner == "dask" and pending:
            _run_on_dask(shard_task, [shard_kwargs(ref, s) for s in pending], workers, opts.dask_address)
            pending = []
        # Submit in waves of `workers`: the bound holds whatever task runner the flow was given.
        with forward_sigterm(f"the {ref.stage} stage") if stoppable else contextlib.nullcontext():
            for start in range(0, len(pending), workers):
                wave = pending[start : start + workers]
                if hasattr(shard_task, "submit"):
                    futures = [shard_task.submit(**shard_kwargs(ref, s)) for s in wave]
                    for future in futures:
                        future.result()
                else:
                    for s in wave:
                        shard_task(**shard_kwargs(ref, s))
        markers = {s: store.marker(ref, s) for s in shards}
        stage_metrics = metrics(markers) if metrics else {}
        stage_metrics["seconds"] = round(timer.seconds, 3)
        store.commit(ref, stage_metrics, markers)
        log.info("%s %s: committed %s", ref.stage, ref.key, ref.uri)
        publish_stage_table(store, ref, seconds=timer.seconds, reused=False, resumed_shards=kept)
        return ref


# The input artifacts of the stage flows, by stage (a form field each: the key).
TeacherIn = upstream("teacher")
PromptsIn = upstream("prompts")
ResponsesIn = upstream("responses")
AnchorsIn = upstream("anchors")
TrajectoriesIn = upstream("trajectories")
HeadIn = upstream("head")
VFMIn = upstream("vfm")
DrafterIn = upstream("drafter", optional=True)
