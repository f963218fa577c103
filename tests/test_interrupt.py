"""SIGTERM reaches a training loop on a worker thread through the main thread's forwarding block."""

import os
import signal
import threading

import pytest

from a2d.tasks.interrupt import Stopped, forward_sigterm, forwarding, on_sigterm, stop_requested


def _in_thread(fn) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised on the main thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    if errors:
        raise errors[0]


def test_sigterm_on_the_main_thread_reaches_an_action_registered_on_a_worker_thread():
    before = signal.getsignal(signal.SIGTERM)
    registered, stopped = threading.Event(), threading.Event()
    seen: list[bool] = []

    def worker() -> None:
        with on_sigterm(stopped.set) as reachable:
            seen.append(reachable)
            registered.set()
            assert stopped.wait(timeout=60)  # set by the main thread's handler

    with pytest.raises(Stopped, match="rerun"), forward_sigterm("the head stage") as installed:
        assert installed and forwarding()
        thread = threading.Thread(target=worker)
        thread.start()
        assert registered.wait(timeout=60)
        os.kill(os.getpid(), signal.SIGTERM)
        thread.join(timeout=60)
        assert stopped.is_set() and seen == [True] and stop_requested()
    assert signal.getsignal(signal.SIGTERM) is before and not forwarding()


def test_a_signal_before_the_action_is_registered_is_not_lost():
    stopped = threading.Event()
    calls: list[bool] = []

    def worker() -> None:
        with on_sigterm(stopped.set):
            calls.append(stopped.is_set())  # called on registration, before any step runs

    with pytest.raises(Stopped), forward_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)  # the task is still loading its model
        _in_thread(worker)
    assert calls == [True]


def test_without_forwarding_a_worker_thread_is_told_sigterm_cannot_reach_it():
    seen: list[bool] = []

    def worker() -> None:
        with on_sigterm(lambda: None) as reachable:
            seen.append(reachable)

    _in_thread(worker)
    assert seen == [False]
    with forward_sigterm():  # no signal: the block ends normally
        _in_thread(worker)
    assert seen == [False, True]


def test_on_the_main_thread_a_loop_installs_its_own_handler_only_while_it_runs():
    before = signal.getsignal(signal.SIGTERM)
    stopped = threading.Event()
    with on_sigterm(stopped.set) as reachable:
        assert reachable
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.wait(timeout=60)
    assert signal.getsignal(signal.SIGTERM) is before
