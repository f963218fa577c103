"""Deployments: the served registry, prefect.yaml, the k8s job template, parameter-schema snapshots,
the `gpu` slot, and `a2d serve` end to end against a real Prefect server in a subprocess."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import yaml
from prefect import Flow, Task, flow, task
from prefect.client.orchestration import get_client
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, validate
from prefect.utilities.templating import apply_values

from a2d.deployments.serve import (
    GPU_FLOWS,
    NO_SERVER,
    Served,
    build_deployments,
    form_schema,
    planned_refs,
    registry,
)
from a2d.flows.cli import main
from a2d.flows.pipeline import STEPS, pipeline
from a2d.specs import TeacherSpec
from a2d.tasks.concurrency import ensure_limit, gpu_slot, limit_exists
from tests.conftest import ROOT, finished_markers, log_lines, tiny_config

DEPLOYMENTS = Path(ROOT, "deployments")
SNAPSHOTS = Path(ROOT, "tests", "snapshots")
POOLS = ("a2d-process", "a2d-k8s")


def _served(name: str) -> Served:
    return next(s for s in registry() if s.name == name)


# -- the registry ------------------------------------------------------------------------------------
def test_registry_serves_every_flow_in_the_package():
    """Checked against the DAG written out here and against every flow defined under a2d.flows
    (found by importing each module), not against the lists the registry is built from."""
    import pkgutil

    import a2d.flows

    names = [s.name for s in registry()]
    assert names == [
        "teacher", "prompts", "responses", "anchors", "drafter", "trajectories", "head", "vfm", "eval",
        "pipeline", "regenerate-data",
    ]  # fmt: skip
    defined = set()
    for info in pkgutil.iter_modules(a2d.flows.__path__):
        module = importlib.import_module(f"a2d.flows.{info.name}")
        defined |= {
            (obj.fn.__module__, obj.fn.__name__) for obj in vars(module).values() if isinstance(obj, Flow)
        }
    assert {(s.module, s.attr) for s in registry()} == defined
    for served in registry():
        assert isinstance(served.load(), Flow) and served.load().name == served.name


def _stage_tasks(served: Served) -> list[Task]:
    """The Prefect tasks a stage flow's module uses: its own and those of the task modules it imports."""
    module = importlib.import_module(served.module)
    spaces = [vars(module)] + [vars(m) for m in vars(module).values() if inspect.ismodule(m)]
    return [obj for space in spaces for obj in space.values() if isinstance(obj, Task)]


def test_gpu_flows_follow_the_gpu_task_tags():
    """A stage is a GPU flow exactly when one of its tasks is tagged `gpu` (a new stage must say so)."""
    for served in registry()[: len(STEPS)]:
        tasks = _stage_tasks(served)
        assert tasks, f"stage {served.name}: no tasks found in {served.module}"
        tagged = any("gpu" in t.tags for t in tasks)
        assert tagged == served.gpu, (
            f"stage {served.name}: gpu-tagged task {tagged}, in GPU_FLOWS {served.gpu}"
        )
    assert {"pipeline", "regenerate-data"} <= GPU_FLOWS


def test_deployment_defaults_are_the_config(tmp_path):
    config = tiny_config(str(tmp_path / "s"), "name=unit")
    deployments = {
        d.flow_name: d for d in build_deployments(config, cron="0 3 * * *", timezone="Europe/Paris")
    }
    assert set(deployments) == {s.name for s in registry()}
    refs = planned_refs(config)
    for d in deployments.values():
        assert d.name == f"unit · {d.flow_name}" and d.enforce_parameter_schema
        assert d.tags == ["a2d", "cpu"]  # no GPU here (run.device auto): no stage is a GPU job
        schema = d._parameter_openapi_schema.model_dump(exclude_unset=True)  # what the server enforces
        validate(d.parameters, schema, raise_on_error=True)
        assert not any(p["title"] in ("spec", "opts", "teacher_spec") for p in schema["properties"].values())
    assert deployments["pipeline"].parameters["config"] == config.model_dump(mode="json")
    # a stage's inputs are artifact keys: one text field each, filled with the config's planned key
    assert deployments["prompts"].parameters["teacher"] == refs["teacher"].key
    teacher_field = deployments["head"]._parameter_openapi_schema.properties["teacher"]
    assert teacher_field["type"] == "string" and "a2d ls --stage teacher" in teacher_field["description"]
    assert teacher_field["title"] == "Teacher artifact key"
    assert deployments["prompts"].parameters["spec"] == config.prompts.model_dump(mode="json")
    assert deployments["anchors"].parameters["opts"] == config.run.model_dump(mode="json")
    (schedule,) = [s.schedule for s in deployments["regenerate-data"].schedules]
    assert (schedule.cron, schedule.timezone) == ("0 3 * * *", "Europe/Paris")
    on_gpu = tiny_config(str(tmp_path / "s"), "name=unit", "run.device=cuda")
    tags = {d.flow_name: d.tags for d in build_deployments(on_gpu)}
    assert tags["head"] == ["a2d", "gpu"] and tags["prompts"] == ["a2d", "cpu"]
    assert not deployments["pipeline"].schedules
    # A relative local store is pinned to where `a2d serve` was started.
    rel = {d.flow_name: d for d in build_deployments(tiny_config("rel-store"))}["pipeline"]
    assert rel.parameters["config"]["store"] == str(Path.cwd() / "rel-store")


def test_a_stage_flow_started_with_a_key_reads_that_artifact_and_an_unknown_key_fails_in_one_line(tmp_path):
    from a2d.flows.prompts import prompts_flow

    config = tiny_config(str(tmp_path / "s"), "teacher.architecture=llama", "teacher.layers=2")
    refs = pipeline(config, until="prompts")
    args = dict(spec=config.prompts, teacher_spec=config.teacher, store=config.store, opts=config.run)
    assert prompts_flow(teacher=refs["teacher"].key, **args) == refs["prompts"]  # the same artifact
    state = prompts_flow(teacher="0123456789abcdef", **args, return_state=True)
    assert state.is_failed() and "\n" not in state.message
    assert "no complete teacher artifact 0123456789abcdef" in state.message and "a2d ls" in state.message
    state = prompts_flow(teacher="teacher/zz", **args, return_state=True)
    assert state.is_failed() and "is not an artifact key" in state.message


def test_serve_without_api_url_says_how_to_start_a_server(capsys):
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["serve", "--config", os.path.join(ROOT, "configs", "tiny.yaml")]) == 2
    err = capsys.readouterr().err
    assert "prefect server start --host 127.0.0.1" in err
    assert "export PREFECT_API_URL=http://127.0.0.1:4200/api" in err
    assert NO_SERVER.splitlines()[0] in err


# -- prefect.yaml and the Kubernetes job template --------------------------------------------------
def _prefect_yaml() -> list[dict]:
    from prefect.cli.deploy._models import PrefectYamlModel  # what `prefect deploy` validates with

    raw = yaml.safe_load((DEPLOYMENTS / "prefect.yaml").read_text())
    PrefectYamlModel.model_validate(raw)
    return raw["deployments"]


def test_prefect_yaml_declares_every_served_flow_on_both_pools():
    entries = _prefect_yaml()
    found = {}
    for d in entries:
        module, attr = d["entrypoint"].rsplit(".", 1)
        obj = getattr(importlib.import_module(module), attr)
        assert isinstance(obj, Flow), d["entrypoint"]
        assert d["work_pool"]["name"] in POOLS and d["enforce_parameter_schema"] is True
        found[(obj.name, d["work_pool"]["name"])] = d
    served = {s.name: s for s in registry()}
    assert set(found) == {(name, pool) for name in served for pool in POOLS}
    assert len(entries) == len(found), "a flow is declared twice for one pool"
    for (name, pool), d in found.items():
        assert d["entrypoint"] == served[name].entrypoint
        assert ("gpu" in d["tags"]) == served[name].gpu
        job = d["work_pool"].get("job_variables", {})
        if pool == "a2d-k8s":
            assert job.get("gpu_limit") == (1 if served[name].gpu else None), name
            assert bool(job.get("tolerations")) == served[name].gpu, name


def test_k8s_job_template_is_accepted_and_asks_for_one_gpu():
    template = json.loads((DEPLOYMENTS / "k8s-job-template.json").read_text())
    WorkPoolCreate(name="a2d-k8s", type="kubernetes", base_job_template=template)  # the server's check
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    k8s = {(d["entrypoint"], d["work_pool"]["name"]): d for d in _prefect_yaml()}
    for entrypoint, gpus in (("a2d.flows.anchors.anchors_flow", 1), ("a2d.flows.prompts.prompts_flow", None)):
        job_variables = k8s[(entrypoint, "a2d-k8s")]["work_pool"]["job_variables"]
        rendered = apply_values(template["job_configuration"], {**defaults, **job_variables})
        pod = rendered["job_manifest"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "a2d:latest"
        assert pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") == gpus
        assert ("tolerations" in pod) == (gpus == 1)


# -- parameter forms -------------------------------------------------------------------------------------
@pytest.mark.parametrize("served", registry(), ids=lambda s: s.name)
def test_parameter_schema_snapshot(served):
    """The UI form of every deployment; regenerate with A2D_UPDATE_SNAPSHOTS=1 after a deliberate change."""
    schema = form_schema(served.load(), served.name).model_dump(exclude_unset=True)
    text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    path = SNAPSHOTS / f"params-{served.name}.json"
    if os.environ.get("A2D_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no snapshot {path.name}: run with A2D_UPDATE_SNAPSHOTS=1"
    assert json.loads(path.read_text()) == schema, f"{served.name} parameters changed: review, then update"
    # no field keeps a title made from its name ("Lr schedule", "Lora Rank"): each reads as a person
    # writes it, abbreviations spelled out or in their own case
    raw = {"lr", "lora", "vfm", "lm", "id", "wandb", "num", "grad", "accum", "len", "seq", "repo", "r"}
    proper = {"LoRA", "VFM", "LM", "ID"}
    auto = [
        f"{where}.{name}: {prop.get('title')!r}"
        for where, definition in [("(top)", schema), *schema["definitions"].items()]
        for name, prop in definition["properties"].items()
        if not prop.get("title")
        or prop["title"] == name.replace("_", " ").title() != name.replace("_", " ").capitalize()
        or any(w.lower() in raw and w not in proper for w in prop["title"].split())
    ]
    assert not auto, auto
    run_options = schema["definitions"].get("RunOptions")
    if run_options is not None:
        assert run_options["properties"]["batch_size"]["minimum"] == 1
        assert run_options["properties"]["workers"]["minimum"] == 1


def test_schema_rejects_a_bad_value_naming_the_field():
    schema = parameter_schema(_served("pipeline").load()).model_dump(exclude_unset=True)
    validate({"config": {"run": {"batch_size": 4}}, "until": "prompts"}, schema, raise_on_error=True)
    with pytest.raises(ValidationError, match="batch_size"):
        validate({"config": {"run": {"batch_size": -1}}}, schema, raise_on_error=True)
    with pytest.raises(ValidationError):
        validate({"until": "nowhere"}, schema, raise_on_error=True)
    # checks the config makes are in the schema, so the form and the server refuse them
    validate({"config": {"teacher": {"hidden": 32}}}, schema, raise_on_error=True)
    with pytest.raises(ValidationError, match="multiple of 16"):
        validate({"config": {"teacher": {"hidden": 20}}}, schema, raise_on_error=True)
    with pytest.raises(ValidationError, match="does not match"):
        validate({"config": {"eval": {"lm_eval_decoder": "spec:nothing"}}}, schema, raise_on_error=True)


# -- regenerate-data -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_regenerate_data_reports_rebuilt_then_reused(tmp_path):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from a2d.flows.regenerate import ARTIFACT_KEY, DATA_STAGES, regenerate_data

    config = tiny_config(
        str(tmp_path / "s"), "teacher.layers=4", "prompts.bundled_rows=4", "responses.max_new_tokens=8"
    )
    first = regenerate_data(config)
    assert list(first) == ["teacher", *DATA_STAGES]
    assert {k: r.key for k, r in first.items()} == {k: planned_refs(config)[k].key for k in first}
    again = regenerate_data(
        config.model_copy(update={"run": config.run.model_copy(update={"batch_size": 3})})
    )
    assert again == first
    with get_client(sync_client=True) as client:
        reports = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])),
            sort=ArtifactSort.CREATED_DESC,
        )
    newest, oldest = reports[0].data, reports[1].data
    stages = ", ".join(first)
    assert "- reused: none" in oldest and f"- rebuilt: {stages}" in oldest
    assert f"- reused: {stages}" in newest and "- rebuilt: none" in newest
    assert f"| anchors | `{first['anchors'].key}` | reused |" in newest


# -- the gpu slot ------------------------------------------------------------------------------------------
def test_gpu_slot_is_held_while_the_block_runs():
    name = "gpu-slot-test"
    with gpu_slot(name=name):  # outside a run: no API call, no limit needed
        pass
    assert not limit_exists(name)

    @task
    def active_inside() -> int | None:
        with gpu_slot(name=name):
            if not limit_exists(name):
                return None
            with get_client(sync_client=True) as client:
                return client.read_global_concurrency_limit_by_name(name).active_slots

    @flow
    def probe() -> int | None:
        return active_inside()

    assert probe() is None  # no limit on this server: the slot is a no-op
    assert ensure_limit(name, slots=1) and not ensure_limit(name, slots=3)
    try:
        assert probe() == 1
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
        assert limit.limit == 1 and limit.active_slots == 0
        # A run that finds every slot held says so in its log before it waits.
        import io
        import logging
        import threading

        from prefect.concurrency.sync import concurrency

        buf, got = io.StringIO(), []
        handler = logging.StreamHandler(buf)
        task_logs = logging.getLogger("prefect.task_runs")
        level = task_logs.level
        task_logs.addHandler(handler)
        task_logs.setLevel(logging.INFO)  # the test harness runs Prefect at WARNING
        try:
            with concurrency(name, occupy=1, strict=True):
                waiting = threading.Thread(target=lambda: got.append(probe()))
                waiting.start()
                deadline = time.monotonic() + 60
                while "waiting for a free" not in buf.getvalue():
                    assert time.monotonic() < deadline and waiting.is_alive(), buf.getvalue()
                    time.sleep(0.2)
                assert not got  # still waiting while the slot is held
            waiting.join(60)
        finally:
            task_logs.removeHandler(handler)
            task_logs.setLevel(level)
        assert got == [1] and "1 of 1 held by other runs" in buf.getvalue()
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)


# -- end to end: a real server, `a2d serve`, runs through the API -------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(home: Path, **settings: str) -> dict[str, str]:
    """This environment without the session harness's PREFECT_* settings, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **settings}
    return env


@contextmanager
def _process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """A child in its own process group, stopped (the whole group, by its id) on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_until(
    ready: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen, log: Path
) -> None:
    """Poll `ready` (a child starting up has no event to wait on) until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            pytest.fail(f"{what} not ready after {timeout:.0f} s (exit {proc.poll()}):\n{tail}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[str]:
    """`prefect server start` on a free port with its own home and SQLite file; yields the API URL."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    db = f"sqlite+aiosqlite:///{home / 'prefect.db'}"
    env = _child_env(home, PREFECT_API_DATABASE_CONNECTION_URL=db)
    cmd = [
        str(Path(sys.executable).parent / "prefect"),
        *f"server start --host 127.0.0.1 --port {port}".split(),
    ]
    log = home / "server.log"
    with _process(cmd, env, log) as proc:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait_until(healthy, 120, "prefect server", proc, log)
        yield url


def _shards(folder: Path) -> dict[str, tuple[int, str]]:
    return {
        p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.glob("part-*.parquet"))
    }


def _tables(client, key: str, whole: bool = False) -> list:
    """The first row (or, `whole`, every row) of every table artifact with `key`, oldest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
    )
    assert all(a.type == "table" for a in found)
    tables = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in reversed(found)]
    return tables if whole else [t[0] for t in tables]


@pytest.mark.slow
def test_served_pipeline_runs_resumes_and_rejects_bad_parameters(prefect_server, tmp_path):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    store = tmp_path / "store"
    config = tiny_config(
        str(store), "name=e2e", "teacher.layers=8", "prompts.bundled_rows=8", "prompts.rows_per_shard=3"
    )
    config_file = tmp_path / "e2e.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    params = {"config": config.model_dump(mode="json"), "until": "drafter"}
    refs = planned_refs(config)
    prompts_key = refs["prompts"].key
    env = _child_env(
        tmp_path / "serve-home",
        PREFECT_API_URL=prefect_server,
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        A2D_GPU_LEASE_S="60",  # the killed run's gpu slot comes back within a minute of the kill
    )
    log = tmp_path / "serve.log"

    with (
        _process(
            [sys.executable, "-m", "a2d.flows.cli", "serve", "--config", str(config_file)], env, log
        ) as serve,
        temporary_settings(updates={PREFECT_API_URL: prefect_server}),
        get_client(sync_client=True) as client,
    ):

        def registered() -> bool:
            try:
                return client.read_deployment_by_name("pipeline/e2e · pipeline") is not None
            except ObjectNotFound:
                return False

        _wait_until(registered, 180, "a2d serve", serve, log)
        assert client.read_global_concurrency_limit_by_name("gpu").limit == 1
        # crash detection: the server marks a run Crashed when its heartbeats stop without a final state
        from prefect.automations import Automation

        from a2d.deployments.serve import CRASH_AUTOMATION, CRASHED_AFTER_S

        crash = Automation.read(name=CRASH_AUTOMATION)
        assert crash.enabled and crash.trigger.posture == "Proactive"
        assert (
            crash.trigger.after == {"prefect.flow-run.heartbeat"}
            and "prefect.flow-run.Completed" in crash.trigger.expect
        )
        assert crash.trigger.within.total_seconds() == CRASHED_AFTER_S
        assert crash.actions[0].state == "CRASHED"

        def run() -> None:
            flow_run = run_deployment(
                "pipeline/e2e · pipeline", parameters=params, timeout=300, poll_interval=1
            )
            assert flow_run.state.is_completed(), (
                f"{flow_run.state}\n{log.read_text(errors='replace')[-3000:]}"
            )

        # First run builds every stage up to the drafter (whose training process the run's own process
        # launches); each stage table reaches the server under its key.
        run()
        (prompts,) = _tables(client, "a2d-prompts")
        assert prompts["key"] == prompts_key and prompts["rows"] == 8 and prompts["shards"] == 3
        for stage in ("teacher", "responses", "anchors", "drafter"):
            (table,) = _tables(client, f"a2d-{stage}")
            assert table["key"] == refs[stage].key and not table["reused"]
        # The pipeline run's own page: one row per stage, what it did, where its artifact lives.
        (summary,) = _tables(client, "a2d-pipeline", whole=True)
        assert [(r["stage"], r["key"], r["outcome"]) for r in summary] == [
            (stage, refs[stage].key, "built")
            for stage in ("teacher", "prompts", "responses", "anchors", "drafter")
        ]
        assert all(r["uri"] == refs[r["stage"]].uri and r["size_mb"] > 0 for r in summary)
        (drafter_page,) = [a for a in client.read_artifacts() if a.key == "a2d-drafter" and a.type == "table"]
        assert re.search(r"\d+ rows, \d+ tokens, [\d,]+ bytes", drafter_page.description), (
            drafter_page.description
        )  # a stage's page says what its artifact holds without a click into the table
        ui = prefect_server.removesuffix("/api")
        assert [r["artifact"] for r in summary] == [f"{ui}/artifacts/key/a2d-{r['stage']}" for r in summary]
        assert list(summary[0])[:2] == ["artifact", "stage"] and list(summary[0])[-1] == "uri"  # links first

        # Lose one shard's marker and the manifest: a new run through the API rebuilds only that shard.
        folder = store / "prompts" / prompts_key
        before = _shards(folder)
        (folder / "_markers" / "part-00001.json").unlink()
        (folder / "manifest.json").unlink()
        run()
        after = _shards(folder)
        assert after.keys() == before.keys() == {f"part-0000{i}.parquet" for i in range(3)}
        assert after["part-00001.parquet"][0] != before["part-00001.parquet"][0]
        for name in ("part-00000.parquet", "part-00002.parquet"):
            assert after[name] == before[name], f"{name} was rewritten"
        assert (folder / "manifest.json").is_file() and (folder / "_markers" / "part-00001.json").is_file()
        assert [r["reused"] for r in _tables(client, "a2d-prompts")] == [False, False]
        assert [r["resumed_shards"] for r in _tables(client, "a2d-prompts")] == [0, 2]
        summary = _tables(client, "a2d-pipeline", whole=True)[-1]
        assert [r["outcome"] for r in summary] == [
            "reused",
            "resumed (2 of 3 shards already finished)",
            "reused",
            "reused",
            "reused",
        ]
        for stage in ("teacher", "responses", "anchors", "drafter"):  # keyed on inputs, not on prompts' files
            assert [r["reused"] for r in _tables(client, f"a2d-{stage}")] == [False, True], stage
        assert client.read_global_concurrency_limit_by_name("gpu").active_slots == 0

        # A bad value is refused by the server before any run exists.
        deployment = client.read_deployment_by_name("pipeline/e2e · pipeline")
        only_this = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        runs_before = len(client.read_flow_runs(deployment_filter=only_this))
        bad = {**params, "config": {**params["config"], "run": {**params["config"]["run"], "batch_size": -1}}}
        with pytest.raises(PrefectHTTPStatusError, match="batch_size"):
            client.create_flow_run_from_deployment(deployment.id, parameters=bad)
        odd = {
            **params,
            "config": {**params["config"], "teacher": {**params["config"]["teacher"], "hidden": 20}},
        }
        with pytest.raises(
            PrefectHTTPStatusError, match="multiple of 16"
        ):  # a pydantic check, in the schema too
            client.create_flow_run_from_deployment(deployment.id, parameters=odd)
        assert len(client.read_flow_runs(deployment_filter=only_this)) == runs_before == 2

        # A refusal (here a key naming no artifact) ends its run Failed with one line, and the run's
        # log on the server holds that line and no traceback. (A store root outside the serve policy is
        # refused the same way: test_a_served_run_outside_the_policy_fails_before_any_work.)
        says = "no complete teacher artifact 0123456789abcdef"
        refused = run_deployment(
            "prompts/e2e · prompts", parameters={"teacher": "0123456789abcdef"}, timeout=300, poll_interval=1
        )
        assert refused.state.is_failed() and says in refused.state.message, refused.state
        lines = log_lines(client, refused.id, until="Finished in state")
        assert any(says in line for line in lines) and not any("Traceback" in line for line in lines), lines

        # A run whose process is SIGKILLed mid-stage (responses, one shard per prompts shard) is marked
        # Crashed; Retry (what the UI's button sends) resumes it from the shards that were finished.
        crash = {
            **params,
            "config": {
                **params["config"],
                "responses": {**params["config"]["responses"], "max_new_tokens": 48},
            },
            "until": "responses",
        }
        crash_refs = planned_refs(type(config).model_validate(crash["config"]))
        markers = store / "responses" / crash_refs["responses"].key / "_markers"
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=crash)
        deadline = time.monotonic() + 180
        while not finished_markers(markers):  # a marker's atomic-write temp file is not a finished shard
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.05)
        running = _run_processes(serve.pid, flow_run.id)  # the run's process and any it started
        # The run's process carries the serve policy (what it refuses before any work, e.g. another
        # store root: test_a_served_run_outside_the_policy_fails_before_any_work).
        from a2d.flows.policy import POLICY_ENV, policy_for
        from a2d.specs import ServePolicy

        environ = _environ(running[0])
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        assert ServePolicy.model_validate_json(environ[POLICY_ENV.encode()]) == policy_for(config)
        done_before = len(finished_markers(markers))
        _wait_for_state(client, flow_run.id, "CRASHED", 60)
        # Its log says what ended it, and the stage subflow that was running in the killed process
        # is Crashed too (the runner runs every a2d flow's crashed hook, a2d.flows.run_logs.on_crashed).
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        below = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))

        def children_final() -> bool:
            return all(c.state.is_final() for c in client.read_flow_runs(flow_run_filter=below))

        deadline = time.monotonic() + 60
        while not children_final():
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        states = {
            client.read_flow(c.flow_id).name: c.state.type.value
            for c in client.read_flow_runs(flow_run_filter=below)
        }
        assert states.get("responses") == "CRASHED" and states.get("prompts") == "COMPLETED", states
        crashed = "run crashed: Process exited with status code: -9"
        assert any(crashed in line for line in log_lines(client, flow_run.id, until=crashed))
        shards = len(finished_markers(store / "prompts" / crash_refs["prompts"].key / "_markers"))
        assert done_before < shards, "the stage finished before the kill: nothing to resume"

        from prefect.states import AwaitingRetry

        client.set_flow_run_state(flow_run.id, AwaitingRetry(message="Retry from the UI"), force=True)
        _wait_for_state(client, flow_run.id, "COMPLETED", 300)
        summary = _tables(client, "a2d-pipeline", whole=True)[-1]
        resumed = {r["stage"]: r["outcome"] for r in summary}["responses"]
        finished = re.fullmatch(r"resumed \((\d+) of (\d+) shards already finished\)", resumed)
        assert finished and int(finished[1]) >= done_before and int(finished[2]) == shards, resumed
        kept = finished_markers(markers)
        assert len(kept) == shards and sorted(markers.iterdir()) == kept
        assert _tables(client, "a2d-responses")[-1]["resumed_shards"] == int(finished[1])

        # A stage deployment takes its inputs as keys (the form's text fields): the responses stage
        # started with the prompts key the first run built finds that artifact and reuses its own.
        stage_run = run_deployment(
            "responses/e2e · responses", parameters={"prompts": prompts_key}, timeout=300, poll_interval=1
        )
        assert stage_run.state.is_completed(), stage_run.state
        assert _tables(client, "a2d-responses")[-1] == {
            **_tables(client, "a2d-responses")[0],
            "reused": True,
            "seconds": _tables(client, "a2d-responses")[-1]["seconds"],
        }


def _environ(pid: int) -> dict[bytes, bytes]:
    """The environment process `pid` started with."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.split(b"=", 1) for p in pairs if b"=" in p)


def _run_processes(root: int, flow_run_id) -> list[int]:
    """The processes under `root` that run `flow_run_id`: the one the runner started for it (it
    carries the run's id in its environment) and every process below that one."""
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        with suppress(OSError):
            if _environ(pid).get(b"PREFECT__FLOW_RUN_ID") == str(flow_run_id).encode():
                found.append(pid)
            for task_dir in Path(f"/proc/{pid}/task").iterdir():
                pending += [int(c) for c in (task_dir / "children").read_text().split()]
    assert found, f"no process runs flow run {flow_run_id}"
    return found


def _wait_for_state(client, flow_run_id, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (current := client.read_flow_run(flow_run_id).state).type.value != state:
        assert time.monotonic() < deadline, f"flow run still {current} after {timeout:.0f} s"
        time.sleep(0.5)


# -- the serve policy: what runs from served deployments may do ------------------------------------------
def test_the_serve_policy_allows_the_served_config_and_refuses_the_rest(tmp_path):
    from a2d.flows.policy import policy_for, violations, with_flags
    from a2d.specs import PromptSpec, RunOptions
    from a2d.stores.artifacts import ArtifactRef

    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.jsonl").write_text("{}\n")
    secret = tmp_path / "secret.jsonl"
    secret.write_text("{}\n")
    (data / "link.jsonl").symlink_to(secret)  # inside the folder by name, outside by content
    served = tiny_config(
        str(tmp_path / "store"), "prompts.source=files", f"prompts.files=[{data / 'ok.jsonl'}]"
    )
    policy = policy_for(served, with_flags(None, data_paths=[str(data)]))
    assert violations(policy, served.store, served.teacher, served.prompts, served.run) == []
    assert violations(policy, store=str(tmp_path / "store" / "sub")) == []  # inside the root

    def one(**parts) -> str:
        (problem,) = violations(policy, **parts)
        return problem

    assert "--allow-store" in one(store=str(tmp_path / "elsewhere"))
    assert "--allow-store" in one(store="s3://someone-elses-bucket/x")
    assert "--allow-remote-code" in one(teacher=served.teacher.model_copy(update={"trust_remote_code": True}))
    assert "teacher.path" in one(teacher=TeacherSpec(source="local", path=str(tmp_path)))
    for f in (secret, data / "link.jsonl", data / ".." / "secret.jsonl"):
        assert "--allow-data" in one(prompts=PromptSpec(source="files", files=(str(f),)))
    assert "--allow-dask" in one(run=RunOptions(runner="dask", dask_address="tcp://10.0.0.9:8786"))
    assert violations(policy, run=RunOptions(runner="dask")) == []  # a local cluster
    big = TeacherSpec(architecture="qwen3_5", layers=256, hidden=16384)
    assert "745,233,863,680 parameters, above the limit of 1,000,000,000" in one(teacher=big)
    assert "names no artifact" in one(refs=(ArtifactRef(stage="teacher", key="../../etc", uri="x"),))

    wider = policy_for(
        served,
        with_flags(
            None,
            store_roots=["s3://team/a2d"],
            dask_addresses=["tcp://10.0.0.9:8786"],
            allow_remote_code=True,
            max_random_teacher_params=10**12,
        ),
    )
    assert (
        violations(
            wider, store="s3://team/a2d/run-2", teacher=big.model_copy(update={"trust_remote_code": True})
        )
        == []
    )
    assert violations(wider, run=RunOptions(runner="dask", dask_address="tcp://10.0.0.9:8786")) == []


def test_a_served_run_outside_the_policy_fails_before_any_work(tmp_path, monkeypatch):
    from a2d.flows.pipeline import pipeline
    from a2d.flows.policy import POLICY_ENV, PolicyError, enforce, policy_for
    from a2d.flows.prompts import prompts_flow
    from a2d.specs import PromptSpec
    from a2d.stores.artifacts import ArtifactRef

    served = tiny_config(str(tmp_path / "store"))
    monkeypatch.setenv(POLICY_ENV, policy_for(served).model_dump_json())  # as `a2d serve` exports it
    foreign = tmp_path / "foreign"
    state = pipeline(served.model_copy(update={"store": str(foreign)}), until="prompts", return_state=True)
    # Failed with one line naming the rule (no traceback, no escaped newlines), before any work
    assert state.is_failed() and "not an allowed store root" in state.message and "\n" not in state.message
    assert not foreign.exists()
    teacher = ArtifactRef(stage="teacher", key="0" * 16, uri="file:///x")
    state = prompts_flow(
        teacher,
        PromptSpec(source="files", files=(str(tmp_path / "secret.jsonl"),)),
        store=served.store,
        return_state=True,
    )
    assert state.is_failed() and re.search("prompts.files entry .*secret.jsonl", state.message)
    assert not (tmp_path / "store").exists()
    with pytest.raises(PolicyError, match="refused by the serve policy"):  # the raising form, one line
        enforce(store=str(foreign))


def test_a_policy_file_and_flags_combine_and_a_typo_is_named(tmp_path):
    from a2d.deployments.serve import load_policy
    from a2d.flows.policy import with_flags
    from a2d.specs import ConfigError

    f = tmp_path / "policy.yaml"
    f.write_text("store_roots: [s3://team/a2d]\nallow_remote_code: true\n")
    policy = with_flags(load_policy(str(f)), data_paths=["/data"], max_random_teacher_params=5)
    assert policy.store_roots == ("s3://team/a2d",) and policy.allow_remote_code
    assert policy.data_paths == ("/data",) and policy.max_random_teacher_params == 5
    f.write_text("store_root: [s3://team/a2d]\n")
    with pytest.raises(ConfigError, match="store_root"):
        load_policy(str(f))


def test_crash_detection_is_one_automation_per_server():
    """`a2d serve` registers the automation that marks a run Crashed when its heartbeats stop."""
    from prefect.automations import Automation

    from a2d.deployments.serve import CRASH_AUTOMATION, ensure_crash_detection

    assert ensure_crash_detection(silence_s=90) is True
    assert ensure_crash_detection(silence_s=90) is False  # a second serve finds it
    made = Automation.read(name=CRASH_AUTOMATION)
    assert made.trigger.posture == "Proactive" and made.trigger.within.total_seconds() == 90
    assert made.trigger.for_each == {"prefect.resource.id"} and made.actions[0].state == "CRASHED"
    made.delete()


def test_a_refusal_logs_one_line_and_a_real_error_keeps_its_traceback():
    """A returned Failed state re-raised by Prefect (a refused stage under its pipeline, a refused run
    in a served run's engine) is logged without Prefect's frames; an exception keeps its traceback."""
    import io
    import logging

    from prefect.exceptions import FailedRun
    from prefect.flow_engine import run_flow
    from prefect.states import Failed

    import a2d.flows  # noqa: F401  (installs the filter, as any a2d flow module does)

    @flow
    def refused_stage():
        return Failed(message="no complete teacher artifact 0123456789abcdef in file:///s")

    @flow
    def parent():
        refused_stage()

    @flow
    def refused_run():
        return Failed(message="refused by the serve policy before any work: store /x")

    @flow
    def broken():
        raise RuntimeError("a real bug")

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    run_logs = logging.getLogger("prefect.flow_runs")
    run_logs.addHandler(handler)
    try:
        logs = {}
        for f in (parent, refused_run, broken):
            start = buf.tell()
            with pytest.raises((FailedRun, RuntimeError)):
                run_flow(f, error_logger=run_logs)  # what a served run's process calls
            logs[f.name] = buf.getvalue()[start:]
    finally:
        run_logs.removeHandler(handler)
    assert "failed: no complete teacher artifact 0123456789abcdef" in logs["parent"]
    assert "Traceback" not in logs["parent"] and "Traceback" not in logs["refused-run"]
    assert "Engine execution exited" not in logs["refused-run"]
    assert logs["broken"].count("Traceback") == 2 and "RuntimeError: a real bug" in logs["broken"]
