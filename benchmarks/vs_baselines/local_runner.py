"""Reference row, not a baseline: no transfer at all, each rank's micro-batches already in its memory.

``local_memory`` runs the same 4 consumer processes and the same :func:`rank_loop` as the systems,
on micro-batches each rank built from the (deterministic) workload at start-up, images once per
group (what the deduplicating systems deliver). Its transfer+train time is the floor of this
host: 4 ranks' forward/backward on its cores with nothing else running. A system can be at most
``baseline / floor`` times faster than a baseline on transfer+train here, whatever its transport.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from typing import IO, Any

from benchmarks.vs_baselines.common import RunnerOptions, rank_loop, warm_up
from benchmarks.vs_baselines.knittrans_runner import REPO, KnitTransRunner
from benchmarks.vs_baselines.workload import Workload, WorkloadSpec, batch_from_rows, generate

__all__ = ["VARIANTS", "LocalRunner", "make_runner"]

VARIANTS = ("memory",)


class LocalRunner:
    """The no-transfer floor (see the module docstring)."""

    def __init__(self, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown local variant {variant!r}; choose from {VARIANTS}")
        self.name = f"local_{variant}"
        self._consumers: list[subprocess.Popen[str]] = []

    def setup(self, spec: WorkloadSpec, options: RunnerOptions) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        config = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}, "hidden": options.compute_hidden}
        for r in range(spec.ranks):
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.vs_baselines.local_runner", "local_consumer", "--rank", str(r)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
            self._consumers.append(proc)
            KnitTransRunner._send(proc, config)
        for proc in self._consumers:
            KnitTransRunner._receive(proc)

    def put(self, workload: Workload, tag: str) -> dict[str, float]:
        return {"put_s": 0.0}

    def consume(self, tag: str, compute: bool) -> list[dict[str, Any]]:
        for proc in self._consumers:
            KnitTransRunner._send(proc, {"cmd": "run", "compute": compute})
        return [KnitTransRunner._receive(proc) for proc in self._consumers]

    def clear(self, tag: str) -> None:
        return None

    def teardown(self) -> None:
        for proc in self._consumers:
            with contextlib.suppress(BrokenPipeError, OSError):
                KnitTransRunner._send(proc, {"cmd": "stop"})
        for proc in self._consumers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._consumers = []


def make_runner(variant: str) -> LocalRunner:
    """Factory used by the driver."""
    return LocalRunner(variant)


def _serve(rank: int, inp: IO[str], out: IO[str]) -> None:
    config = json.loads(inp.readline())
    spec = WorkloadSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in config["spec"].items()})
    hidden = int(config["hidden"])
    warm_up(spec, hidden)
    workload = generate(spec)
    batches = [batch_from_rows(workload, list(spec.plan(rank, m)), dedup_images=True)
               for m in range(spec.micro_batches)]
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in inp:
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            break
        result = rank_loop(rank, spec, iter(batches), compute=bool(cmd["compute"]), hidden=hidden)
        out.write(json.dumps(result) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="consumer rank of the no-transfer reference row")
    p.add_argument("role", choices=["local_consumer"])
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args(argv)
    _serve(args.rank, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
