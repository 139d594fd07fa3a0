#!/usr/bin/env bash
# Create (or refresh) the separate benchmark venv with the baselines of benchmarks/vs_baselines:
# TransferQueue 0.1.11 (PyPI) and Ray, next to an editable install of knittrans; AReaL 1.0.4's RTensor
# module for the AReaL adapter's test.
# Idempotent: re-running only installs what is missing. Fails loudly on any error.
#
#   scripts/setup_bench_env.sh                # venv at <repo>/.venv-bench
#   BENCH_VENV=/tmp/vb scripts/setup_bench_env.sh
#   TORCH_SPEC="torch==2.13.0" scripts/setup_bench_env.sh
set -Eeuo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BENCH_VENV:-$REPO/.venv-bench}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TQ_SPEC="${TQ_SPEC:-transferqueue==0.1.11}"
RAY_SPEC="${RAY_SPEC:-ray}"

step=0
t_start=$(date +%s)
say() { step=$((step + 1)); printf '[setup_bench_env %d] %s\n' "$step" "$*"; }
trap 'rc=$?; printf "[setup_bench_env] FAILED (exit %d) at line %d: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2; exit $rc' ERR

say "repo=$REPO venv=$VENV python=$($PYTHON --version 2>&1)"
if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating venv"
  "$PYTHON" -m venv "$VENV"
else
  say "venv exists, reusing"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --progress-bar off)

have() { "$PY" - "$1" <<'PYEOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
req = Requirement(sys.argv[1])
try:
    v = md.version(req.name)
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if req.specifier.contains(v, prereleases=True) else 1)
PYEOF
}

"${PIP[@]}" -q --upgrade pip packaging >/dev/null
for spec in "$TORCH_SPEC" "$TQ_SPEC" "$RAY_SPEC" "psutil>=5.9" "matplotlib>=3.8" "pytest>=8" "pytest-timeout>=2.3"; do
  if have "$spec"; then
    say "$spec already installed"
  else
    say "installing $spec"
    "${PIP[@]}" "$spec"
  fi
done
# AReaL 1.0.4 for tests/ray_integration/test_areal_rtensor.py: its RTensor module and what that module imports,
# without AReaL's dependency set (it pins torch<2.11 and pulls agent SDKs, inference servers, ...)
AREAL_SPECS=("areal==1.0.4" colorlog tenacity flask werkzeug blinker itsdangerous torchdata lark uvloop numba llvmlite
  orjson einops aiofiles openai sniffio jiter)
if "$PY" -c "import areal.infra.rpc.rtensor" >/dev/null 2>&1; then
  say "areal (RTensor) already importable"
else
  say "installing ${AREAL_SPECS[*]} (--no-deps)"
  "${PIP[@]}" -q --no-deps "${AREAL_SPECS[@]}"
fi
say "installing knittrans[demo] (editable) from $REPO: the model stack the baselines and Ray tests run"
"${PIP[@]}" -q -e "$REPO[demo]"

say "checking imports and dependency consistency"
# AReaL's own requirements are left out on purpose (above); any other broken requirement fails the setup
problems=$("$PY" -m pip check 2>&1 | grep -v -e '^areal ' -e '^No broken requirements' || true)
if [[ -n "$problems" ]]; then echo "$problems" >&2; exit 1; fi
"$PY" -c "import areal.infra.rpc.rtensor"
"$PY" - <<'PYEOF'
import importlib.metadata as md
for name in ["torch", "transfer_queue", "ray", "pyarrow", "numpy", "fastapi", "pydantic", "knittrans"]:
    __import__(name)
for dist in ["torch", "transferqueue", "ray", "pyarrow", "numpy", "fastapi", "pydantic", "pyzmq", "knittrans"]:
    try:
        print(f"  {dist:14s} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist:14s} (not installed)")
PYEOF
size=$(du -sh "$VENV" | cut -f1)
say "done in $(( $(date +%s) - t_start )) s; venv size $size"
echo "activate with: . $VENV/bin/activate"
