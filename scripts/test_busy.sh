#!/usr/bin/env bash
# The core tests that touch wall-clock timing (marker `timing`: deadlines, sleeps against timeouts,
# heartbeats, long-poll and idle-connection timeouts) again, with two busy-loop processes beside them:
# they must wait on conditions, not on time, and still pass on a saturated 2-core machine. The rest of
# the suite does not depend on the clock and already ran in the plain step.
# Usage: bash scripts/test_busy.sh [pytest args...]   (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
busy=()
for _ in 1 2; do
  .venv/bin/python -c "while True: pass" &
  busy+=("$!")
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
.venv/bin/python -m pytest -q -p no:cacheprovider tests --ignore=tests/ray_integration \
  -m "timing and not vllm and not compose and not netns" "$@"
