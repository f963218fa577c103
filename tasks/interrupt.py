"""SIGTERM as "checkpoint and stop", the signal Kubernetes, Prefect cancellation and `kill` send.

Training loops turn it into a flag they check after each optimizer step (save a checkpoint, then
stop); a parent process that launched training forwards it to the child. Python installs signal
handlers only in the main thread; elsewhere the block runs with the default (the process dies and a
rerun resumes from the last periodic checkpoint instead).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Stopped(RuntimeError):
    """Training stopped on SIGTERM after saving a checkpoint; rerunning the stage resumes it."""


@contextmanager
def on_sigterm(action: Callable[[], None]) -> Iterator[bool]:
    """Call `action` on SIGTERM inside the block; yields whether the handler could be installed."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    old = signal.signal(signal.SIGTERM, lambda *_: action())
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, old)


class StopFlag:
    """Set by SIGTERM; read by a training loop between steps."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> None:
        self.set = True
