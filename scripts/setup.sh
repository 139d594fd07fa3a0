#!/usr/bin/env bash
# Create .venv with KnitTrans and its test tools. Idempotent; safe to re-run.
# torch is pinned to 2.13.0: on these machines it is a local CPU wheel (other versions download GBs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
echo "[setup] installing torch==2.13.0 and knittrans[dev] into .venv"
python -m pip install -q --upgrade pip 2>&1 | grep -v -i warning || true
python -m pip install -q torch==2.13.0 2>&1 | grep -v -i warning || true
python -m pip install -q -e '.[dev]' 2>&1 | grep -v -i warning || true
python -c "import knittrans, torch, pyarrow, fastapi; print('[setup] ok: torch', torch.__version__, 'pyarrow', pyarrow.__version__)"
