"""Seed spread of issue 13's headline figures: is a missed target noise or the mechanism?

Run: ``.venv/bin/python benchmarks/sim_report/seed_spread.py [--seeds 12] [--steps 40] [--launch-weights arrived]``.
For ``skewed3`` at K = 16, W = 1, L = 1 (the headline configuration), each seed is simulated with
``train_batch`` (whole-step handover) and ``constraint_preserving``; per seed it records the reductions of
mean architectural staleness (start, token-weighted), of the end reading's positive part, and the steps/h
ratio. Writes ``results/seed_spread.{json,md}``: per-seed rows, mean, standard deviation, min and max,
and the pooled figure (reduction of the seed-averaged means, as ``cross_check.py`` reports it).
``--launch-weights arrived`` (launches do not wait for the newest published weights) writes
``results/seed_spread_arrived.{json,md}`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from knittrans.sim.engine import simulate
from knittrans.sim.metrics import compute_metrics
from knittrans.sim.workload import load_workload

HERE = Path(__file__).parent
FIGURES = ("start_mean", "end_pos", "weighted_mean", "steps_ratio")
WEIGHTS = {"published": "the newest published weights", "arrived": "the weights that have reached rollout"}
TARGETS = {"start_mean": 0.38, "end_pos": 0.50, "weighted_mean": 0.54, "steps_ratio": 3.5}


def figures(m: Any) -> dict[str, float]:
    return {
        "start_mean": m.readings["start"].architectural.mean,
        "end_pos": m.readings["end"].architectural.pos_mean,
        "weighted_mean": m.readings["weighted"].architectural.mean,
        "steps_per_h": m.steps_per_hour,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--launch-weights", choices=("published", "arrived"), default="published")
    args = parser.parse_args()
    w = load_workload("skewed3").with_overrides(
        mini_batches_per_step=16,
        window=1,
        lookahead=1,
        train_batch_handover="step",
        steps=args.steps,
        launch_weights=args.launch_weights,
    )
    rows: list[dict[str, Any]] = []
    raw: dict[str, list[dict[str, float]]] = {"train_batch": [], "constraint_preserving": []}
    for seed in range(args.seeds):
        tb = figures(compute_metrics(simulate(w, "train_batch", seed=seed)))
        cp = figures(compute_metrics(simulate(w, "constraint_preserving", seed=seed)))
        raw["train_batch"].append(tb)
        raw["constraint_preserving"].append(cp)
        row = {f: 1.0 - cp[f] / tb[f] for f in FIGURES if f != "steps_ratio"}
        row["steps_ratio"] = cp["steps_per_h"] / tb["steps_per_h"]
        rows.append({"seed": seed, **row})
        print(f"[seed_spread] seed {seed + 1}/{args.seeds}: start {100 * row['start_mean']:.2f}%", file=sys.stderr)
    stats: dict[str, dict[str, float]] = {}
    for f in FIGURES:
        values = [r[f] for r in rows]
        if f == "steps_ratio":
            pooled = statistics.fmean(c["steps_per_h"] for c in raw["constraint_preserving"]) / statistics.fmean(
                t["steps_per_h"] for t in raw["train_batch"]
            )
        else:
            pooled = 1.0 - statistics.fmean(c[f] for c in raw["constraint_preserving"]) / statistics.fmean(
                t[f] for t in raw["train_batch"]
            )
        stats[f] = {
            "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values),
            "max": max(values),
            "pooled": pooled,
            "target": TARGETS[f],
            "seeds_meeting_target": sum(v >= TARGETS[f] for v in values),
        }

    def pct(v: float, f: str) -> str:
        return f"{v:.2f}x" if f == "steps_ratio" else f"{100 * v:.2f}%"

    lines = [
        f"# Seed spread: skewed3, K = 16, W = 1, L = 1, {args.steps} steps, {args.seeds} seeds",
        "",
        "constraint_preserving vs train_batch (whole-step handover), each seed run by both; launches start "
        f"with {WEIGHTS[args.launch_weights]} (`launch_weights: {args.launch_weights}`).",
        "",
        "| figure | target | pooled | mean | sd | min | max | seeds meeting the target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "start_mean": "red. mean start",
        "end_pos": "red. pos. part end",
        "weighted_mean": "red. mean weighted",
        "steps_ratio": "steps/h x TB",
    }
    for f in FIGURES:
        s = stats[f]
        lines.append(
            f"| {names[f]} | >= {pct(s['target'], f)} | {pct(s['pooled'], f)} | {pct(s['mean'], f)} "
            f"| {pct(s['sd'], f)} | {pct(s['min'], f)} | {pct(s['max'], f)} "
            f"| {s['seeds_meeting_target']} / {args.seeds} |"
        )
    md = "\n".join(lines) + "\n"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    meta = {
        "workload": "skewed3",
        "K": 16,
        "W": 1,
        "L": 1,
        "launch_weights": args.launch_weights,
        "seeds": args.seeds,
        "steps": args.steps,
        "command": "python benchmarks/sim_report/seed_spread.py " + " ".join(sys.argv[1:]),
        "machine": platform.node(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "git_commit": commit,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "seed_spread" if args.launch_weights == "published" else "seed_spread_arrived"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "stats": stats, "rows": rows}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
