"""Typed configs: YAML, overrides, and errors that name the field."""

import pytest
from pydantic import ValidationError

from a2d.specs import ConfigError, PipelineConfig, RunOptions, load_config
from tests.conftest import ROOT


def test_shipped_configs_load():
    tiny = load_config(f"{ROOT}/configs/tiny.yaml")
    assert tiny.teacher.architecture == "qwen3_5" and tiny.teacher.layers == 64
    demo = load_config(f"{ROOT}/configs/demo.yaml")
    assert demo.teacher.source == "smollm2"


def test_overrides_apply_typed_values():
    cfg = load_config(
        f"{ROOT}/configs/tiny.yaml", ["run.batch_size=3", "prompts.eval_fraction=0.5", "store=/x"]
    )
    assert cfg.run.batch_size == 3 and cfg.prompts.eval_fraction == 0.5 and cfg.store == "/x"


def test_typo_key_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("teacher:\n  layerz: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'teacher.layerz'"):
        load_config(bad)
    with pytest.raises(ConfigError, match="unknown key 'run.batchsize'"):
        load_config(None, ["run.batchsize=2"])


def test_out_of_range_is_named():
    with pytest.raises(ConfigError, match="run.batch_size"):
        load_config(None, ["run.batch_size=-1"])
    with pytest.raises(ConfigError, match="teacher.hidden"):
        load_config(None, ["teacher.hidden=70"])
    with pytest.raises(ConfigError, match="needs teacher.path"):
        load_config(None, ["teacher.source=local"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["run.batch_size"])


def test_run_options_are_frozen_and_json_schema_has_descriptions():
    with pytest.raises(ValidationError):
        RunOptions().batch_size = 2  # type: ignore[misc]
    schema = PipelineConfig.model_json_schema()
    run = schema["$defs"]["RunOptions"]["properties"]["batch_size"]
    assert run["minimum"] == 1 and "description" in run


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("teacher:\n  layers: 2\nprompts:\n  files: [a.jsonl, b.jsonl\nrun:\n  workers: 1\n")
    with pytest.raises(
        ConfigError, match=r"config file .*broken\.yaml is not valid YAML at line \d+, column \d+"
    ):
        load_config(bad)
