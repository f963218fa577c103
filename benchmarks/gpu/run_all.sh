#!/usr/bin/env bash
# The GPU benchmarks on one H200, each well under 8 minutes; prints their tables.
set -euo pipefail
cd "$(dirname "$0")/../.."
python benchmarks/gpu/anchors_27b.py "$@"
python benchmarks/gpu/qlora_step_27b.py "$@"
python benchmarks/gpu/decode_27b.py "$@"
python benchmarks/gpu/drafter_27b.py "$@"
