"""One Prefect harness per session, offline settings, and shared tiny artifacts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HOME = tempfile.mkdtemp(prefix="a2d-prefect-home-")
os.environ.setdefault("PREFECT_HOME", _HOME)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_HOME, "results")
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["WANDB_MODE"] = "disabled"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ.setdefault("A2D_CACHE", os.path.join(_HOME, "a2d-cache"))
# The packed oneDNN path wherever it applies (not this machine's timed choice, which could leave the
# packed path untested); test_drafter checks the per-row-count choice itself.
os.environ.setdefault("A2D_CPU_LINEAR", "packed")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker or more per core: one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (and for the processes a test starts)
    if "torch" in sys.modules:  # imported before this file (by a plugin): it has read its count already
        # the processes a test starts read the variable; this one must sum in their order too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

from a2d.specs import PipelineConfig, load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Seconds each of the slowest files takes on 2 busy cores (summed `--durations=0`, 2026-12-03). `make
# test` hands whole files to its workers in this order (`--dist loadfile --no-loadscope-reorder`):
# longest first, so the last file a worker starts is a short one and no worker waits long for the
# others at the end (xdist's default order is by test count, whatever a file's duration).
FILE_SECONDS = {
    "test_vfm_eval.py": 330,  # these four: 2026-12-07, after the cuts of that day (alone or paired)
    "test_deployments.py": 320,
    "test_head.py": 300,
    "test_scale.py": 290,
    "test_anchors.py": 140,
    "test_teacher.py": 55,
    "test_cli.py": 50,
    "test_store.py": 45,
    "test_store_faults.py": 40,
    "test_trajectories.py": 35,
    "test_responses.py": 30,
    "test_packaging.py": 30,
    "test_decoding.py": 25,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files longest first (`FILE_SECONDS`; the rest after, as collected); tests keep their order."""
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-FILE_SECONDS.get(item.path.name, 0), order[item]))


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# The tiny config's overrides for a pipeline whose stages are the point, not the architecture: a
# 2-layer llama teacher, 12 rows in 3 shards, 8-token responses, anchors of both layers.
LLAMA_PIPELINE = (
    "teacher.architecture=llama",
    "teacher.layers=2",
    "prompts.bundled_rows=12",
    "prompts.rows_per_shard=4",
    "responses.max_new_tokens=8",
    "anchors.layers=[0, 1]",
)


def tiny_config(store: str, *overrides: str) -> PipelineConfig:
    """configs/tiny.yaml, pointed at `store`, with overrides."""
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"store={store}", *overrides])


def bare_forward_seconds(store: str, teacher) -> float:
    """The median time of one forward of the stored teacher over 64 tokens, on this machine now
    (after warm-up: a cold first forward costs several times a warm one)."""
    import torch

    from a2d.stores.artifacts import ArtifactStore
    from a2d.tasks import teacher as teacher_stage

    model, _ = teacher_stage.tm.load_teacher(
        teacher_stage.local_dir(ArtifactStore(str(store)), teacher), device="cpu"
    )
    ids = torch.arange(2, 66)[None]
    times = []
    with torch.no_grad():
        for _ in range(3):  # warm-up: the first forwards build kernels and caches
            model(ids)
        for _ in range(15):
            t = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def log_lines(client, flow_run_id, until: str = "", timeout: float = 30) -> list[str]:
    """The run's log lines on the server, once one contains `until` (a run's logs reach the server
    in batches, after its state) or `timeout` passes."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    deadline = time.monotonic() + timeout
    while True:
        lines = [entry.message for entry in client.read_logs(log_filter=only)]
        if any(until in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


def finished_markers(markers: Path) -> list[Path]:
    """The finished shards' markers in `markers` (not the temp files of markers being written)."""
    return sorted(p for p in markers.iterdir() if p.suffix == ".json") if markers.is_dir() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """moto's S3-compatible server on 127.0.0.1 (AWS_* set to reach it), stopped by PID at the end."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # a server start: bounded wait for the port to accept connections
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.2)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("a2d-test")
        yield "s3://a2d-test/run"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """A store with the tiny pipeline run up to prompts, shared by read-only tests."""
    from a2d.flows.pipeline import pipeline

    store = str(tmp_path_factory.mktemp("tiny-store"))
    pipeline(tiny_config(store), until="prompts")
    return store


ARCHS = ("llama", "qwen3_5")
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "rslora": False}


@pytest.fixture(scope="session")
def small_teachers(tmp_path_factory):
    """Random teachers of both architectures: a 2-layer llama, and a 4-layer qwen3_5 (3 Gated DeltaNet + 1 full attention)."""
    from a2d.models.teacher import build_random_teacher

    root = tmp_path_factory.mktemp("small-teachers")
    build_random_teacher("qwen3_5", 4, 64, 0, root / "qwen3_5", "float32")
    build_random_teacher("llama", 2, 64, 0, root / "llama", "float32")
    return root


def trained_like(
    teachers, arch, attention="block", scope="masked", linear="bidirectional", block=4, targets=None
):
    """A student whose adapter, mask embedding and scan gates are far from zero (as after training);
    `targets`: the projections its LoRA adapts (default: all)."""
    import torch

    from a2d.models.student_build import build_student

    lora = {**LORA, "targets": targets} if targets else LORA
    student = build_student(teachers / arch, "none", "float32", "cpu", lora, attention, linear, block, scope)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in student.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for gate in student.extras().values():
            if gate.dim() == 0:
                gate.fill_(0.8)
        student.mask.weight.add_(torch.randn(student.mask.weight.shape, generator=gen))
    return student
