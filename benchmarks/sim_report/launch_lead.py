"""Duration-aware launches (the simulator's ``launch_lead`` prototype) against quota-share launches.

Run: ``.venv/bin/python benchmarks/sim_report/launch_lead.py [--seeds 3] [--steps 40]``.
Admission-only choices cannot lower the mean staleness (``version_aware.py``); what moves it is *when* groups are
launched. For ``skewed3``, ``code_agent_skew``, ``multimodal`` and ``balanced`` at K = 16, W = 1, L = 1 with the
live-loop timings, ``constraint_preserving`` and ``version_aware`` run with the lead scaled by 0 (quota-share
launches, the control plane's rule), 0.5, 0.75 and 1 (``knittrans.sched.timing.launch_lead``, estimated online
from finished groups). Both ``train_batch`` baselines keep quota-share launches. Records per run the mean,
positive part, p99 and max of the token-weighted and end readings, steps/h, quota violations and the change of
the token-weighted mean against ``constraint_preserving`` without a lead; writes
``results/launch_lead.{json,md}``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import report

from knittrans.sim.engine import simulate
from knittrans.sim.metrics import compute_metrics
from knittrans.sim.workload import Workload, load_workload

HERE = Path(__file__).parent
WORKLOADS = ("skewed3", "code_agent_skew", "multimodal", "balanced")
SCALES = (0.0, 0.5, 0.75, 1.0)


def figures(w: Workload, policy: str, seeds: int) -> dict[str, float]:
    ms = [compute_metrics(simulate(w, policy, seed=s)) for s in range(seeds)]
    out: dict[str, float] = {
        "steps_per_h": statistics.fmean(m.steps_per_hour for m in ms),
        "violations": float(sum(m.quota_violations for m in ms)),
    }
    for r in ("start", "end", "weighted"):
        for key in ("mean", "pos_mean", "p99", "max"):
            out[f"{r}_{key}"] = statistics.fmean(getattr(m.readings[r].architectural, key) for m in ms)
    return out


def main() -> int:
    args = report.parser(__doc__).parse_args()
    rows: list[dict[str, Any]] = []
    for name in WORKLOADS:
        w = load_workload(name).with_overrides(mini_batches_per_step=16, window=1, lookahead=1, steps=args.steps)
        base = {
            "train_batch": figures(w, "train_batch", args.seeds),
            "train_batch_paced": figures(
                w.with_overrides(train_batch_handover="mini_batch"), "train_batch", args.seeds
            ),
        }
        ref: dict[str, float] | None = None
        for scale in SCALES:
            for policy in ("constraint_preserving", "version_aware"):
                fig = figures(w.with_overrides(launch_lead=scale), policy, args.seeds)
                if ref is None:
                    ref = fig
                row = {"workload": name, "lead": scale, "policy": policy, **fig}
                row["weighted_mean_change_vs_cp"] = 1.0 - fig["weighted_mean"] / ref["weighted_mean"]
                for label, b in base.items():
                    row[f"vs_{label}"] = {
                        "start_mean": 1.0 - fig["start_mean"] / b["start_mean"],
                        "end_pos": 1.0 - fig["end_pos_mean"] / b["end_pos_mean"],
                        "weighted_mean": 1.0 - fig["weighted_mean"] / b["weighted_mean"],
                        "steps_ratio": fig["steps_per_h"] / b["steps_per_h"],
                    }
                rows.append(row)
                print(f"[launch_lead] {name} lead {scale} {policy}", file=sys.stderr)
    lines = [
        "| workload | lead | policy | wtd mean (vs CP, no lead) | wtd p99 / max | end pos. part | end p99 / max "
        "| steps/h | vs TB s / e+ / w, x | vs paced s / e+ / w, x | viol. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tb, tp = r["vs_train_batch"], r["vs_train_batch_paced"]
        lines.append(
            f"| {r['workload']} | {r['lead']:g} | {r['policy']} "
            f"| {r['weighted_mean']:.2f} ({-100 * r['weighted_mean_change_vs_cp']:+.1f}%) "
            f"| {r['weighted_p99']:.1f} / {r['weighted_max']:.1f} | {r['end_pos_mean']:.2f} "
            f"| {r['end_p99']:.1f} / {r['end_max']:.1f} | {r['steps_per_h']:.1f} "
            f"| {100 * tb['start_mean']:.0f}% / {100 * tb['end_pos']:.0f}% / {100 * tb['weighted_mean']:.0f}%, "
            f"{tb['steps_ratio']:.2f}x "
            f"| {100 * tp['start_mean']:.0f}% / {100 * tp['end_pos']:.0f}% / {100 * tp['weighted_mean']:.0f}%, "
            f"{tp['steps_ratio']:.2f}x | {int(r['violations'])} |"
        )
    md = "\n".join(lines) + "\n"
    meta = {"seeds": args.seeds, "steps": args.steps, "K": 16, "W": 1, "L": 1}
    report.write(args.out, "launch_lead", md, meta, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
