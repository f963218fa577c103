"""Real text that ships with every Python install, as prompts: nothing is downloaded or written here.

- `stdlib_code`: functions of the standard library's own source. The prompt is the function's
  signature and the first paragraph of its docstring ("complete this function"); the reference
  answer is its body. Grouped by top-level module (`json`, `email`, ...).
- `python_docs`: passages of the interpreter's own documentation (`pydoc_data.topics`), asked as a
  continuation or as an explanation. Grouped by topic (`assert`, `for`, ...).

A group is held out whole (`held_out`): no function of a held-out module and no passage of a
held-out topic is a training prompt, so an eval on them measures transfer, not memory.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

from a2d.stores.bundled import KINDS

SOURCES = ("stdlib_code", "python_docs")
MIN_BODY_LINES, MAX_BODY_LINES = 5, 40  # functions of this many body lines (the docstring excluded)
MAX_HEAD_CHARS = 480  # signature + docstring paragraph: a prompt of ~100-150 tokens
PASSAGE_CHARS = (300, 700)  # documentation passages of this many characters
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "tkinter"}


def prompt_set(kind: str | None) -> str:
    """The prompt set a row belongs to, as the benchmarks and the eval report speed per set:
    `code` and `docs` (the offline corpora), `bundled` (the checkable generator), `data` otherwise."""
    if kind in ("code", "docs"):
        return kind
    return "bundled" if kind in KINDS else "data"


def held_out(group: str, fraction: float) -> bool:
    """Whether a whole group (a module, a topic) is held out: a hash of its name, stable as sources grow."""
    h = int(hashlib.sha256(f"group:{group}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < fraction


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _function_row(path: Path, module: str, node: ast.FunctionDef, lines: list[str]) -> dict | None:
    doc = ast.get_docstring(node)
    if not doc or not node.body or node.name.startswith("__"):
        return None
    first = node.body[0]
    body = node.body[1:]
    if not body:
        return None
    head_end = first.end_lineno  # the docstring's last line
    body_lines = [ln for ln in lines[head_end : node.end_lineno] if ln.strip()]
    if not MIN_BODY_LINES <= len(body_lines) <= MAX_BODY_LINES:
        return None
    paragraph = doc.split("\n\n")[0].strip()
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    signature = textwrap.dedent("\n".join(lines[start : first.lineno - 1])).rstrip()
    indent = " " * (4 + (len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())))
    quoted = textwrap.indent(f'"""{paragraph}"""', indent).lstrip()
    head = f"{signature}\n{' ' * 4}{quoted}"
    if len(head) > MAX_HEAD_CHARS or '"""' in paragraph:
        return None
    body_text = textwrap.dedent("\n".join(lines[head_end : node.end_lineno])).strip("\n")
    return {
        "group": module.split(".")[0],
        "id": f"code:{module}:{node.name}:{node.lineno}",
        "prompt": f"Complete this Python function from the standard library module `{module}`:\n\n"
        f"```python\n{head}\n```",
        "response": body_text,
    }


@functools.lru_cache(maxsize=1)
def stdlib_functions() -> tuple[dict[str, str], ...]:
    """Every standard-library function of 5-40 body lines with a docstring, in a stable order."""
    root = _stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_DIRS or rel.name.startswith("test"):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                row = _function_row(path, module, node, lines)
                if row is not None:
                    out.append(row)
    return tuple(out)


def _passages(text: str) -> list[str]:
    """Runs of whole paragraphs of PASSAGE_CHARS characters."""
    out, buf = [], ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        buf = f"{buf}\n\n{para}" if buf else para
        if len(buf) >= PASSAGE_CHARS[0]:
            if len(buf) <= PASSAGE_CHARS[1]:
                out.append(buf)
            buf = ""
    return out


@functools.lru_cache(maxsize=1)
def doc_passages() -> tuple[dict[str, str], ...]:
    """Passages of `pydoc_data.topics`, asked alternately as a continuation and as an explanation."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        for i, passage in enumerate(_passages(topics[topic])):
            if i % 2 == 0:
                cut = passage.rfind(" ", 0, len(passage) // 2)
                prompt = "Continue this passage from the Python documentation:\n\n" + passage[:cut].rstrip()
                response = passage[cut:].strip()
            else:
                prompt = "Explain this part of the Python documentation in plain words:\n\n" + passage
                response = None
            out.append({"group": topic, "id": f"docs:{topic}:{i}", "prompt": prompt, "response": response})
    return tuple(out)


def candidates(source: str) -> tuple[dict[str, str], ...]:
    if source == "stdlib_code":
        return stdlib_functions()
    if source == "python_docs":
        return doc_passages()
    raise ValueError(f"unknown prompt source {source!r}: use one of {SOURCES}")


def sample(source: str, rows: int, eval_fraction: float, seed: int) -> list[dict[str, Any]]:
    """`rows` prompts of a source, about `eval_fraction` of them from held-out groups (`__split__`
    set: a held-out group's rows are eval rows, every other's train rows), drawn by `seed`."""
    pool = candidates(source)
    rng = random.Random(f"{source}-{seed}")
    held = [r for r in pool if held_out(r["group"], eval_fraction)]
    train = [r for r in pool if not held_out(r["group"], eval_fraction)]
    n_eval = min(len(held), round(rows * eval_fraction))
    n_train = min(len(train), rows - n_eval)
    kind = "code" if source == "stdlib_code" else "docs"
    out = []
    for split, picked in (("eval", rng.sample(held, n_eval)), ("train", rng.sample(train, n_train))):
        for r in sorted(picked, key=lambda r: r["id"]):
            out.append({**r, "kind": kind, "answer": None, "__split__": split})
    return out


def fingerprint(source: str) -> str:
    """A hash of a source's whole candidate pool: another Python's stdlib or docs give another key."""
    blob = json.dumps([sys.version_info[:2], candidates(source)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
