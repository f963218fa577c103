"""The `a2d` command line: run, plan, ls, show, verify, generate, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from a2d.flows.store_commands import (
    DEFAULT_STORE,
    cmd_ls,
    cmd_show,
    cmd_verify,
    format_table,
    human_size,
    store_arg,
)
from a2d.specs import STAGES, ConfigError, load_config

STARTUP_TIMEOUT_VAR = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = 180  # Prefect's default is 20 s


def cmd_run(args: argparse.Namespace) -> int:
    from a2d.flows.pipeline import plan, preflight, stages_until

    overrides = list(args.set or [])
    if args.store:
        overrides.append(f"store={args.store}")
    elif os.environ.get("A2D_STORE"):
        overrides.append(f"store={os.environ['A2D_STORE']}")
    config = load_config(args.config, overrides)
    until = args.until or STAGES[-1]
    stages = stages_until(until, config)
    preflight(config, stages, {})  # what the config alone decides, before any server
    start = time.perf_counter()
    print(_plan_or_reason(config, stages))
    # The store decides reuse: when every artifact is already complete, no flow (and no
    # Prefect server) needs to start at all.
    from a2d.stores.artifacts import ArtifactStore

    store = ArtifactStore(config.store)
    refs = plan(config, until)
    # Checksums are re-hashed only when every artifact is complete: otherwise the stages verify
    # what they reuse themselves, and hashing here first would read every shard twice.
    complete = all(store.is_complete(r) for r in refs.values())
    if complete and all(_reusable(store, r, config.run.verify_reuse) for r in refs.values()):
        for stage, ref in refs.items():
            print(f"reuse {stage:<12} {ref.key}  (complete at {ref.uri})")
    else:
        from a2d.flows.pipeline import pipeline

        refs = pipeline(config, until)
    rows = [row | {"size": human_size(row["bytes"])} for row in map(store.describe, refs.values())]
    print(format_table(rows, ["stage", "key", "complete", "rows", "tokens", "size"]))
    print(f"done in {time.perf_counter() - start:.1f} s; store {store.root.uri}")
    if "eval" in refs:
        from a2d.tasks.eval_report import print_table

        print("\neval (held-out prompts):")
        print(print_table(store, refs["eval"]))
    return 0


def _plan_or_reason(config: Any, stages: tuple[str, ...]) -> str:
    """The projected bytes per stage, or one line saying why there is none (a run goes on without)."""
    from a2d.flows.plan import format_plan, plan_config

    try:
        return format_plan(plan_config(config, stages))
    except (ValueError, OSError) as e:
        return f"plan: no projection ({e})"


def cmd_plan(args: argparse.Namespace) -> int:
    from a2d.flows.pipeline import stages_until
    from a2d.flows.plan import format_plan, plan_config

    config = load_config(args.config, list(args.set or []))
    projected = plan_config(config, stages_until(args.until or STAGES[-1], config), rows=args.rows)
    print(json.dumps(projected.as_json(), indent=2) if args.json else format_plan(projected))
    return 0


def _reusable(store: Any, ref: Any, verify: bool) -> bool:
    """`store.reusable` under the artifact's lock: it may repair or demote what it checks."""
    with store.lock(ref):
        return store.reusable(ref, verify=verify)


def cmd_generate(args: argparse.Namespace) -> int:
    from a2d.stores.artifacts import ArtifactStore
    from a2d.tasks.generation import find_head, generate, render_steps

    store = ArtifactStore(store_arg(args))
    head = find_head(store, args.head)

    def stream(piece: str) -> None:
        print(piece, end="", flush=True)

    gen = generate(store, head, args.prompt, args.decoder, args.max_new_tokens, args.device, stream)
    print()
    print(f"head {head.key}  decoder {gen.decoder}", file=sys.stderr)
    if args.show_steps:
        print(render_steps(gen))
    print(
        f"{len(gen.tokens)} tokens, {gen.forwards} forwards ({len(gen.tokens) / max(gen.forwards, 1):.2f} tokens "
        f"per forward), {gen.tokens_per_s:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from a2d.deployments.serve import load_policy, serve
    from a2d.flows.policy import with_flags

    overrides = list(args.set or [])
    if args.store:
        overrides.append(f"store={args.store}")
    elif os.environ.get("A2D_STORE"):
        overrides.append(f"store={os.environ['A2D_STORE']}")
    flags = with_flags(
        load_policy(args.policy),
        store_roots=args.allow_store,
        data_paths=args.allow_data,
        dask_addresses=args.allow_dask,
        allow_remote_code=args.allow_remote_code,
        max_random_teacher_params=args.max_random_teacher_params,
    )
    serve(
        args.config,
        cron=args.cron,
        overrides=overrides,
        gpu_slots=args.gpu_slots,
        policy=flags,
        timezone=args.timezone,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a2d", description="Turn an AR LLM into a fast diffusion LLM.")
    sub = p.add_subparsers(dest="command", required=True)

    def with_store(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--store", help=f"store root: path or URI (default $A2D_STORE or {DEFAULT_STORE})")
        return sp

    run = with_store(sub.add_parser("run", help="run the pipeline locally (no server needed)"))
    run.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    run.add_argument(
        "--set", action="append", metavar="K=V", help="override a config field, e.g. run.batch_size=4"
    )
    run.add_argument("--until", choices=STAGES, help="stop after this stage")
    run.set_defaults(fn=cmd_run)

    plan = sub.add_parser("plan", help="projected bytes per stage of a config, before any work")
    plan.add_argument("config", help="YAML config, e.g. configs/qwen3.6-27b.yaml")
    plan.add_argument("--set", action="append", metavar="K=V", help="override a config field")
    plan.add_argument("--until", choices=STAGES, help="only the stages a run up to this one builds")
    plan.add_argument("--rows", type=int, help="rows to plan for (default: the config's, e.g. bundled_rows)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(fn=cmd_plan)

    ls = with_store(sub.add_parser("ls", help="list artifacts"))
    ls.add_argument("--stage", choices=STAGES)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_ls)

    show = with_store(sub.add_parser("show", help="manifest, lineage and sample rows of one artifact"))
    show.add_argument("key", help="artifact key (a unique prefix, or stage/key)")
    show.add_argument("--rows", type=int, default=3)
    show.add_argument("--json", action="store_true")
    show.set_defaults(fn=cmd_show)

    verify = with_store(sub.add_parser("verify", help="re-check checksums; exit 1 on any mismatch"))
    verify.add_argument("key", nargs="?", help="one artifact (default: all)")
    verify.add_argument("--json", action="store_true")
    verify.set_defaults(fn=cmd_verify)

    gen = with_store(sub.add_parser("generate", help="answer a prompt with a trained head, streamed"))
    gen.add_argument(
        "--prompt", required=True, help="the user message (the teacher's chat template is applied)"
    )
    gen.add_argument("--head", help="head key (a unique prefix; default: the newest complete head)")
    gen.add_argument(
        "--decoder",
        default=None,
        help="a decoder name (a2d.models.decoders); default: spec:drafter+lookup where the store holds a drafter "
        "of the head's teacher, else spec:head+lookup (both lossless: the base model's own output); others: "
        "spec:drafter, spec:head, spec:lookup, ar:student-base, threshold:0.9 (parallel, lossy), head:k1, vfm:k1, ...",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--show-steps", action="store_true", help="print which tokens each forward committed")
    gen.set_defaults(fn=cmd_generate)

    serve = with_store(
        sub.add_parser(
            "serve", help="serve every flow as a deployment to the Prefect server at PREFECT_API_URL"
        )
    )
    serve.add_argument(
        "--config", default=None, help="YAML config giving every deployment's default parameters"
    )
    serve.add_argument("--set", action="append", metavar="K=V", help="override a config field")
    serve.add_argument("--cron", default=None, help='cron schedule for regenerate-data, e.g. "0 3 * * *"')
    serve.add_argument(
        "--timezone",
        default=None,
        help="IANA timezone the cron is read in (default: this machine's, else UTC)",
    )
    serve.add_argument(
        "--gpu-slots", type=int, default=1, help="slots of the `gpu` concurrency limit when creating it"
    )
    policy = serve.add_argument_group(
        "policy",
        "what runs from these deployments may do (the UI cannot change it; the served config's "
        "own store, files, teacher path and Dask address are always allowed)",
    )
    policy.add_argument(
        "--policy", metavar="FILE", help="YAML with store_roots, data_paths, dask_addresses, ..."
    )
    policy.add_argument(
        "--allow-store", action="append", metavar="URI", help="another store root runs may use"
    )
    policy.add_argument(
        "--allow-data", action="append", metavar="PATH", help="a local file or folder runs may read"
    )
    policy.add_argument(
        "--allow-dask", action="append", metavar="ADDRESS", help="a Dask scheduler runs may use"
    )
    policy.add_argument(
        "--allow-remote-code",
        action="store_true",
        help="let runs set teacher.trust_remote_code (runs its code)",
    )
    policy.add_argument(
        "--max-random-teacher-params", type=int, metavar="N", help="largest random teacher (default 1e9)"
    )
    serve.set_defaults(fn=cmd_serve)
    return p


@contextmanager
def prefect_session() -> Iterator[int]:
    """The Prefect settings every a2d entry point runs flows under (the CLI, the benchmarks); yields
    the temporary server's startup timeout in seconds.

    The temporary Prefect server a run may start stays off the network unless the user opts in
    (offline machines otherwise log a telemetry error on every run), and gets 180 s to start where
    Prefect gives 20 s (a loaded laptop, or 2 busy cores, needs more). Prefect reads its settings
    when it is imported, so the environment alone is too late: they are set here for this process
    too. Processes a run starts inherit both through the environment."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    os.environ.setdefault(STARTUP_TIMEOUT_VAR, str(STARTUP_TIMEOUT_S))
    startup_s = startup_seconds()
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: startup_s}):
        yield startup_s


def startup_seconds() -> int:
    """The temporary Prefect server's startup timeout: STARTUP_TIMEOUT_VAR, else 180 s."""
    return int(float(os.environ.get(STARTUP_TIMEOUT_VAR, STARTUP_TIMEOUT_S)))


def main(argv: list[str] | None = None) -> int:
    from prefect.exceptions import FailedRun

    from a2d.stores.artifacts import StoreWriteError

    startup_s = startup_seconds()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        with prefect_session():
            return args.fn(args)
    except (ConfigError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"a2d: error: {msg}", file=sys.stderr)
        return 2
    except FailedRun as e:  # a run that refused itself (policy, config): its one line
        print(f"a2d: error: {e}", file=sys.stderr)
        return 2
    except StoreWriteError as e:  # names the object, the store and what to do; the run's log has the rest
        print(f"a2d: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        if "ephemeral Prefect API server" not in str(e):
            raise
        print(
            f"a2d: error: the temporary Prefect server did not start within {startup_s} s "
            f"(a busy machine?): set {STARTUP_TIMEOUT_VAR}=300, or start one with `prefect server start` "
            "and set PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        print(f"a2d: Prefect said: {str(e)[:2000]}", file=sys.stderr)  # the server's own output
        return 2


if __name__ == "__main__":
    sys.exit(main())
