"""Sweeps over workloads, policies, K and W, aggregated over seeds, with the comparison table."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from knittrans.sched.staleness import READINGS
from knittrans.sim.engine import RunTrace, simulate
from knittrans.sim.metrics import RunMetrics, compute_metrics
from knittrans.sim.workload import Workload

__all__ = [
    "BASELINE",
    "COLOCATED",
    "LEGEND",
    "PACED_BASELINE",
    "ConfigResult",
    "configurations",
    "format_table",
    "run_grid",
]

BASELINE = "train_batch"
"""The policy the other policies are compared with (with the workload's ``train_batch_handover``, default ``step``:
a conventional trainer handed whole train batches)."""
PACED_BASELINE = "train_batch_paced"
"""Row label of ``train_batch`` with ``train_batch_handover: mini_batch``: the project's window rule applied to
the baseline too (groups leave the window when their own mini-batch starts)."""
COLOCATED = "colocated"
"""Row label of the colocated reference mode."""


_SETTINGS = (
    "mini_batches_per_step",
    "window",
    "lookahead",
    "publish_delay_s",
    "sync_delay_s",
    "load_s",
    "groups_per_call",
    "in_flight_updates",
    "launch_weights",
)
"""Workload fields every summary repeats."""
_STATS = ("mean", "p50", "p99", "max", "pos_mean")
_RUN_FIGURES = (
    "steps_per_hour",
    "trajectories_per_hour",
    "trainer_idle",
    "rollout_idle",
    "mean_wait_s",
    "mean_generation_s",
)


def _figures(m: RunMetrics) -> dict[str, float]:
    """One run's figures by summary key: ``{reading}_{stat}`` and ``{reading}_arch_{stat}``, then the run figures."""
    out = {}
    for r in READINGS:
        for kind, stats in (("", m.readings[r].staleness), ("arch_", m.readings[r].architectural)):
            for key in _STATS:
                out[f"{r}_{kind}{key}"] = float(getattr(stats, key))
    for key in _RUN_FIGURES:
        out[key] = float(getattr(m, key))
    return out


@dataclass
class ConfigResult:
    """All runs of one (workload, K, W) configuration: per policy, per seed; seed-0 traces kept for plots."""

    workload: Workload
    runs: dict[str, list[RunMetrics]] = field(default_factory=dict)
    traces: dict[str, RunTrace] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Seed-averaged figures per policy, and reductions ``1 - policy / baseline`` of the architectural
        staleness against both baselines (NaN without the baseline or when it is 0; JSON-ready)."""
        figures = {policy: [_figures(m) for m in runs] for policy, runs in self.runs.items()}
        means = {policy: {key: statistics.fmean(f[key] for f in fs) for key in fs[0]} for policy, fs in figures.items()}

        def reduction(policy: str, key: str, baseline: str) -> float:
            if baseline not in means:
                return math.nan
            base = means[baseline][key]
            return math.nan if base == 0 else 1.0 - means[policy][key] / base

        w = self.workload
        out: dict[str, Any] = {"workload": w.name, **{key: getattr(w, key) for key in _SETTINGS}, "policies": {}}
        for policy, mine in means.items():
            row: dict[str, Any] = {"seeds": len(self.runs[policy])}
            for r in READINGS:
                row.update((f"{r}_{kind}{key}", mine[f"{r}_{kind}{key}"]) for kind in ("", "arch_") for key in _STATS)
                for baseline, suffix in ((BASELINE, ""), (PACED_BASELINE, "_vs_paced")):
                    row[f"{r}_arch_reduction{suffix}"] = reduction(policy, f"{r}_arch_mean", baseline)
                    row[f"{r}_arch_pos_reduction{suffix}"] = reduction(policy, f"{r}_arch_pos_mean", baseline)
            for baseline, key in (
                (PACED_BASELINE, "steps_per_hour_vs_paced"),
                (BASELINE, "steps_per_hour_vs_train_batch"),
            ):
                if baseline in means:
                    row[key] = mine["steps_per_hour"] / means[baseline]["steps_per_hour"]
            row.update((key, mine[key]) for key in _RUN_FIGURES)
            row["quota_violations"] = sum(m.quota_violations for m in self.runs[policy])
            out["policies"][policy] = row
        return out


def configurations(
    workloads: Iterable[Workload],
    mini_batches: Iterable[int | None],
    windows: Iterable[int | None],
    lookaheads: Iterable[int | str | None],
) -> list[Workload]:
    """Every workload under every ``K``, ``W`` and ``L`` (None: the workload's own; ``"K"``: ``L = K``).

    Raises:
        ValueError: a combination the workload refuses.
    """
    out = []
    for base, k, win, look in itertools.product(workloads, mini_batches, windows, lookaheads):
        changes: dict[str, Any] = {}
        if k is not None:
            changes["mini_batches_per_step"] = k
        if win is not None:
            changes["window"] = win
        if look is not None:
            changes["lookahead"] = (k or base.mini_batches_per_step) if look == "K" else look
        out.append(base.with_overrides(**changes) if changes else base)
    return out


def run_grid(
    configs: Sequence[Workload],
    policies: Sequence[str],
    *,
    seeds: int,
    steps: int | None,
    colocated: bool = False,
    progress: Callable[[int, str], None] | None = None,
) -> list[ConfigResult]:
    """Run every policy, the paced baseline and optionally the colocated reference for every configuration
    (workload, as :func:`configurations` makes them) and seed.

    The paced baseline is ``train_batch`` with ``train_batch_handover: mini_batch``, row :data:`PACED_BASELINE`;
    summaries give every policy's reductions against both ``train_batch`` baselines (``*_reduction`` against the
    workload's handover, by default the whole step; ``*_vs_paced`` against the paced one).

    ``progress(steps_done_in_this_run, label)`` is called after each simulated step.
    """
    results: list[ConfigResult] = []
    for workload in configs:
        config = ConfigResult(workload=workload)
        modes = [(p, p, workload, False) for p in policies]  # (label, policy, workload, colocated)
        if colocated:
            modes.append((COLOCATED, BASELINE, workload, True))
        modes.append((PACED_BASELINE, BASELINE, workload.with_overrides(train_batch_handover="mini_batch"), False))
        for label, policy, run_workload, is_coloc in modes:
            for seed in range(seeds):
                tag = (
                    f"{workload.name} K={workload.mini_batches_per_step} W={workload.window} "
                    f"L={workload.lookahead} {label} s{seed}"
                )
                cb = None if progress is None else (lambda done, tag=tag: progress(done, tag))
                trace = simulate(run_workload, policy, seed=seed, steps=steps, colocated=is_coloc, on_step=cb)
                config.runs.setdefault(label, []).append(compute_metrics(trace))
                if seed == 0:
                    config.traces[label] = trace
        results.append(config)
    return results


_TABLE_REDUCTIONS = ("start_arch_reduction", "end_arch_pos_reduction", "weighted_arch_reduction")


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
            vs_tb, vs_paced = (
                " ".join(_pct(row[f"{key}{suffix}"]) for key in _TABLE_REDUCTIONS) for suffix in ("", "_vs_paced")
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
