"""Child process of the harness: runs one system on one workload for all repetitions, writes JSON.

    python -m benchmarks.vs_baselines.driver --system ray --variant group --kind multimodal \
        --reps 3 --modes none,compute --out result.json

The harness samples this process tree's memory from outside; this process only reports timings,
phase windows (wall-clock) and the per-row digests its consumer ranks computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
import time
from typing import Any

from benchmarks.vs_baselines.common import RunnerOptions
from benchmarks.vs_baselines.workload import WorkloadSpec, generate

__all__ = ["RUNNER_MODULES", "main"]

logger = logging.getLogger(__name__)

RUNNER_MODULES = {
    "tq": "benchmarks.vs_baselines.tq_runner",
    "ray": "benchmarks.vs_baselines.ray_runner",
    "knittrans": "benchmarks.vs_baselines.knittrans_runner",
    "local": "benchmarks.vs_baselines.local_runner",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--system", choices=sorted(RUNNER_MODULES), required=True)
    p.add_argument("--variant", required=True)
    p.add_argument("--kind", choices=["text", "multimodal"], required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="none,compute", help="comma list of 'none' and/or 'compute'")
    p.add_argument("--spec-json", default="{}", help="WorkloadSpec overrides as JSON")
    p.add_argument("--compute-hidden", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1, help="unrecorded mini-batches per mode before the measured ones")
    p.add_argument(
        "--no-put-ahead",
        dest="put_ahead",
        action="store_false",
        help="compute mode: put each mini-batch only after the previous one was consumed",
    )
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    overrides = json.loads(args.spec_json)
    for key in ("prompt_len", "response_len", "image_shape"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])
    spec = WorkloadSpec(kind=args.kind, **overrides)
    workload = generate(spec)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"none", "compute"}:
        raise SystemExit(f"--modes must list 'none' and/or 'compute', got {args.modes!r}")
    runner = importlib.import_module(RUNNER_MODULES[args.system]).make_runner(args.variant)
    result: dict[str, Any] = {
        "system": runner.name,
        "kind": args.kind,
        "spec": dataclasses.asdict(spec),
        "phases": [],
        "runs": [],
    }

    def phase(name: str, t0: float, t1: float) -> None:
        result["phases"].append({"name": name, "start": t0, "end": t1})

    t0 = time.time()
    runner.setup(spec, RunnerOptions(compute_hidden=args.compute_hidden))
    t1 = time.time()
    result["startup_s"] = t1 - t0
    phase("startup", t0, t1)
    logger.info("%s %s: started in %.1f s", runner.name, args.kind, t1 - t0)
    puts: dict[str, dict[str, float]] = {}

    def do_put(tag: str) -> None:
        a = time.time()
        puts[tag] = runner.put(workload, tag)
        phase(f"put:{tag}", a, time.time())

    try:
        for mode in modes:
            compute = mode == "compute"
            # compute: the next mini-batch is put *before* the current one is consumed, as a rollout
            # that runs ahead of training leaves it; a client that prefetches across mini-batches can
            # fetch it while the current one trains (TransferQueue and Ray consumers fetch synchronously).
            ahead = compute and args.put_ahead
            # (tag, repetition); warm-up mini-batches have no repetition and are not recorded
            order: list[tuple[str, int | None]] = [(f"warmup{w}_{mode}", None) for w in range(args.warmup)]
            order += [(f"r{rep}_{mode}", rep) for rep in range(args.reps)]
            tags = [tag for tag, _ in order]
            for i, (tag, rep) in enumerate(order):
                if tag not in puts:
                    do_put(tag)
                if ahead and i + 1 < len(tags):
                    do_put(tags[i + 1])
                b = time.time()
                ranks = runner.consume(tag, compute=compute)
                c = time.time()
                runner.clear(tag)
                phase(f"consume:{tag}", b, c)
                put = puts.pop(tag)
                waits = [mb["wait_s"] for r in ranks for mb in r["micro"]]
                logger.info(
                    "%s %s %s: put %.3f s, consume %.3f s, median wait %.1f ms",
                    runner.name,
                    args.kind,
                    tag,
                    put["put_s"],
                    c - b,
                    1e3 * sorted(waits)[len(waits) // 2],
                )
                if rep is None:  # warm-up: unrecorded in the medians; the first one after start-up is cold
                    result.setdefault("warmup", []).append(
                        {"tag": tag, "mode": mode, "waits_ms": [1e3 * w for w in waits]}
                    )
                    continue
                result["runs"].append(
                    {"rep": rep, "mode": mode, "put": put, "consume_wall_s": c - b, "ranks": ranks, "put_ahead": ahead}
                )
    finally:
        t2 = time.time()
        runner.teardown()
        phase("teardown", t2, time.time())
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
