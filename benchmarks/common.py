"""Shared benchmark helpers: the teacher under test, token batches, and the JSON result file."""

from __future__ import annotations

import json
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from a2d.models.teacher import build_random_teacher, convert_smollm2, load_teacher, native_bf16
from a2d.stores import bundled

RESULTS = Path(__file__).resolve().parent / "results"


def built(config: str, store: str | None, stage: str):
    """(config, planned refs up to `stage`, ArtifactStore) of a pipeline already built up to `stage`;
    exits naming the command to run when that stage's artifact is not complete."""
    from a2d.flows.pipeline import plan
    from a2d.specs import load_config
    from a2d.stores.artifacts import ArtifactStore

    cfg = load_config(config, [f"store={store}"] if store else [])
    refs = plan(cfg, stage)
    st = ArtifactStore(cfg.store)
    if not st.is_complete(refs[stage]):
        raise SystemExit(
            f"no complete {stage} artifact at {refs[stage].uri}: run `a2d run {config} --until {stage}` "
            "(or `make demo`) first"
        )
    return cfg, refs, st


def teacher(kind: str, cache: Path | None = None):
    """`smollm2` (the packaged GGUF, converted once) or `tiny` (random 64-layer qwen3_5)."""
    cache = cache or Path(tempfile.gettempdir()) / "a2d-bench"
    path = cache / kind
    if not (path / "config.json").exists():
        if kind == "smollm2":
            convert_smollm2(path, "float32")
        else:
            build_random_teacher("qwen3_5", 64, 64, 0, path, "float32")
    return load_teacher(path, device="cpu")


def token_batches(tok: Any, samples: int, seq_len: int) -> list[list[int]]:
    """`samples` sequences of exactly `seq_len` tokens of chat-templated bundled problems and answers."""
    rows = bundled.generate(samples * 8, seed=1)
    out, buf = [], []
    for row in rows:
        msgs = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        buf += tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
        while len(buf) >= seq_len and len(out) < samples:
            out.append(buf[:seq_len])
            buf = buf[seq_len:]
    if len(out) < samples:
        raise RuntimeError("not enough bundled text for the requested batches")
    return out


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(name: str, result: dict[str, Any]) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or ".." in name:
        raise ValueError(
            f"result name {name!r}: use letters, digits, '_', '-' or '.' (it names results/NAME.json)"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        **result,
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "cpu": cpu_model(),
            # AVX2-only hosts emulate bf16 (5x slower than fp32) and pay more per fed token than AMX
            # hosts: every speed ratio here is a property of this row as much as of the decoder
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": native_bf16(torch.device("cpu")),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2, sort_keys=True))
    return path
