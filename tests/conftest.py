"""One Prefect harness per session, offline settings, and shared tiny artifacts."""

from __future__ import annotations

import os
import tempfile

_HOME = tempfile.mkdtemp(prefix="a2d-prefect-home-")
os.environ.setdefault("PREFECT_HOME", _HOME)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_HOME, "results")
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["WANDB_MODE"] = "disabled"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ.setdefault("A2D_CACHE", os.path.join(_HOME, "a2d-cache"))

import pytest  # noqa: E402

from a2d.specs import PipelineConfig, load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def tiny_config(store: str, *overrides: str) -> PipelineConfig:
    """configs/tiny.yaml, pointed at `store`, with overrides."""
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"store={store}", *overrides])


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """A store with the tiny pipeline run up to prompts, shared by read-only tests."""
    from a2d.flows.pipeline import pipeline

    store = str(tmp_path_factory.mktemp("tiny-store"))
    pipeline(tiny_config(store), until="prompts")
    return store
