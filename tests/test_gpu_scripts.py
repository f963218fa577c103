"""The GPU benchmark scripts run end to end on a tiny model on the CPU, so they cannot rot."""

import json
import runpy

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,result,fields",
    [
        (
            "anchors_27b.py",
            "gpu_anchors_tiny.json",
            {"anchors_vs_bare", "bare_tokens_per_s", "mfu_vs_bf16_peak", "params"},
        ),
        (
            "qlora_step_27b.py",
            "gpu_qlora_tiny.json",
            {"peak_memory_gb", "step_seconds", "lora_modules", "seq_len"},
        ),
        (
            "drafter_27b.py",
            "gpu_drafter_tiny.json",
            {"train_step_seconds", "drafter_vs_target_forward", "drafter_params", "target_layer_ids"},
        ),
        (
            "decode_27b.py",
            "gpu_decode_tiny.json",
            {"ar_step_seconds", "spec_forward_seconds", "spec_forward_vs_ar_step", "block"},
        ),
    ],
)
def test_gpu_script_runs_tiny(script, result, fields, tmp_path, monkeypatch):
    # In this process, as `python benchmarks/gpu/<script>` runs it (a child would re-import torch,
    # transformers and bitsandbytes: most of the time on this CPU).
    monkeypatch.setattr("sys.argv", [script, "--tiny", "--out", str(tmp_path)])
    runpy.run_path(f"{ROOT}/benchmarks/gpu/{script}", run_name="__main__")
    doc = json.loads((tmp_path / result).read_text())
    assert fields <= set(doc) and doc["shape"] == "tiny"
    if "drafter_vs_target_forward" in doc:  # a one-layer drafter costs a fraction of an 8-layer target
        assert 0 < doc["drafter_vs_target_forward"] < 1 and doc["train_step_seconds"] > 0
    if "spec_forward_seconds" in doc:
        assert doc["spec_forward_seconds"] > 0 and doc["ar_step_seconds"] > 0
    if "lora_modules" in doc:
        assert (
            doc["lora_modules"] == doc["nf4_linears"] == 62
        )  # 6 DeltaNet layers x 8 + 2 attention layers x 7
