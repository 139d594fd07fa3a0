#!/usr/bin/env bash
# The core suite with two busy-loop processes beside it (tests must wait on conditions, not time).
# Left out: slow end-to-end runs (run once in the plain step) and `timing` tests, which compare
# measured durations (a speed property that belongs in benchmarks/).
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
  -m "not vllm and not compose and not netns and not schemathesis and not slow and not timing" "$@"
