"""Reference row, not a baseline: no transfer at all, each rank's micro-batches already in its memory.

``local_memory`` runs the same 4 consumer processes and the same :func:`rank_loop` as the systems,
on micro-batches each rank built from the (deterministic) workload at start-up, images once per
group (what the deduplicating systems deliver). Its transfer+train time is the floor of this
host: 4 ranks' forward/backward on its cores with nothing else running. A system can be at most
``baseline / floor`` times faster than a baseline on transfer+train here, whatever its transport.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from benchmarks.vs_baselines.common import RunnerOptions, rank_loop, warm_up
from benchmarks.vs_baselines.rankprocs import RankProcesses, rank_main, read_config, serve_commands
from benchmarks.vs_baselines.workload import Workload, WorkloadSpec, batch_from_rows, generate

__all__ = ["VARIANTS", "LocalRunner", "make_runner"]

VARIANTS = ("memory",)


class LocalRunner:
    """The no-transfer floor (see the module docstring)."""

    def __init__(self, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown local variant {variant!r}; choose from {VARIANTS}")
        self.name = f"local_{variant}"
        self._ranks: RankProcesses | None = None

    def setup(self, spec: WorkloadSpec, options: RunnerOptions) -> None:
        config = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}, "hidden": options.compute_hidden}
        self._ranks = RankProcesses("benchmarks.vs_baselines.local_runner", "local_consumer", spec.ranks, config)

    def put(self, workload: Workload, tag: str) -> dict[str, float]:
        return {"put_s": 0.0}

    def consume(self, tag: str, compute: bool) -> list[dict[str, Any]]:
        assert self._ranks is not None
        self._ranks.send({"cmd": "run", "compute": compute})
        return self._ranks.receive()

    def clear(self, tag: str) -> None:
        return None

    def teardown(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()


def make_runner(variant: str) -> LocalRunner:
    """Factory used by the driver."""
    return LocalRunner(variant)


def _serve(rank: int, inp: IO[str], out: IO[str]) -> None:
    _, spec, hidden = read_config(inp)
    warm_up(spec, hidden)
    workload = generate(spec)
    batches = [
        batch_from_rows(workload, list(spec.plan(rank, m)), dedup_images=True) for m in range(spec.micro_batches)
    ]
    serve_commands(
        inp, out, lambda cmd: rank_loop(rank, spec, iter(batches), compute=bool(cmd["compute"]), hidden=hidden)
    )


def main(argv: list[str] | None = None) -> int:
    return rank_main("local_consumer", "consumer rank of the no-transfer reference row", _serve, argv)


if __name__ == "__main__":
    sys.exit(main())
