"""`a2d serve`: one Prefect deployment per stage flow, the pipeline and regenerate-data, served locally.

Every deployment's default parameters come from one config, so a run started from the UI without
edits runs that config. The stage flows are found from `a2d.flows.pipeline.STEPS` (the flow named
after each stage), so a stage added there is served without touching this file; only whether it
needs a GPU is declared here (`GPU_FLOWS`), and a test checks that against the `gpu` tags of the
stage's tasks.

    prefect server start --host 127.0.0.1 &
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    a2d serve --config configs/tiny.yaml
    prefect deployment run 'pipeline/tiny · pipeline' --params '{"until": "prompts"}' --watch

Run parameters replace a deployment's defaults per top-level name: `{"until": "prompts"}` keeps
the served config, while passing `config` replaces all of it (omitted fields take the flow's
defaults, not the served config's).

Whoever reaches the API can start runs, so runs are bounded by a policy the operator sets here and
the UI cannot change (`a2d.specs.ServePolicy`, enforced by every flow before any work): the store
roots, the local data paths, the Dask schedulers a run may use, whether it may run a checkpoint's
own code, and the largest random teacher. What the served config itself uses is always allowed;
anything else needs `--allow-store`, `--allow-data`, `--allow-dask`, `--allow-remote-code`,
`--max-random-teacher-params` or a `--policy FILE` (YAML with those fields).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.types.entrypoint import EntrypointType
from prefect.utilities.callables import ParameterSchema, parameter_schema

from a2d.flows.policy import describe, export, policy_for
from a2d.flows.stage import key_title, stage_title
from a2d.specs import STAGES, ConfigError, PipelineConfig, ServePolicy, load_config
from a2d.tasks.concurrency import GPU_LIMIT, ensure_limit

log = logging.getLogger("a2d.serve")

# Flows whose runs load and run a model: the Kubernetes pool gives these `nvidia.com/gpu: 1`.
GPU_FLOWS = frozenset(
    {"responses", "anchors", "drafter", "head", "vfm", "eval", "pipeline", "regenerate-data"}
)

# Flows served besides one per stage: (flow name, module, attribute).
EXTRA_FLOWS = (
    ("pipeline", "a2d.flows.pipeline", "pipeline"),
    ("regenerate-data", "a2d.flows.regenerate", "regenerate_data"),
)

HEARTBEAT_S = 30  # flow runs of served deployments tell the server they are alive this often
CRASHED_AFTER_S = 120  # and are marked Crashed when none came for this long (a killed process)
CRASH_AUTOMATION = "a2d: mark silent flow runs Crashed"

NO_SERVER = (
    "PREFECT_API_URL is not set, so there is no Prefect server to serve to. Start one and point at it:\n"
    "    prefect server start --host 127.0.0.1\n"
    "    export PREFECT_API_URL=http://127.0.0.1:4200/api\n"
    "then run `a2d serve` again"
)


@dataclass(frozen=True)
class Served:
    """One served flow: where it lives and whether its runs need a GPU."""

    name: str
    module: str
    attr: str

    @property
    def entrypoint(self) -> str:
        """The `prefect.yaml` form, a module path: `a2d.flows.anchors.anchors_flow`."""
        return f"{self.module}.{self.attr}"

    @property
    def gpu(self) -> bool:
        return self.name in GPU_FLOWS

    def load(self) -> Flow:
        flow = getattr(importlib.import_module(self.module), self.attr)
        if not isinstance(flow, Flow) or flow.name != self.name:
            raise TypeError(f"{self.entrypoint} is not the Prefect flow named {self.name!r}")
        return flow


def registry() -> list[Served]:
    """Every served flow: one per stage in pipeline order, then the pipeline and regenerate-data.

    A stage's flow is the one named after the stage among the flows `flows/pipeline.py` imports,
    wherever it lives (`flows/evaluate.py:eval_flow` serves the `eval` stage).
    """
    import a2d.flows.pipeline

    chained = {obj.name: obj for obj in vars(a2d.flows.pipeline).values() if isinstance(obj, Flow)}
    stages = []
    for stage in a2d.flows.pipeline.STEPS:
        if stage not in chained:
            raise LookupError(f"stage {stage!r} has no flow named {stage!r} imported in flows/pipeline.py")
        fn = chained[stage].fn
        stages.append(Served(stage, fn.__module__, fn.__name__))
    return stages + [Served(*extra) for extra in EXTRA_FLOWS]


def planned_refs(config: PipelineConfig) -> dict[str, Any]:
    """Every stage's `ArtifactRef` under `config`, from specs alone (nothing runs)."""
    from a2d.flows.pipeline import plan

    return plan(config)


def default_parameters(flow: Flow, stage: str, config: PipelineConfig) -> dict[str, Any]:
    """The flow's parameters filled from `config`, by the names every a2d flow uses.

    `config` is the whole config; `spec` the stage's own spec; `teacher_spec`, `store` and `opts`
    the shared parts; a parameter named after a stage is that stage's planned artifact key, any
    other parameter named after a config field (`train`, say) is that field, and the rest keep
    the flow's defaults (so the form shows every field filled). A required parameter with nothing
    to fill it is an error here rather than a form nobody can submit.
    """
    shared: dict[str, Any] = {
        "config": config,
        "teacher_spec": config.teacher,
        "store": config.store,
        "opts": config.run,
    }
    if stage in PipelineConfig.model_fields:
        shared["spec"] = getattr(config, stage)
    params: dict[str, Any] = {}
    refs: dict[str, Any] | None = None
    for name, p in inspect.signature(flow.fn).parameters.items():
        if name in shared:
            params[name] = shared[name]
            continue
        refs = planned_refs(config) if refs is None else refs
        if name in refs:
            params[name] = refs[name].key  # the form's field is the key (a2d.flows.stage.upstream)
        elif name in PipelineConfig.model_fields:
            params[name] = getattr(config, name)
        elif p.default is not inspect.Parameter.empty:
            params[name] = p.default  # shown filled in the form: every field is the deployment's
        else:
            raise TypeError(
                f"flow {flow.name!r} parameter {name!r} has no default and no config field to fill it: "
                "name it after a config field or an upstream stage"
            )
    return {k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in params.items()}


# What a person reads above each top-level field of a deployment's form (Prefect titles them by
# the parameter's name); a stage's own settings are "<Stage> settings", an input its key's title.
FORM_TITLES = {
    "config": "Pipeline config",
    "until": "Run until stage (inclusive)",
    "teacher_spec": "Teacher model",
    "train": "Checkpointing and tracking",
    "store": "Store root",
    "opts": "Run options",
}


def form_schema(flow: Flow, stage: str) -> ParameterSchema:
    """The parameter schema a deployment's form is drawn from: Prefect's, with readable titles, and
    every top-level field required. The deployment fills each from the served config (the server
    merges those defaults under a run's own parameters before validating), so none is optional,
    and the form shows no "(Optional)" on them. Nested fields keep their defaults: a run that
    passes a whole `config` may leave fields out."""
    schema = parameter_schema(flow)
    schema.required = list(schema.properties)
    for name, prop in schema.properties.items():
        if name == "spec":
            prop["title"] = f"{stage_title(stage)} settings"
        elif name in FORM_TITLES:
            prop["title"] = FORM_TITLES[name]
        elif name in STAGES:
            prop["title"] = key_title(name)
    return schema


def absolute_store(config: PipelineConfig) -> PipelineConfig:
    """A local relative store is resolved now, so runs write where `a2d serve` was started."""
    from a2d.stores.uri import normalise_uri

    return config.model_copy(update={"store": normalise_uri(config.store).removeprefix("file://")})


def deployment_name(config_name: str, flow_name: str) -> str:
    """What the UI lists a deployment as: the config and the stage (`tiny · head`); the CLI's full
    name is `<flow>/<this>`, e.g. `prefect deployment run 'pipeline/tiny · pipeline'`."""
    return f"{config_name} · {flow_name}"


def local_timezone() -> str:
    """The IANA name of this machine's timezone (TZ, else /etc/localtime's target), else UTC: the
    schedule's times are read in it, and the UI shows it beside them."""
    from zoneinfo import available_timezones

    zones = available_timezones()
    name = os.environ.get("TZ", "").lstrip(":")
    if name not in zones:
        target = os.path.realpath("/etc/localtime")
        name = target.split("zoneinfo/", 1)[1] if "zoneinfo/" in target else ""
    return name if name in zones else "UTC"


def device_tag(served: Served, config: PipelineConfig) -> str:
    """`gpu` for a flow that runs a model when the config runs on an accelerator (`run.device: auto`:
    when this machine has one); `cpu` otherwise: on a CPU machine every stage is a CPU job."""
    from a2d.models.teacher import resolve_device

    return "gpu" if served.gpu and resolve_device(config.run.device).type != "cpu" else "cpu"


def build_deployments(
    config: PipelineConfig,
    cron: str | None = None,
    policy: ServePolicy | None = None,
    timezone: str | None = None,
) -> list[RunnerDeployment]:
    """One deployment per served flow, named after the config and the stage, parameters validated by
    the server; each description says what the serve policy (default: what the config itself uses)
    allows. `cron` schedules regenerate-data in `timezone` (default: this machine's)."""
    from prefect.schedules import Cron

    if "/" in config.name:
        raise ValueError(f"config name {config.name!r} names the deployments and cannot contain '/'")
    if timezone is not None:
        from zoneinfo import available_timezones

        if timezone not in available_timezones():
            raise ValueError(
                f"--timezone {timezone!r} is not an IANA timezone name (e.g. Europe/Berlin, UTC)"
            )
    config = absolute_store(config)
    allowed = describe(policy or policy_for(config))
    deployments = []
    for served in registry():
        flow = served.load()
        scheduled = cron is not None and served.name == "regenerate-data"
        deployment = flow.to_deployment(
            name=deployment_name(config.name, served.name),
            parameters=default_parameters(flow, served.name, config),
            schedule=Cron(cron, timezone=timezone or local_timezone()) if scheduled else None,
            tags=["a2d", device_tag(served, config)],
            description=f"{flow.description or flow.name}\n\nDefaults: config {config.name!r}, store "
            f"{config.store}. Artifact keys: `a2d ls --store {config.store}`.\n\n{allowed}",
            enforce_parameter_schema=True,
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
        deployment._parameter_openapi_schema = form_schema(flow, served.name)  # no public setter
        deployments.append(deployment)
    return deployments


def check_server() -> str:
    """The API URL of a reachable Prefect server, or a ValueError saying how to start one."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ValueError(NO_SERVER)
    with get_client(sync_client=True) as client:
        problem = client.api_healthcheck()
    if problem is not None:
        raise ValueError(
            f"cannot reach the Prefect server at PREFECT_API_URL={url} ({problem}); "
            "is `prefect server start --host 127.0.0.1` running?"
        )
    return url


def ensure_crash_detection(silence_s: int = CRASHED_AFTER_S) -> bool:
    """The server-side half of crash detection: an automation that marks a flow run Crashed when its
    heartbeats stop for `silence_s` without a final state (its process was killed). Created once per
    server; returns whether this call created it. The runs' half is `PREFECT_FLOWS_HEARTBEAT_FREQUENCY`,
    which `serve` sets for every run it starts."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.exceptions import ObjectNotFound

    try:
        Automation.read(name=CRASH_AUTOMATION)
        return False
    except (ObjectNotFound, ValueError):
        pass
    Automation(
        name=CRASH_AUTOMATION,
        description="A flow run that stopped sending heartbeats without finishing was killed: mark it "
        "Crashed so that Retry resumes it from its finished shards and last checkpoint.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {silence_s} s: the run's process died (killed, out of memory, "
                "machine lost); Retry resumes it from finished shards and the last checkpoint",
            )
        ],
    ).create()
    return True


def load_policy(path: str | None) -> ServePolicy | None:
    """A `--policy` YAML file (ServePolicy fields), or None without one."""
    if path is None:
        return None
    import yaml
    from pydantic import ValidationError

    try:
        return ServePolicy.model_validate(yaml.safe_load(open(path).read()) or {})
    except (OSError, yaml.YAMLError, ValidationError) as e:
        raise ConfigError(f"--policy {path}: {e}") from None


def serve(
    config_path: str | None,
    cron: str | None = None,
    overrides: list[str] | None = None,
    gpu_slots: int = 1,
    policy: ServePolicy | None = None,
    timezone: str | None = None,
) -> None:
    """Serve every deployment to the server at PREFECT_API_URL until interrupted.

    `cron` schedules `regenerate-data` (e.g. "0 3 * * *", in `timezone`, default this machine's);
    the `gpu` global concurrency limit is created with `gpu_slots` slots when the server does not
    have it yet. `policy` (with what the
    served config uses added, see `policy_for`) bounds every run of these deployments.
    """
    from prefect import serve as prefect_serve

    config = absolute_store(load_config(config_path, overrides))
    url = check_server()
    effective = policy_for(config, policy)
    deployments = build_deployments(config, cron, effective, timezone)
    export(effective)  # inherited by the process of every flow run started from here
    log.info("serve policy: %s", effective.model_dump_json())
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))  # inherited by every run
    log.info(
        "crash detection: runs send a heartbeat every %s s; automation %r %s",
        os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"],
        CRASH_AUTOMATION,
        "created" if ensure_crash_detection() else "already exists",
    )
    created = ensure_limit(GPU_LIMIT, gpu_slots)
    log.info(
        "global concurrency limit %r %s on %s",
        GPU_LIMIT,
        f"created with {gpu_slots} slot(s)" if created else "already exists",
        url,
    )
    prefect_serve(*deployments)
