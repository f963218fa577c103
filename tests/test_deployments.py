"""Deployments: the served registry, prefect.yaml, the k8s job template, parameter-schema snapshots,
the `gpu` slot, and `a2d serve` end to end against a real Prefect server in a subprocess."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import yaml
from prefect import Flow, flow, task
from prefect.client.orchestration import get_client
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, validate
from prefect.utilities.templating import apply_values

from deployments.concurrency import ensure_limit, gpu_slot, limit_exists
from deployments.serve import GPU_FLOWS, NO_SERVER, Served, build_deployments, planned_refs, registry
from flows.cli import main
from flows.pipeline import STEPS
from tests.conftest import ROOT, tiny_config

DEPLOYMENTS = Path(ROOT, "deployments")
SNAPSHOTS = Path(ROOT, "tests", "snapshots")
POOLS = {"a2d-process": "process", "a2d-k8s": "kubernetes"}


def _served(name: str) -> Served:
    return next(s for s in registry() if s.name == name)


# -- the registry ------------------------------------------------------------------------------------
def test_registry_serves_every_stage_then_pipeline_and_regenerate():
    names = [s.name for s in registry()]
    assert names == [*STEPS, "pipeline", "regenerate-data"]
    for served in registry():
        assert isinstance(served.load(), Flow)


def test_gpu_flows_follow_the_gpu_task_tags():
    """A stage is a GPU flow exactly when one of its tasks is tagged `gpu` (a new stage must say so)."""
    for stage in STEPS:
        module = importlib.import_module(f"tasks.{stage}")
        tagged = any("gpu" in getattr(obj, "tags", ()) for obj in vars(module).values() if hasattr(obj, "fn"))
        assert tagged == (stage in GPU_FLOWS), f"stage {stage}: gpu tag {tagged}, in GPU_FLOWS {not tagged}"
    assert {"pipeline", "regenerate-data"} <= GPU_FLOWS


def test_deployment_defaults_are_the_config(tmp_path):
    config = tiny_config(str(tmp_path / "s"), "name=unit")
    deployments = {d.flow_name: d for d in build_deployments(config, cron="0 3 * * *")}
    assert set(deployments) == {s.name for s in registry()}
    refs = planned_refs(config)
    for d in deployments.values():
        assert d.name == "unit" and d.enforce_parameter_schema
        schema = parameter_schema(_served(d.flow_name).load())
        validate(d.parameters, schema.model_dump(exclude_unset=True), raise_on_error=True)
    assert deployments["pipeline"].parameters["config"] == config.model_dump(mode="json")
    assert deployments["prompts"].parameters["teacher"] == refs["teacher"].model_dump(mode="json")
    assert deployments["prompts"].parameters["spec"] == config.prompts.model_dump(mode="json")
    assert deployments["anchors"].parameters["opts"] == config.run.model_dump(mode="json")
    assert [s.schedule.cron for s in deployments["regenerate-data"].schedules] == ["0 3 * * *"]
    assert not deployments["pipeline"].schedules
    # A relative local store is pinned to where `a2d serve` was started.
    rel = {d.flow_name: d for d in build_deployments(tiny_config("rel-store"))}["pipeline"]
    assert rel.parameters["config"]["store"] == str(Path.cwd() / "rel-store")


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
        path, attr = d["entrypoint"].split(":")
        assert (Path(ROOT) / path).is_file(), d["entrypoint"]
        obj = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), attr)
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
    for entrypoint, gpus in (("flows/anchors.py:anchors_flow", 1), ("flows/prompts.py:prompts_flow", None)):
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
    schema = parameter_schema(served.load()).model_dump(exclude_unset=True)
    text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    path = SNAPSHOTS / f"params-{served.name}.json"
    if os.environ.get("A2D_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no snapshot {path.name}: run with A2D_UPDATE_SNAPSHOTS=1"
    assert json.loads(path.read_text()) == schema, f"{served.name} parameters changed: review, then update"
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


# -- the gpu slot ------------------------------------------------------------------------------------------
def test_gpu_slot_is_held_while_the_block_runs():
    name = "gpu-slot-test"
    with gpu_slot(name=name):  # outside a run: no API call, no limit needed
        pass
    assert not limit_exists(name)

    @task
    def active_inside() -> int:
        with gpu_slot(name=name), get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name(name).active_slots

    @flow
    def probe() -> int:
        return active_inside()

    assert probe() == 0  # no limit on this server: the slot is a no-op
    assert ensure_limit(name, slots=1) and not ensure_limit(name, slots=3)
    try:
        assert probe() == 1
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
        assert limit.limit == 1 and limit.active_slots == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
