"""The `gpu` global concurrency limit: created by `a2d serve`, held by the heavy shard tasks.

One slot is one accelerator's worth of work. A shard that loads the teacher and runs it holds a
slot for that stretch, so two served runs (or one run with `workers > 1`) queue for the device
instead of running out of its memory. Outside a run, or against a server without the limit (the
test harness, a local `a2d run`), the slot is a no-op: the limit is an operations choice, not
something the computation depends on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound

from a2d.tasks.runtime import in_prefect_run, logger

GPU_LIMIT = "gpu"

# A lease is renewed while the slot is held; a long forward pass must not be killed because one
# renewal call failed, so renewal failures are logged rather than raised. A run whose process is
# killed cannot release its slot: the server takes it back when the lease runs out, so this is how
# long the Retry of a crashed run (or any other GPU run) may wait for it. A2D_GPU_LEASE_S sets it.
LEASE_VAR = "A2D_GPU_LEASE_S"
LEASE_SECONDS = 60.0


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_VAR)
    try:
        seconds = float(raw) if raw else LEASE_SECONDS
    except ValueError:
        raise ValueError(f"{LEASE_VAR}={raw!r} is not a number of seconds (e.g. 60)") from None
    if seconds < 60:
        raise ValueError(f"{LEASE_VAR}={raw} is under 60 s, the shortest lease a Prefect server grants")
    return seconds


def read_limit(name: str = GPU_LIMIT):
    """The global concurrency limit `name` on the server at PREFECT_API_URL, or None."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return None


def limit_exists(name: str = GPU_LIMIT) -> bool:
    """Whether the server at PREFECT_API_URL has a global concurrency limit called `name`."""
    return read_limit(name) is not None


def ensure_limit(name: str = GPU_LIMIT, slots: int = 1) -> bool:
    """Create the global concurrency limit `name` with `slots` slots unless it exists; True if created.

    An existing limit is left as it is: an operator may have resized it for a bigger machine.
    """
    if slots < 1:
        raise ValueError(f"--gpu-slots must be at least 1 (got {slots})")
    if limit_exists(name):
        return False
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
    return True


@contextmanager
def gpu_slot(occupy: int = 1, name: str = GPU_LIMIT) -> Iterator[None]:
    """Hold `occupy` slots of the `gpu` limit while the block runs, when the server has that limit.

    Waits (without a timeout) until a slot is free; the slot is released when the block exits,
    also on an exception. `name` is for tests, which must not touch the real limit.
    """
    limit = read_limit(name) if in_prefect_run() else None
    if limit is None:
        yield
        return
    if limit.active_slots + occupy > limit.limit:
        logger().info(
            "waiting for a free %r slot: %d of %d held by other runs (one slot is one device's worth of "
            "work; `a2d serve --gpu-slots` sizes the limit on a new server)",
            name,
            limit.active_slots,
            limit.limit,
        )
    with concurrency(
        name,
        occupy=occupy,
        lease_duration=lease_seconds(),
        strict=True,
        raise_on_lease_renewal_failure=False,
    ):
        yield
