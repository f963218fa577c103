"""The eval's lm-evaluation-harness run: the held-out rows exported as a2d's own task, lm-eval's
evaluator over the head's student, and its results summarised for metrics.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from a2d.models.student import Student
from a2d.specs import EvalSpec
from a2d.stores.artifacts import ArtifactRef, ArtifactStore

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"  # a2d's own lm-eval tasks (a2d_bundled)


def lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        raise ValueError(
            "eval.lm_eval_tasks needs lm-evaluation-harness: pip install 'a2d-pipeline[eval]'"
        ) from None


def export_heldout(rows: list[dict], prompts: dict[str, str], path) -> None:
    """The evaluated rows as lm-eval's a2d_bundled task reads them: templated prompt, answer, kind."""
    with open(path, "w") as f:
        for r in rows:
            doc = {
                "sample_id": r["sample_id"],
                "prompt_text": prompts[r["sample_id"]],
                "answer": r["answer"],
                "kind": r["kind"],
            }
            f.write(json.dumps(doc) + "\n")


def run_lm_eval(
    store: ArtifactStore,
    spec: EvalSpec,
    head: ArtifactRef,
    student: Student,
    dspec,
    heldout,
    drafter: ArtifactRef | None = None,
) -> dict:
    """lm-eval's own evaluator over `spec.lm_eval_tasks` with the head's student (already loaded)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from a2d.tasks.harness import A2DLM

    model = A2DLM(
        store=store.root.uri,
        head=head.key,
        decoder=spec.lm_eval_decoder,  # None: the default lossless decoder
        student=student,
        dspec=dspec,
        drafter=drafter.key if drafter is not None else None,
    )
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=list(spec.lm_eval_tasks),
        limit=spec.lm_eval_limit,
        task_manager=TaskManager(
            include_path=str(TASKS_DIR),
            # lm-eval's own index of thousands of task files takes ~15 s to build: only when asked for
            include_defaults=not set(spec.lm_eval_tasks) <= {p.stem for p in Path(TASKS_DIR).glob("*.yaml")},
            metadata={"path": str(heldout)},
        ),
        gen_kwargs=f"max_gen_toks={spec.max_new_tokens}",
        log_samples=False,
    )
    return json.loads(json.dumps(results, default=str))


def lm_eval_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's per-task metrics (stderr dropped) and the a2d model's counted totals."""
    tasks = {
        task: {
            k.split(",")[0]: v for k, v in metrics.items() if "stderr" not in k and k != "alias" and "," in k
        }
        for task, metrics in doc.get("results", {}).items()
    }
    config = doc.get("config", {})
    return {
        "version": doc.get("lm_eval_version") or lm_eval_version(),
        "tasks": tasks,
        "model": {k: v for k, v in config.items() if k.startswith("a2d_")},
    }
