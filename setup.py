"""All metadata lives in pyproject.toml. This only ships `a2d-lm-eval.pth` at the root of
site-packages (pyproject cannot place a file there): it registers the `a2d` model with lm-eval
versions that have no plugin discovery (see tasks/harness_hook.py)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "a2d-lm-eval.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("tasks", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
