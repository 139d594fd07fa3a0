"""PNG plots of one configuration (matplotlib, Agg backend): staleness, quotas and admission timing."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from knittrans.sched.staleness import READINGS, architectural_staleness, version_of
from knittrans.sim.engine import RunTrace
from knittrans.sim.metrics import RunMetrics

__all__ = ["write_plots"]


def _save(fig: Figure, path: Path, title: str | None) -> None:
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _staleness_per_step(metrics: Mapping[str, RunMetrics], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, len(READINGS), figsize=(15, 4), sharey=True)
    for ax, reading in zip(axes, READINGS, strict=True):
        for policy, m in metrics.items():
            steps = [s.step for s in m.per_step]
            ax.plot(steps, [s.readings[reading].architectural.mean for s in m.per_step], label=policy, lw=1.3)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_title(f"architectural staleness, '{reading}' reading")
        ax.set_xlabel("train step")
    axes[0].set_ylabel("mean over the step's groups (versions)")
    axes[0].legend(fontsize=8)
    _save(fig, path, title)


def _by_mini_batch_index(traces: Mapping[str, RunTrace], warmup: int, path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, len(READINGS), figsize=(15, 4), sharey=True)
    for ax, reading in zip(axes, READINGS, strict=True):
        for policy, trace in traces.items():
            K = trace.workload.mini_batches_per_step
            sums, counts = np.zeros(K), np.zeros(K)
            for c in trace.consumed:
                if c.step >= warmup:
                    k = c.mini_batch_index
                    sums[k] += architectural_staleness(c.v_train, version_of(c, reading), k)
                    counts[k] += 1
            ax.plot(np.arange(K), sums / np.maximum(counts, 1), marker="o", ms=3, label=policy)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_title(f"'{reading}' reading")
        ax.set_xlabel("mini-batch index k within the step")
    axes[0].set_ylabel("mean architectural staleness (versions)")
    axes[0].legend(fontsize=8)
    _save(fig, path, title)


def _cumulative_quotas(traces: Mapping[str, RunTrace], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), sharey=True, squeeze=False)
    for ax, (policy, trace) in zip(axes[0], traces.items(), strict=True):
        w = trace.workload
        K = w.mini_batches_per_step
        x = np.arange(1, K + 1)
        for j, src in enumerate(w.sources):
            cum = np.zeros(K)
            for s in range(trace.steps):
                mbs = trace.mini_batches[s * K : (s + 1) * K]
                cum += np.cumsum([m.counts[src.name] for m in mbs])
            color = f"C{j}"
            ax.plot(x, cum / max(trace.steps, 1), marker="o", ms=3, color=color, label=f"{src.name} admitted")
            ax.plot(x, x * src.quota / K, ls="--", color=color, lw=0.9, label=f"{src.name} linear target")
        ax.set_title(policy)
        ax.set_xlabel("mini-batches admitted in the step")
    axes[0][0].set_ylabel("cumulative groups per source (mean over steps)")
    axes[0][0].legend(fontsize=7)
    _save(fig, path, title)


def _admission_timeline(traces: Mapping[str, RunTrace], path: Path, title: str, max_steps: int = 6) -> None:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (policy, trace) in enumerate(traces.items()):
        K = trace.workload.mini_batches_per_step
        mbs = trace.mini_batches[: max_steps * K]
        ax.step([m.admitted_at / 60 for m in mbs], [m.n for m in mbs], where="post", color=f"C{i}", label=policy)
        ax.plot([m.admitted_at / 60 for m in mbs], [m.n for m in mbs], "o", ms=2.5, color=f"C{i}")
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("mini-batch number n (admitted)")
    ax.set_title(f"{title}: admission time of each mini-batch (first {max_steps} steps)")
    ax.legend(fontsize=8)
    _save(fig, path, None)


def write_plots(
    metrics: Mapping[str, RunMetrics], traces: Mapping[str, RunTrace], out_dir: Path, prefix: str
) -> list[Path]:
    """Write the four plots of one configuration (one run per policy) as ``{prefix}_*.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(traces.values()))
    w = first.workload
    title = (
        f"{w.name}, K={w.mini_batches_per_step}, W={w.window}, publish {w.publish_delay_s:g}s, "
        f"sync {w.sync_delay_s:g}s, load {w.load_s:g}s"
    )
    warmup = next(iter(metrics.values())).warmup_steps
    paths = [
        out_dir / f"{prefix}_{name}.png"
        for name in ("staleness_per_step", "arch_by_index", "cumulative_quotas", "admission_timeline")
    ]
    _staleness_per_step(metrics, paths[0], title)
    _by_mini_batch_index(traces, warmup, paths[1], title)
    _cumulative_quotas(traces, paths[2], title)
    _admission_timeline(traces, paths[3], title)
    return paths
