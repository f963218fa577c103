"""What runs from served deployments may do: set by the operator of `a2d serve`, never by a run.

A served deployment hands its worker to whoever can reach the Prefect API. Flow parameters are
schema-checked (types, ranges), but a valid value can still point the worker at a foreign bucket,
run a hub repository's code, pickle-talk to an arbitrary Dask scheduler, read any local file into
the store, or build a model that cannot fit. This policy bounds those; it is not a flow parameter
(so the UI form cannot change it) but comes from `a2d serve` flags or `--policy FILE`, and reaches
the flow-run processes through the serve process's environment.
"""

from __future__ import annotations

from pydantic import Field

from a2d.specs.stages import Spec


class ServePolicy(Spec):
    """Operator-side limits on what a run from a served deployment may do; checked before any work."""

    store_roots: tuple[str, ...] = Field(
        (), description="Store roots runs may use (a run's store must be one of them or inside one)"
    )
    data_paths: tuple[str, ...] = Field(
        (),
        description="Local files or folders runs may read: prompts.files and teacher.path must be one or inside one",
    )
    dask_addresses: tuple[str, ...] = Field(
        (), description="Dask scheduler addresses runs may connect to (local clusters are always allowed)"
    )
    allow_remote_code: bool = Field(False, description="Whether runs may set teacher.trust_remote_code")
    max_random_teacher_params: int = Field(
        1_000_000_000, ge=1, description="Largest random teacher (parameters) a run may build"
    )
