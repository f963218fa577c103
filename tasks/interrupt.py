"""SIGTERM as "checkpoint and stop", the signal Kubernetes, Prefect cancellation and `kill` send.

Python runs signal handlers only in the main thread, and only the main thread may install one. In
a flow run the main thread is the flow's (subflows included), while its tasks run on worker threads
of the task runner. So the two halves meet here:

- the flow side (`forward_sigterm`, entered by `run_sharded` for training stages, on the flow's main
  thread) installs one handler for the time it waits on its tasks;
- the task side (`on_sigterm(action)`, entered on whatever thread runs the training loop) registers
  what "stop" means for it: set the loop's flag, or pass the signal on to a trainer process.

The handler records the request and runs every registered action. An action registered after the
signal (the task was still loading its model) runs at once, so a SIGTERM is never lost in between.
A training loop checks its flag after each optimizer step, saves a checkpoint and stops; its task
then raises `Stopped`, which fails the run with a "rerun to resume" message.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Stopped(RuntimeError):
    """Training stopped on SIGTERM after saving a checkpoint; rerunning the stage resumes it."""


_LOCK = threading.Lock()
_ACTIONS: list[Callable[[], None]] = []
_REQUESTED = threading.Event()


def _handler(signum: int, frame: object) -> None:
    _REQUESTED.set()
    with _LOCK:
        actions = list(_ACTIONS)
    for action in actions:
        action()


def forwarding() -> bool:
    """Whether SIGTERM currently goes to the registered stop actions (readable from any thread)."""
    return signal.getsignal(signal.SIGTERM) is _handler


def stop_requested() -> bool:
    """Whether SIGTERM arrived since the forwarding block began (checked before starting work)."""
    return _REQUESTED.is_set()


@contextmanager
def forward_sigterm(what: str | None = "the stage") -> Iterator[bool]:
    """Route SIGTERM to the registered stop actions while the block runs; yields whether it could.

    Must be entered on the main thread (the flow's); elsewhere it yields False and changes nothing.
    With `what`, a SIGTERM that arrived although the block ended normally (the training had just
    finished, say) raises `Stopped` on exit: the signal asked the process to end, and the next stage
    must not start.
    """
    if threading.current_thread() is not threading.main_thread() or forwarding():
        yield forwarding()
        return
    previous = signal.signal(signal.SIGTERM, _handler)
    _REQUESTED.clear()
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, previous)
    if _REQUESTED.is_set() and what is not None:
        _REQUESTED.clear()
        raise Stopped(f"stopped by SIGTERM after {what} finished; rerun to continue from there")


@contextmanager
def on_sigterm(action: Callable[[], None]) -> Iterator[bool]:
    """Call `action` on SIGTERM while the block runs, on any thread; yields whether SIGTERM reaches it.

    Off the main thread this needs a `forward_sigterm` block on the main thread (run_sharded enters one
    for training stages); on the main thread (a script calling the training loop) it enters its own.
    """
    main = threading.current_thread() is threading.main_thread()
    with forward_sigterm(what=None) if main else _nothing():
        with _LOCK:
            _ACTIONS.append(action)
        try:
            if _REQUESTED.is_set():  # the signal came while this task was still getting ready
                action()
            yield forwarding()
        finally:
            with _LOCK:
                _ACTIONS.remove(action)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class StopFlag:
    """Set by SIGTERM; read by a training loop between steps."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> None:
        self.set = True
