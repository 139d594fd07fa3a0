#!/usr/bin/env bash
# GPU path checks and timings (to_device correctness, H2D GB/s vs a pinned cudaMemcpy, CuPy/DLPack view).
# Runs in under 5 minutes on one CUDA GPU with the interpreter that has torch (and optionally CuPy):
#   bash scripts/device_check.sh            # results in benchmarks/transfer/results/device_check.{json,md}
# On a machine without CUDA it says so and exits 0. Needs: torch, pyarrow, numpy (no install step).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[device_check] no NVIDIA GPU on this machine (nvidia-smi missing or found no device): nothing to check"
  exit 0
fi
nvidia-smi -L
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 290 "$PY" benchmarks/transfer/device_check.py "$@"
