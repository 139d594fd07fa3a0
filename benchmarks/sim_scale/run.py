"""Simulator cost at three cluster sizes: wall time vs events (should grow about linearly), plus one full run.

Usage: python benchmarks/sim_scale/run.py [--steps 40] [--repeats 3] [--full-steps 1000] [--out DIR]

Sizes scale the bundled ``code_agent_skew`` workload: ``f`` times the quotas and the rollout slots
(f = 1, 4, 8 -> 64/256/512 slots, 1,024/4,096/8,192 trajectories per step), K = 16. Each size runs every
policy ``--repeats`` times (median reported); the full run is 512 slots x 8,192 trajectories per step
for ``--full-steps`` steps with ``constraint_preserving``, metrics included. Writes results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from knittrans.sched.admission import POLICIES
from knittrans.sim.engine import simulate
from knittrans.sim.metrics import compute_metrics
from knittrans.sim.workload import Workload, load_workload


def scaled(factor: int) -> Workload:
    """code_agent_skew with quotas and rollout slots multiplied by ``factor``, K = 16."""
    w = load_workload("code_agent_skew")
    sources = tuple(dataclasses.replace(s, quota=s.quota * factor) for s in w.sources)
    return w.with_overrides(sources=sources, rollout_slots=w.rollout_slots * factor, mini_batches_per_step=16)


def timed(w: Workload, policy: str, steps: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    trace = simulate(w, policy, seed=0, steps=steps)
    compute_metrics(trace)
    return time.perf_counter() - t0, trace.events, trace.select_calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full-steps", type=int, default=1000, help="steps of the full-size run (0 skips it)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    rows = []
    for factor in (1, 4, 8):
        w = scaled(factor)
        for policy in POLICIES:
            runs = [timed(w, policy, args.steps) for _ in range(args.repeats)]
            wall = statistics.median(r[0] for r in runs)
            events, calls = runs[0][1], runs[0][2]
            rows.append(
                {
                    "factor": factor,
                    "rollout_slots": w.rollout_slots,
                    "trajectories_per_step": w.train_batch_groups * w.group_size,
                    "policy": policy,
                    "steps": args.steps,
                    "events": events,
                    "select_calls": calls,
                    "wall_s_median": wall,
                    "us_per_event": 1e6 * wall / events,
                }
            )
            print(
                f"f={factor} slots={w.rollout_slots:4d} traj/step={rows[-1]['trajectories_per_step']:5d} "
                f"{policy:<22} events={events:7d} select={calls:6d} wall={wall:7.2f}s "
                f"{rows[-1]['us_per_event']:7.1f} us/event",
                file=sys.stderr,
            )
    base = {r["policy"]: r for r in rows if r["factor"] == 1}
    print(f"\n{'policy':<22} {'f':>2} {'events':>8} {'wall s':>8} {'events x':>9} {'wall x':>7} {'us/event':>9}")
    for r in rows:
        b = base[r["policy"]]
        print(
            f"{r['policy']:<22} {r['factor']:>2} {r['events']:>8} {r['wall_s_median']:8.2f} "
            f"{r['events'] / b['events']:9.2f} {r['wall_s_median'] / b['wall_s_median']:7.2f} "
            f"{r['us_per_event']:9.1f}"
        )
    full = None
    if args.full_steps:
        w = scaled(8)
        done = [0]

        def tick(step: int) -> None:
            done[0] = step
            if step % 50 == 0:
                print(f"  full run: {step}/{args.full_steps} steps", file=sys.stderr)

        t0 = time.perf_counter()
        trace = simulate(w, "constraint_preserving", seed=0, steps=args.full_steps, on_step=tick)
        sim_s = time.perf_counter() - t0
        metrics = compute_metrics(trace)
        total_s = time.perf_counter() - t0
        full = {
            "rollout_slots": w.rollout_slots,
            "trajectories_per_step": w.train_batch_groups * w.group_size,
            "steps": args.full_steps,
            "policy": "constraint_preserving",
            "events": trace.events,
            "simulate_s": sim_s,
            "with_metrics_s": total_s,
            "quota_violations": metrics.quota_violations,
        }
        print(
            f"\nfull run: {w.rollout_slots} slots, {full['trajectories_per_step']} trajectories/step, "
            f"{args.full_steps} steps: simulate {sim_s:.1f}s, with metrics {total_s:.1f}s, "
            f"{trace.events} events"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"sizes": rows, "full": full}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
