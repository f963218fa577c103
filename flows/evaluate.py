"""eval flow: AR baseline, head threshold decoding, d3LLM entropy decoding and VFM K-step on held-out prompts."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import EvalSpec, RunOptions
from stores.artifacts import ArtifactRef, ArtifactStore
from tasks import evaluate as stage
from tasks.stage import run_sharded


def eval_ref(store: ArtifactStore, spec: EvalSpec, refs: dict[str, ArtifactRef]) -> ArtifactRef:
    return store.ref(stage.STAGE, stage.key_for(spec, {k: v.key for k, v in refs.items()}))


@flow(name="eval", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def eval_flow(
    teacher: ArtifactRef,
    responses: ArtifactRef,
    head: ArtifactRef,
    vfm: ArtifactRef,
    spec: EvalSpec = EvalSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
) -> ArtifactRef:
    """Speed and quality of every sampler; metrics.json, a speed/quality plot and a Markdown report."""
    st = ArtifactStore(store)
    refs = {"teacher": teacher, "responses": responses, "head": head, "vfm": vfm}
    ref = eval_ref(st, spec, refs)
    return run_sharded(
        st,
        ref,
        spec,
        {k: v.key for k, v in refs.items()},
        [stage.SHARD],
        stage.eval_run,
        lambda shard: dict(store_uri=store, ref=ref, spec=spec, refs=refs, device=opts.device),
        workers=1,
        verify_reuse=opts.verify_reuse,
        metrics=stage.summarise,
    )
