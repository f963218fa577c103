"""Where code is running: inside a Prefect run or not, and the logger that fits."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError


def in_prefect_run() -> bool:
    """True inside a flow or task run (artifacts and concurrency slots exist only there)."""
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, the module logger outside one (plain unit tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("a2d")
