"""Sweeps over workloads, policies, K and W, aggregated over seeds, with the comparison table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from knittrans.sim.engine import RunTrace, simulate
from knittrans.sim.metrics import READINGS, RunMetrics, compute_metrics
from knittrans.sim.workload import Workload

__all__ = ["BASELINE", "COLOCATED", "LEGEND", "PACED_BASELINE", "ConfigResult", "format_table", "run_grid"]

BASELINE = "train_batch"
"""The policy the other policies are compared with (with the workload's ``train_batch_handover``, default ``step``:
a conventional trainer handed whole train batches)."""
PACED_BASELINE = "train_batch_paced"
"""Row label of ``train_batch`` with ``train_batch_handover: mini_batch``: the project's window rule applied to
the baseline too (groups leave the window when their own mini-batch starts)."""
COLOCATED = "colocated"
"""Row label of the colocated reference mode."""


@dataclass
class ConfigResult:
    """All runs of one (workload, K, W) configuration: per policy, per seed; seed-0 traces kept for plots."""

    workload: Workload
    runs: dict[str, list[RunMetrics]] = field(default_factory=dict)
    traces: dict[str, RunTrace] = field(default_factory=dict)

    def mean(self, policy: str, getter: Callable[[RunMetrics], float]) -> float:
        """Mean over seeds of one figure of one policy."""
        return statistics.fmean(getter(m) for m in self.runs[policy])

    def reduction(self, policy: str, getter: Callable[[RunMetrics], float], baseline: str = BASELINE) -> float:
        """Relative reduction ``1 - policy / baseline`` of a seed-averaged figure (NaN without a baseline)."""
        if baseline not in self.runs or policy not in self.runs:
            return math.nan
        base = self.mean(baseline, getter)
        if base == 0:
            return math.nan
        return 1.0 - self.mean(policy, getter) / base

    def summary(self) -> dict[str, Any]:
        """Seed-averaged figures and reductions per policy (JSON-ready)."""
        out: dict[str, Any] = {
            "workload": self.workload.name,
            "mini_batches_per_step": self.workload.mini_batches_per_step,
            "window": self.workload.window,
            "lookahead": self.workload.lookahead,
            "publish_delay_s": self.workload.publish_delay_s,
            "sync_delay_s": self.workload.sync_delay_s,
            "load_s": self.workload.load_s,
            "groups_per_call": self.workload.groups_per_call,
            "in_flight_updates": self.workload.in_flight_updates,
            "launch_weights": self.workload.launch_weights,
            "policies": {},
        }
        for policy in self.runs:
            row: dict[str, Any] = {"seeds": len(self.runs[policy])}
            for r in READINGS:
                for kind, stat in (("", "staleness"), ("arch_", "architectural")):
                    for key in ("mean", "p50", "p99", "max", "pos_mean"):
                        row[f"{r}_{kind}{key}"] = self.mean(policy, _stat_getter(r, stat, key))
                row[f"{r}_arch_reduction"] = self.reduction(policy, _stat_getter(r, "architectural", "mean"))
                row[f"{r}_arch_pos_reduction"] = self.reduction(policy, _stat_getter(r, "architectural", "pos_mean"))
                if PACED_BASELINE in self.runs:
                    row[f"{r}_arch_reduction_vs_paced"] = self.reduction(
                        policy, _stat_getter(r, "architectural", "mean"), PACED_BASELINE
                    )
                    row[f"{r}_arch_pos_reduction_vs_paced"] = self.reduction(
                        policy, _stat_getter(r, "architectural", "pos_mean"), PACED_BASELINE
                    )
            if PACED_BASELINE in self.runs:
                row["steps_per_hour_vs_paced"] = self.mean(policy, _run_getter("steps_per_hour")) / self.mean(
                    PACED_BASELINE, _run_getter("steps_per_hour")
                )
            if BASELINE in self.runs:
                row["steps_per_hour_vs_train_batch"] = self.mean(policy, _run_getter("steps_per_hour")) / self.mean(
                    BASELINE, _run_getter("steps_per_hour")
                )
            for key in (
                "steps_per_hour",
                "trajectories_per_hour",
                "trainer_idle",
                "rollout_idle",
                "mean_wait_s",
                "mean_generation_s",
            ):
                row[key] = self.mean(policy, _run_getter(key))
            row["quota_violations"] = sum(m.quota_violations for m in self.runs[policy])
            out["policies"][policy] = row
        return out


def _stat_getter(reading: str, stat: str, key: str) -> Callable[[RunMetrics], float]:
    def get(m: RunMetrics) -> float:
        return float(getattr(getattr(m.readings[reading], stat), key))

    return get


def _run_getter(key: str) -> Callable[[RunMetrics], float]:
    def get(m: RunMetrics) -> float:
        return float(getattr(m, key))

    return get


def run_grid(
    workloads: Sequence[Workload],
    policies: Sequence[str],
    *,
    seeds: int,
    steps: int | None,
    mini_batches: Iterable[int | None] = (None,),
    windows: Iterable[int | None] = (None,),
    lookaheads: Iterable[int | str | None] = (None,),
    colocated: bool = False,
    paced_baseline: bool = True,
    progress: Callable[[int, str], None] | None = None,
) -> list[ConfigResult]:
    """Run every policy, the paced baseline and optionally the colocated reference for every configuration and
    seed.

    ``paced_baseline`` adds ``train_batch`` with ``train_batch_handover: mini_batch`` as row
    :data:`PACED_BASELINE`; summaries then give every policy's reductions against both ``train_batch`` baselines
    (``*_reduction`` against the workload's handover, by default the whole step; ``*_vs_paced`` against it).

    ``lookaheads`` may hold ``"K"``: the lookahead equal to the configuration's ``K`` (one train batch).
    ``progress(steps_done_in_this_run, label)`` is called after each simulated step.
    """
    results: list[ConfigResult] = []
    mbs, wins, looks = list(mini_batches), list(windows), list(lookaheads)
    for base, k, win, look in ((b, k, w, la) for b in workloads for k in mbs for w in wins for la in looks):
        changes: dict[str, Any] = {}
        if k is not None:
            changes["mini_batches_per_step"] = k
        if win is not None:
            changes["window"] = win
        if look is not None:
            changes["lookahead"] = (k or base.mini_batches_per_step) if look == "K" else look
        workload = base.with_overrides(**changes) if changes else base
        config = ConfigResult(workload=workload)
        modes = [(p, False) for p in policies] + ([(COLOCATED, True)] if colocated else [])
        if paced_baseline:
            modes.append((PACED_BASELINE, False))
        for label, is_coloc in modes:
            policy = BASELINE if is_coloc or label == PACED_BASELINE else label
            run_workload = (
                workload.with_overrides(train_batch_handover="mini_batch") if label == PACED_BASELINE else workload
            )
            for seed in range(seeds):
                tag = (
                    f"{workload.name} K={workload.mini_batches_per_step} W={workload.window} "
                    f"L={workload.lookahead} {label} s{seed}"
                )
                cb = None if progress is None else (lambda done, tag=tag: progress(done, tag))
                trace = simulate(run_workload, policy, seed=seed, steps=steps, colocated=is_coloc, on_step=cb)
                metrics = compute_metrics(trace)
                config.runs.setdefault(label, []).append(metrics)
                if seed == 0:
                    config.traces[label] = trace
        results.append(config)
    return results


def _pct(x: float) -> str:
    return "   -  " if math.isnan(x) else f"{100 * x:5.1f}%"


LEGEND = (
    "arch s/e/w: mean architectural staleness (versions) under the start/end/weighted readings. Reductions at the "
    f"same K, W and L against both baselines: '{BASELINE}' (handed whole train batches) and '{PACED_BASELINE}' (each "
    "group leaves the window when its mini-batch starts, as the control plane runs it): s = mean start, e+ = "
    "positive part of the end reading, w = mean weighted. p99/max e: end-reading tails. steps/h x: ratio to each "
    f"baseline. '{COLOCATED}' is the colocated reference."
)
"""What the columns of :func:`format_table` mean."""


def format_table(results: Sequence[ConfigResult]) -> str:
    """Plain-text comparison table: architectural staleness per reading, reductions against both baselines,
    tails, idle time and throughput."""
    head = (
        f"{'workload':<16} {'K':>3} {'W':>2} {'L':>2} {'policy':<22} {'arch s/e/w':>17} "
        f"{'vs TB s / e+ / w':>21} {'vs paced s / e+ / w':>21} {'p99/max e':>11} {'tr idle':>7} {'ro idle':>7} "
        f"{'steps/h':>7} {'x TB/paced':>11} {'viol':>4}"
    )
    lines = [head, "-" * len(head)]
    for config in results:
        s = config.summary()
        for policy, row in s["policies"].items():
            arch = "/".join(f"{row[f'{r}_arch_mean']:.2f}" for r in READINGS)
            vs_tb = " ".join(
                _pct(row.get(key, math.nan))
                for key in ("start_arch_reduction", "end_arch_pos_reduction", "weighted_arch_reduction")
            )
            vs_paced = " ".join(
                _pct(row.get(key, math.nan))
                for key in (
                    "start_arch_reduction_vs_paced",
                    "end_arch_pos_reduction_vs_paced",
                    "weighted_arch_reduction_vs_paced",
                )
            )
            ratios = "/".join(
                "-" if math.isnan(x) else f"{x:.2f}"
                for x in (
                    row.get("steps_per_hour_vs_train_batch", math.nan),
                    row.get("steps_per_hour_vs_paced", math.nan),
                )
            )
            lines.append(
                f"{s['workload']:<16} {s['mini_batches_per_step']:>3} {s['window']:>2} {s['lookahead']:>2} "
                f"{policy:<22} {arch:>17} {vs_tb:>21} {vs_paced:>21} "
                f"{row['end_arch_p99']:5.1f}/{row['end_arch_max']:5.1f} {100 * row['trainer_idle']:6.1f}% "
                f"{100 * row['rollout_idle']:6.1f}% {row['steps_per_hour']:7.1f} {ratios:>11} "
                f"{row['quota_violations']:>4}"
            )
        lines.append("")
    return "\n".join(lines)
