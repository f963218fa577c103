"""The package graph: a2d.* imports point down the layers, never up, and never in a cycle; and the
size limits a reader can hold (STYLE: files of at most 400 lines, functions of at most 80).

specs -> models -> stores -> tasks -> flows -> deployments and the CLI (DESIGN §6), with benchmarks/
above them all (a benchmark may import any layer, no a2d module imports a benchmark). Lazy imports
inside functions count: they are how cycles hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# What each layer may import from a2d; `models` is plain math and torch, so nothing but itself.
LAYERS = ("specs", "models", "stores", "tasks", "flows", "top")
ALLOWED = {
    "specs": {"specs"},
    "models": {"models"},
    "stores": {"specs", "models", "stores"},
    "tasks": {"specs", "models", "stores", "tasks"},
    "flows": {"specs", "models", "stores", "tasks", "flows"},
    "top": set(LAYERS),
}
TOP_MODULES = {"a2d.flows.cli"}  # the CLI lives with the flows but sits on top, beside deployments
FOLDERS = ("specs", "models", "stores", "tasks", "flows", "deployments")
# Third-party packages a layer must not reach for (STYLE: models are math, stores are not Prefect).
FORBIDDEN = {"models": {"prefect", "fsspec", "zarr"}, "stores": {"prefect"}, "specs": {"prefect", "torch"}}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "a2d." + ".".join(parts)


def layer_of(module: str) -> str:
    if module in TOP_MODULES or module.startswith("a2d.deployments"):
        return "top"
    return module.split(".")[1]


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted(Path(ROOT, folder).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, `from a2d.x import y` resolved to the
    module a2d.x.y when that is a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in known else node.module, node.lineno))
    return out


def problems() -> tuple[list[str], dict[str, set[str]]]:
    modules = all_modules()
    known = set(modules)
    errors: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        layer = layer_of(module)
        where = path.relative_to(ROOT)
        for target, line in imports(path, known):
            top = target.split(".")[0]
            if top in FOLDERS:
                errors.append(
                    f"{where}:{line}: imports {target!r}; a2d's own modules are imported as a2d.{target}"
                )
                continue
            if top in FORBIDDEN.get(layer, ()):
                errors.append(f"{where}:{line}: the {layer} layer must not import {top} (imports {target})")
            if not target.startswith("a2d."):
                continue
            if target not in known:
                target = next((m for m in known if target.startswith(m + ".")), target)
            if layer_of(target) not in ALLOWED[layer]:
                errors.append(
                    f"{where}:{line}: upward import: {module} ({layer}) imports {target} ({layer_of(target)})"
                )
            if target != module and target in known:
                graph[module].add(target)
    return errors, graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def benchmark_problems() -> list[str]:
    """Benchmarks sit on top: they import a2d as installed (a2d.*) or each other (benchmarks.*),
    never a folder by its checkout name, and no a2d module imports them."""
    errors = []
    for path in sorted(Path(ROOT, "benchmarks").rglob("*.py")):
        for target, line in imports(path, set()):
            if target.split(".")[0] in FOLDERS:
                errors.append(f"{path.relative_to(ROOT)}:{line}: imports {target!r}; use a2d.{target}")
    for module, path in all_modules().items():
        for target, line in imports(path, set()):
            if target.split(".")[0] == "benchmarks":
                errors.append(f"{path.relative_to(ROOT)}:{line}: {module} imports a benchmark ({target})")
    return errors


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80
# Long by nature: an argument parser is one long list of options; a benchmark's main is its report.
LONG_FUNCTIONS_ALLOWED = {("flows/cli.py", "build_parser")}


def size_problems(root: str) -> list[str]:
    """Source files over MAX_FILE_LINES lines and functions over MAX_FUNCTION_LINES (outside
    benchmarks' mains and LONG_FUNCTIONS_ALLOWED); tests are not held to them."""
    errors = []
    for folder in (*FOLDERS, "benchmarks"):
        for path in sorted(Path(root, folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            if (n := len(text.splitlines())) > MAX_FILE_LINES:
                errors.append(f"{rel}: {n} lines (at most {MAX_FILE_LINES}: split it by concern)")
            for node in ast.walk(ast.parse(text, rel)):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                n = node.end_lineno - node.lineno + 1
                exempt = (rel, node.name) in LONG_FUNCTIONS_ALLOWED or (
                    rel.startswith("benchmarks/") and node.name == "main"
                )
                if n > MAX_FUNCTION_LINES and not exempt:
                    errors.append(
                        f"{rel}:{node.lineno}: {node.name} is {n} lines (at most {MAX_FUNCTION_LINES})"
                    )
    return errors


def test_benchmarks_sit_on_top():
    errors = benchmark_problems()
    assert not errors, "\n".join(errors)


def test_files_and_functions_stay_readable():
    errors = size_problems(ROOT)
    assert not errors, "\n".join(errors)


def test_the_size_check_catches_a_long_file_and_a_long_function(tmp_path):
    long_function = "def f():\n" + "    x = 1\n" * 85
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "long.py").write_text(long_function + "\n" * 320)
    errors = size_problems(str(tmp_path))
    assert any("models/long.py: " in e and "lines (at most 400" in e for e in errors), errors
    assert any("models/long.py:1: f is 86 lines" in e for e in errors), errors


def test_every_import_points_down():
    errors, _ = problems()
    assert not errors, "\n".join(errors)


def test_no_import_cycle():
    _, graph = problems()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_catches_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The checks above can fail: an upward import and a two-module cycle are both reported."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    bad = tmp_path / "models" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import os\n\ndef f():\n    from a2d.tasks.head import run_training\n")
    monkeypatch.setattr(f"{__name__}.ROOT", str(tmp_path))
    monkeypatch.setattr(f"{__name__}.FOLDERS", ("models",))
    errors, _ = problems()
    assert errors and "models/bad.py:4: upward import" in errors[0]
