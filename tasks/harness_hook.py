"""Registers the `a2d` lm-eval model when lm-eval loads its models, for lm-eval versions without
plugin discovery (0.4.13). Imported at interpreter start by the `a2d-lm-eval.pth` file the package
installs; it imports nothing heavy and does nothing until `lm_eval.models` is imported.

lm-eval versions with entry-point discovery find the model through this package's
`lm_eval.models` entry point instead, and this hook then sees "a2d" registered and stays out.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "lm_eval.models"
MODEL = "a2d.tasks.harness:A2DLM"


class _RegisterA2D(importlib.abc.MetaPathFinder):
    """A one-shot finder: when `lm_eval.models` is imported, register `a2d` right after it runs."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_and_register(module) -> None:
            run(module)
            from lm_eval.api.registry import model_registry

            if model_registry.get("a2d", None) is None:
                model_registry.register("a2d", target=MODEL)

        spec.loader.exec_module = exec_and_register
        return spec


def install() -> None:
    if "lm_eval.models" not in sys.modules and not any(isinstance(f, _RegisterA2D) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterA2D())


install()
