"""Locks between runs: one writer per artifact, whichever process or thread it runs in.

A lock is `flock` on a small file. The kernel drops it when its holder exits, also by SIGKILL, so a
crashed run never leaves a stale lock behind, and nothing has to be cleaned up. It works on local
disks and on NFSv4; object stores have no equivalent, so `ArtifactStore.lock` keeps their lock files
in the local cache (runs on one machine are serialised, runs on different machines are not).
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_HELD = threading.local()  # lock paths this thread holds: taking one again does not deadlock


@contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) while the block runs.

    When another process or thread holds it, `on_wait` is called once and the caller blocks until
    the lock is free: a second run waits for the first instead of racing it.
    """
    held: set[str] = _HELD.__dict__.setdefault("paths", set())
    key = str(path)
    if key in held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
            fcntl.flock(f, fcntl.LOCK_UN)
