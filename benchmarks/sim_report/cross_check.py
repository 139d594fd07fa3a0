"""Cross-check: ``knittrans sim`` against the independent simulator (``independent_sim.py``) on the headline figures.

Run: ``.venv/bin/python benchmarks/sim_report/cross_check.py [--seeds 3] [--steps 40]``.
For ``skewed3``, ``balanced`` and ``code_agent_skew`` at K = 16, W = 1, L in {0, 1}, with the workloads' live-loop
timings (publish delay before the ack, blocking loads, in-flight updates), and both ``train_batch`` baselines
(``step``: handed whole train batches; ``mini_batch``: paced by the project's window rule), it prints and
writes ``results/cross_check.{json,md}``: the constraint_preserving-vs-train_batch reduction of mean
architectural staleness (start, token-weighted), of the end reading's positive part, and the steps/h ratio,
from both simulators. The two share no code and no random draws.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from knittrans.sim.engine import simulate
from knittrans.sim.metrics import compute_metrics
from knittrans.sim.workload import load_workload

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import independent_sim  # noqa: E402
import report  # noqa: E402

FIGURES = ("start_mean", "end_pos", "weighted_mean")


def project(name: str, lookahead: int, handover: str, *, seeds: int, steps: int) -> dict[str, float]:
    """Reductions and steps/h ratio from ``knittrans sim``."""
    w = load_workload(name).with_overrides(
        mini_batches_per_step=16,
        window=1,
        lookahead=lookahead,
        train_batch_handover=handover,
        steps=steps,
    )
    avg: dict[str, dict[str, float]] = {}
    for policy in ("train_batch", "constraint_preserving"):
        ms = [compute_metrics(simulate(w, policy, seed=s)) for s in range(seeds)]
        avg[policy] = {
            "start_mean": statistics.fmean(m.readings["start"].architectural.mean for m in ms),
            "end_pos": statistics.fmean(m.readings["end"].architectural.pos_mean for m in ms),
            "weighted_mean": statistics.fmean(m.readings["weighted"].architectural.mean for m in ms),
            "steps_per_h": statistics.fmean(m.steps_per_hour for m in ms),
        }
    tb, cp = avg["train_batch"], avg["constraint_preserving"]
    out = {f: 1.0 - cp[f] / tb[f] for f in FIGURES}
    out["steps_ratio"] = cp["steps_per_h"] / tb["steps_per_h"]
    return out


def independent(name: str, lookahead: int, handover: str, *, scope: str, seeds: int, steps: int) -> dict[str, float]:
    """The same figures from the independent simulator."""
    cfg = replace(
        independent_sim.load(name),
        K=16,
        W=1,
        L=lookahead,
        steps=steps,
        scope=scope,
        tb_takes="train_batch" if handover == "step" else "mini_batch",
    )
    res = independent_sim.compare(cfg, seeds)
    out = {f: res["reduction"][f] for f in FIGURES}
    out["steps_ratio"] = res["steps_ratio"]
    return out


def main() -> int:
    args = report.parser(__doc__).parse_args()
    rows: list[dict[str, Any]] = []
    for name in ("skewed3", "balanced", "code_agent_skew"):
        for handover in ("step", "mini_batch"):
            for lookahead in (0, 1):
                for simulator, fn in (("knittrans sim", project), ("independent", independent)):
                    extra = {"scope": "global"} if fn is independent else {}
                    rows.append(
                        {
                            "workload": name,
                            "baseline": handover,
                            "L": lookahead,
                            "simulator": simulator,
                            **fn(name, lookahead, handover, seeds=args.seeds, steps=args.steps, **extra),
                        }
                    )
    lines = [
        "| workload | train_batch baseline | L | simulator | red. mean start | red. pos. part end "
        "| red. mean weighted | steps/h x TB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['baseline']} | {r['L']} | {r['simulator']} | {100 * r['start_mean']:.1f}% "
            f"| {100 * r['end_pos']:.1f}% | {100 * r['weighted_mean']:.1f}% | {r['steps_ratio']:.2f} |"
        )
    md = "\n".join(lines) + "\n"
    report.write(args.out, "cross_check", md, {"seeds": args.seeds, "steps": args.steps, "K": 16, "W": 1}, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
