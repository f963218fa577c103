"""What a flow run's log says when it ends badly: a refusal in one line, a crash with its cause.

A flow that refuses a run returns a Failed state whose message is one line naming the problem and
the fix (`a2d.flows.stage.upstream`, `a2d.flows.policy.refusal`, `a2d.flows.pipeline.checked`).
Prefect then re-raises that state as `FailedRun` where the run was called from (the parent of a
refused stage, the engine of a served run's process) and logs the re-raise with ~20 frames of its
own internals, so a correct refusal reads as a crash. `RefusalLogs`, installed on Prefect's
run loggers when `a2d.flows` is imported (in every process that runs an a2d flow), keeps the
message and drops those frames; a real exception keeps its traceback.

A run whose process dies (SIGKILL, out of memory) is marked Crashed by the runner that started
it, with the exit status in the state's message; its stage subflows ran in that process, stay
Running, and the run's log does not say why. `on_crashed` (every a2d flow's crashed hook, which
the runner calls) writes the cause into the run's log and marks each unfinished subflow Crashed.
"""

from __future__ import annotations

import logging
from typing import Any

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.engine")
ENGINE_EXIT = "Engine execution exited with unexpected exception"


def _refusal(exc: BaseException | None) -> BaseException | None:
    """The `FailedRun` (a returned Failed state, re-raised) in `exc`'s chain, or None."""
    from prefect.exceptions import FailedRun

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, FailedRun):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class RefusalLogs(logging.Filter):
    """Log records of a re-raised Failed state, without Prefect's traceback of the re-raise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or _refusal(record.exc_info[1]) is None:
            return True
        if record.msg == ENGINE_EXIT:  # the run's own final state already says why, in one line
            return False
        reason = str(record.exc_info[1])
        record.msg, record.args = "failed: %s", (reason,)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def install() -> None:
    """Put `RefusalLogs` on Prefect's run loggers once per process."""
    for name in RUN_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, RefusalLogs) for f in log.filters):
            log.addFilter(RefusalLogs())


def on_crashed(flow: Any, flow_run: Any, state: Any) -> None:
    """A crashed run's hook (run by the runner that saw its process end): the cause in the run's
    log, and every unfinished subflow below it marked Crashed with that cause."""
    from prefect.client.orchestration import get_client
    from prefect.logging.loggers import flow_run_logger
    from prefect.states import Crashed

    cause = state.message or "its process ended without a final state"
    flow_run_logger(flow_run, flow).error("run crashed: %s", cause)
    with get_client(sync_client=True) as client:
        for child in unfinished_children(client, flow_run.id):
            client.set_flow_run_state(
                child.id, Crashed(message=f"its parent run {flow_run.name!r} crashed: {cause}"), force=True
            )


def unfinished_children(client: Any, flow_run_id: Any) -> list[Any]:
    """Every subflow run below `flow_run_id`, at any depth, that has no final state."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    found, pending = [], [flow_run_id]
    while pending:
        parent = pending.pop()
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent]))
        )
        for child in children:
            pending.append(child.id)
            if child.state is None or not child.state.is_final():
                found.append(child)
    return found
