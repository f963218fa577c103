"""eval flow: AR baseline, head threshold decoding, d3LLM entropy decoding and VFM K-step on held-out prompts."""

from __future__ import annotations

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from a2d.flows.run_logs import on_crashed
from a2d.flows.stage import DrafterIn, HeadIn, ResponsesIn, TeacherIn, VFMIn, admit, run_sharded
from a2d.specs import EvalSpec, RunOptions
from a2d.stores.artifacts import ArtifactRef, ArtifactStore
from a2d.tasks import evaluate as stage


@flow(name="eval", on_crashed=[on_crashed], task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def eval_flow(
    teacher: TeacherIn,
    responses: ResponsesIn,
    head: HeadIn,
    vfm: VFMIn,
    spec: EvalSpec = EvalSpec(),
    store: str = "./a2d-store",
    opts: RunOptions = RunOptions(),
    drafter: DrafterIn = None,
) -> ArtifactRef:
    """Speed and quality of every decoder; metrics.json, a speed/quality plot and a Markdown report."""
    given = {"teacher": teacher, "responses": responses, "head": head, "vfm": vfm, "drafter": drafter}
    refs, refused = admit(store, given, run=opts)  # before any work; no drafter: not in refs
    if refused is not None:
        return refused
    st = ArtifactStore(store)
    return run_sharded(
        st,
        stage.key_inputs(spec, {k: v.key for k, v in refs.items()}),
        [stage.SHARD],
        stage.eval_run,
        lambda ref, shard: dict(store_uri=st.root.uri, ref=ref, spec=spec, refs=refs, device=opts.device),
        opts,
        stage.summarise,
        fan_out=False,
    )
