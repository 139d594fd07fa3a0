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
# Quiet, but a failing pip fails the script: its output is kept in a log and shown only on failure.
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
quiet() {
  if ! "$@" >"$LOG" 2>&1; then
    echo "[setup] failed: $*" >&2
    cat "$LOG" >&2
    exit 1
  fi
}
quiet python -m pip install -q --upgrade pip
quiet python -m pip install -q torch==2.13.0
quiet python -m pip install -q -e '.[dev]'
python -c "import knittrans, torch, pyarrow, fastapi; print('[setup] ok: torch', torch.__version__, 'pyarrow', pyarrow.__version__)"
