"""Admission-timing sensitivity: every bundled workload x K x W x lookahead L, every policy, every reading.

Run: ``.venv/bin/python benchmarks/sim_report/timing_sensitivity.py [--seeds 3] [--steps 40]``.
Writes ``results/timing_sensitivity.{json,md,png}`` next to this file: seed-averaged staleness under the
start/end/weighted readings (mean, positive part, p99, max), reductions of constraint_preserving and
every policy against both train_batch baselines at the same (workload, K, W, L), steps per hour and quota
violations. The workloads run with their live-loop timings (publish delay before the ack, blocking loads).

Two baselines: ``train_batch`` (a conventional trainer handed the whole train batch when it starts a step,
``train_batch_handover: step``, the default) and ``train_batch_paced`` (the project's window rule applied to
the baseline too: a group leaves the window when its own mini-batch starts). Reductions are against
``train_batch``; the "vs paced" column gives them against ``train_batch_paced``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from knittrans.sched.admission import POLICIES
from knittrans.sim.cli import ProgressBar
from knittrans.sim.sweep import BASELINE, PACED_BASELINE, configurations, run_grid
from knittrans.sim.workload import bundled_workloads, load_workload

HERE = Path(__file__).parent
READ = ("start", "end", "weighted")


def _pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def markdown(configs: list[dict[str, Any]]) -> str:
    """One row per (workload, K, W, L, policy)."""
    lines = [
        "| workload | K | W | L | policy | arch mean s / e / w | red. mean s / e / w | red. pos. part s / e / w "
        "| vs paced: red. mean s / pos. e / mean w | p99 / max (end) | steps/h | x TB / x paced | viol |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        base = c["policies"][BASELINE]
        for policy, r in c["policies"].items():
            arch = " / ".join(f"{r[f'{x}_arch_mean']:.2f}" for x in READ)
            reds = " / ".join(_pct(r[f"{x}_arch_reduction"]) for x in READ)
            pos = " / ".join(_pct(r[f"{x}_arch_pos_reduction"]) for x in READ)
            ratio = r["steps_per_hour"] / base["steps_per_hour"]
            paced_ratio = r["steps_per_hour"] / c["policies"][PACED_BASELINE]["steps_per_hour"]
            paced = " / ".join(
                _pct(r.get(key))
                for key in (
                    "start_arch_reduction_vs_paced",
                    "end_arch_pos_reduction_vs_paced",
                    "weighted_arch_reduction_vs_paced",
                )
            )
            lines.append(
                f"| {c['workload']} | {c['mini_batches_per_step']} | {c['window']} | {c['lookahead']} | {policy} "
                f"| {arch} | {reds} | {pos} | {paced} | {r['end_arch_p99']:.1f} / {r['end_arch_max']:.1f} "
                f"| {r['steps_per_hour']:.1f} | {ratio:.2f} / {paced_ratio:.2f} | {r['quota_violations']} |"
            )
    return "\n".join(lines) + "\n"


def plot(configs: list[dict[str, Any]], path: Path) -> None:
    """CP-vs-TB reduction against L per workload, K = 16, W = 1: mean (start, weighted), positive part (end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, reading in zip(axes, READ, strict=True):
        for name in sorted({c["workload"] for c in configs}):
            rows = [
                c for c in configs if c["workload"] == name and c["mini_batches_per_step"] == 16 and c["window"] == 1
            ]
            rows.sort(key=lambda c: c["lookahead"])
            xs = [str(c["lookahead"]) for c in rows]
            key = f"{reading}_arch_pos_reduction" if reading == "end" else f"{reading}_arch_reduction"
            ys = [100 * c["policies"]["constraint_preserving"][key] for c in rows]
            line = ax.plot(xs, ys, marker="o", label=f"{name} vs train_batch")[0]
            if all(f"{key}_vs_paced" in c["policies"]["constraint_preserving"] for c in rows):
                ys = [100 * c["policies"]["constraint_preserving"][f"{key}_vs_paced"] for c in rows]
                ax.plot(xs, ys, marker="x", ls="--", color=line.get_color(), label=f"{name} vs {PACED_BASELINE}")
        what = "positive part" if reading == "end" else "mean"
        ax.set_title(f"CP vs TB, {reading} reading, {what} (K=16, W=1)")
        ax.set_xlabel("lookahead L (16 = K)")
        ax.set_ylabel(f"reduction of {what} of arch. staleness (%)")
        ax.axhline(0, color="grey", lw=0.5)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--workload", action="append", default=None, help="default: every bundled workload")
    args = parser.parse_args()
    workloads = [load_workload(n) for n in (args.workload or bundled_workloads())]
    ks, ws, ls = [4, 8, 16], [1, 2], [0, 1, 2, "K"]
    total = args.steps * len(workloads) * len(ks) * len(ws) * len(ls) * (len(POLICIES) + 1) * args.seeds
    bar = ProgressBar(total)
    results = run_grid(
        configurations(workloads, ks, ws, ls),
        list(POLICIES),
        seeds=args.seeds,
        steps=args.steps,
        progress=lambda done, label: bar.advance(label),
    )
    bar.close()
    configs = [r.summary() for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "seeds": args.seeds,
        "steps": args.steps,
        "ks": ks,
        "windows": ws,
        "lookaheads": ls,
        "command": "python benchmarks/sim_report/timing_sensitivity.py " + " ".join(sys.argv[1:]),
    }
    payload = {"meta": meta, "configs": configs}
    (args.out / "timing_sensitivity.json").write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    (args.out / "timing_sensitivity.md").write_text(markdown(configs))
    plot(configs, args.out / "timing_sensitivity.png")
    print(markdown([c for c in configs if c["mini_batches_per_step"] == 16 and c["window"] == 1]))
    print(f"wrote {args.out}/timing_sensitivity.{{json,md,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
