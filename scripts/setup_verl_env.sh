#!/usr/bin/env bash
# Create (or refresh) the verl venv of the `tests/verl_integration` CI step: verl 0.9.1 (its own
# pins: tensordict<=0.10, transformers 5.x) + transferqueue 0.1.11 + Ray, next to knittrans (editable).
#
#   scripts/setup_verl_env.sh                 # venv at <repo>/.venv-verl
#   VERL_VENV=/tmp/vv scripts/setup_verl_env.sh
#
# verl 0.9.1's metadata does not list cachetools, which verl/workers/rollout/router.py imports;
# it is installed explicitly. Idempotent; fails loudly on any error.
set -Eeuo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VENV:-$REPO/.venv-verl}"
PYTHON="${PYTHON:-python3}"
SPECS=("torch==2.13.0" "transferqueue==0.1.11" "verl==0.9.1" "cachetools" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100")
STAMP="$VENV/.knittrans-verl-0.9.1-h"  # -h: hypothesis added (the TransferQueue contract's property test)
trap 'rc=$?; printf "[setup_verl_env] FAILED (exit %d) at line %d: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2; exit $rc' ERR

t0=$(date +%s)
echo "[setup_verl_env] repo=$REPO venv=$VENV"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
if [[ ! -f "$STAMP" ]]; then
  echo "[setup_verl_env] installing ${SPECS[*]} (progress: pip's own lines)"
  "$VENV/bin/python" -m pip install --progress-bar off -q "${SPECS[@]}"
  touch "$STAMP"
fi
"$VENV/bin/python" -m pip install -q --progress-bar off -e "$REPO[demo]"  # the model stack (no longer core)
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
import warnings
warnings.simplefilter("ignore")
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync  # noqa: F401  (the class we subclass)
import transfer_queue, knittrans.integrations.verl  # noqa: F401
for dist in ["verl", "transferqueue", "tensordict", "ray", "torch", "knittrans"]:
    print(f"  {dist:14s} {md.version(dist)}")
PYEOF
echo "[setup_verl_env] done in $(( $(date +%s) - t0 )) s"
