"""The installed package: one `a2d` namespace in site-packages, no generic top-level names."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT

FOLDERS = ("specs", "models", "stores", "tasks", "flows", "deployments")


def test_the_wheel_installs_only_the_a2d_namespace(tmp_path):
    # Built from a copy: an in-tree build would leave build/ behind in the checkout.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "a2d-store", "build", "*.egg-info", "__pycache__", "tests")
    shutil.copytree(ROOT, src, ignore=skip)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("a2d_pipeline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["a2d"]
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # Besides the package: only the .pth hook that registers the lm-eval model (README, "lm-eval").
    assert tops == {"a2d", "a2d-lm-eval.pth"}
    for folder in FOLDERS:
        assert f"a2d/{folder}/__init__.py" in names, folder
    # Subpackages too: setuptools installs only the packages it is told, and an editable install
    # hides one left out (its finder maps whole folders).
    for init in Path(ROOT).glob("*/**/__init__.py"):
        rel = init.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in FOLDERS:
            assert f"a2d/{rel}" in names, f"{rel} is not in the wheel: add its package to pyproject.toml"
    assert "a2d/deployments/prefect.yaml" in names and "a2d/flows/cli.py" in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "a2d = a2d.flows.cli:main" in entry


def test_outside_the_checkout_only_a2d_imports(tmp_path):
    """From another directory, `import tasks` finds nothing (another project's `tasks/` is safe)."""
    code = (
        "import importlib.util as u, sys\n"
        f"print([m for m in {FOLDERS!r} if u.find_spec(m) is not None])\n"
        "import a2d.flows.cli, a2d.tasks.head\n"
        "print(a2d.flows.cli.main.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[:2] == ["[]", "a2d.flows.cli"]
