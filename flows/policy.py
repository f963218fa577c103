"""Enforcing the serve policy (`a2d.specs.ServePolicy`) on a run's parameters, before any work.

`a2d serve` puts the effective policy into its environment (`A2D_SERVE_POLICY`, JSON); the flow-run
processes it starts inherit it, and every flow checks its parameters against it first thing. A run
outside any served deployment (`a2d run`, a script) has no policy and is not limited.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from a2d.specs import STAGES, PipelineConfig, PromptSpec, RunOptions, ServePolicy, TeacherSpec
from a2d.stores.artifacts import ArtifactRef
from a2d.stores.uri import normalise_uri
from a2d.tasks.runtime import logger

POLICY_ENV = "A2D_SERVE_POLICY"
_KEY = re.compile(r"^[0-9a-f]{16}$")


class PolicyError(ValueError):
    """A run asked for something the serve policy does not allow; the message names each violation."""


def active_policy() -> ServePolicy | None:
    """The policy of the `a2d serve` that started this process, or None outside served runs."""
    raw = os.environ.get(POLICY_ENV)
    return ServePolicy.model_validate_json(raw) if raw else None


def _inside(uri: str, roots: tuple[str, ...]) -> bool:
    """Whether `uri` is one of `roots` or below one (local paths compared after resolving links)."""

    def canonical(u: str) -> str:
        u = normalise_uri(u)
        return "file://" + os.path.realpath(u.removeprefix("file://")) if u.startswith("file://") else u

    target = canonical(uri)
    return any(target == r or target.startswith(r.rstrip("/") + "/") for r in map(canonical, roots))


def violations(
    policy: ServePolicy,
    store: str | None = None,
    teacher: TeacherSpec | None = None,
    prompts: PromptSpec | None = None,
    run: RunOptions | None = None,
    refs: tuple[ArtifactRef, ...] = (),
) -> list[str]:
    """Every way these parameters break `policy`, each with the operator's way to allow it."""
    out = []
    if store is not None and not _inside(store, policy.store_roots):
        out.append(
            f"store {store!r} is not an allowed store root ({', '.join(policy.store_roots) or 'none'}); "
            "the operator allows one with `a2d serve --allow-store URI`"
        )
    if teacher is not None:
        if teacher.trust_remote_code and not policy.allow_remote_code:
            out.append(
                "teacher.trust_remote_code=true would run the checkpoint's own code on this worker; "
                "the operator allows it with `a2d serve --allow-remote-code`"
            )
        if teacher.source == "local" and not _inside(teacher.path or "", policy.data_paths):
            out.append(
                f"teacher.path {teacher.path!r} is outside the allowed data paths; "
                "the operator allows a folder with `a2d serve --allow-data PATH`"
            )
        if teacher.source == "random":
            from a2d.models.teacher import random_teacher_parameters

            n = random_teacher_parameters(teacher.architecture, teacher.layers, teacher.hidden)
            if n > policy.max_random_teacher_params:
                out.append(
                    f"a random {teacher.architecture} teacher of {teacher.layers} layers x {teacher.hidden} has "
                    f"{n:,} parameters, above the limit of {policy.max_random_teacher_params:,}; "
                    "the operator raises it with `a2d serve --max-random-teacher-params N`"
                )
    if prompts is not None and prompts.source == "files":
        for f in prompts.files:
            if not _inside(f, policy.data_paths):
                out.append(
                    f"prompts.files entry {f!r} is outside the allowed data paths; "
                    "the operator allows a folder with `a2d serve --allow-data PATH`"
                )
    if run is not None and run.dask_address and run.dask_address not in policy.dask_addresses:
        out.append(
            f"run.dask_address {run.dask_address!r} is not an allowed Dask scheduler (the Dask protocol "
            "can run code); leave it empty for a local cluster, or the operator allows it with "
            "`a2d serve --allow-dask ADDRESS`"
        )
    for ref in refs:
        if ref.stage not in STAGES or not _KEY.match(ref.key):
            out.append(
                f"artifact reference {ref.stage}/{ref.key} names no artifact (a stage and 16 hex digits)"
            )
    return out


def refusal_message(problems: list[str]) -> str:
    return (
        "refused by the serve policy before any work (a retry is refused the same way; start a run "
        "with allowed parameters, or widen the policy with a2d serve's --allow-* flags): "
        + "; ".join(problems)
    )


def enforce(**parts: Any) -> None:
    """Raise PolicyError (one line) when running under `a2d serve` and these parameters break its policy."""
    policy = active_policy()
    if policy is None:
        return
    problems = violations(policy, **parts)
    if problems:
        raise PolicyError(refusal_message(problems))


def refusal(**parts: Any):
    """For a flow to return before any work: a Failed state whose message is one line naming what the
    serve policy refuses (no traceback in the run's log), or None when the run is allowed."""
    policy = active_policy()
    if policy is None:
        return None
    problems = violations(policy, **parts)
    if not problems:
        return None
    from prefect.states import Failed

    message = refusal_message(problems)
    logger().error(message)
    return Failed(message=message)


def config_parts(config: PipelineConfig) -> dict[str, Any]:
    """The parts of a whole pipeline config the policy checks."""
    return {"store": config.store, "teacher": config.teacher, "prompts": config.prompts, "run": config.run}


def enforce_config(config: PipelineConfig) -> None:
    """`enforce` over a whole pipeline config."""
    enforce(**config_parts(config))


def describe(policy: ServePolicy) -> str:
    """What a served deployment's policy allows, for its description in the UI."""
    roots = ", ".join(policy.store_roots) or "none"
    data = ", ".join(policy.data_paths) or "none"
    dask = ", ".join(policy.dask_addresses) or "local clusters only"
    return (
        f"Serve policy (checked before any work; a refused run fails with one line): store roots {roots}; "
        f"local data {data}; Dask {dask}; remote code {'allowed' if policy.allow_remote_code else 'refused'}; "
        f"random teachers up to {policy.max_random_teacher_params:,} parameters."
    )


def with_flags(
    base: ServePolicy | None,
    store_roots: list[str] | None = None,
    data_paths: list[str] | None = None,
    dask_addresses: list[str] | None = None,
    allow_remote_code: bool = False,
    max_random_teacher_params: int | None = None,
) -> ServePolicy:
    """`base` (from a `--policy` file, or the defaults) widened by `a2d serve`'s flags."""
    base = base or ServePolicy()
    return ServePolicy(
        store_roots=(*base.store_roots, *(store_roots or [])),
        data_paths=(*base.data_paths, *(data_paths or [])),
        dask_addresses=(*base.dask_addresses, *(dask_addresses or [])),
        allow_remote_code=base.allow_remote_code or allow_remote_code,
        max_random_teacher_params=max_random_teacher_params or base.max_random_teacher_params,
    )


def policy_for(config: PipelineConfig, base: ServePolicy | None = None) -> ServePolicy:
    """The policy `a2d serve` enforces: `base` plus what the served config itself uses (its store,
    files, teacher path, Dask address, remote code, random teacher size), so a run of the served
    defaults is always allowed and anything else must be allowed explicitly. Paths are resolved
    against the current folder, as the served config's are."""
    base = base or ServePolicy()
    data = [*base.data_paths, *config.prompts.files]
    if config.teacher.source == "local" and config.teacher.path:
        data.append(config.teacher.path)
    dask = [*base.dask_addresses, *([config.run.dask_address] if config.run.dask_address else [])]
    limit = base.max_random_teacher_params
    if config.teacher.source == "random":
        from a2d.models.teacher import random_teacher_parameters

        t = config.teacher
        limit = max(limit, random_teacher_parameters(t.architecture, t.layers, t.hidden))
    return ServePolicy(
        store_roots=tuple(dict.fromkeys(normalise_uri(u) for u in [*base.store_roots, config.store])),
        data_paths=tuple(dict.fromkeys(str(Path(p).expanduser().resolve()) for p in data)),
        dask_addresses=tuple(dict.fromkeys(dask)),
        allow_remote_code=base.allow_remote_code or config.teacher.trust_remote_code,
        max_random_teacher_params=limit,
    )


def export(policy: ServePolicy) -> None:
    """Make `policy` the one every flow run started from this process enforces."""
    os.environ[POLICY_ENV] = json.dumps(policy.model_dump(mode="json"))
