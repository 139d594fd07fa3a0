"""Markdown table and PNG chart of a vs_baselines summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.vs_baselines.aggregate import METRICS

__all__ = ["write_markdown", "write_png"]

REFERENCE_ORDER = ("tq_kv", "tq_sampler", "ray_group", "ray_shard", "knittrans_flight")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _reference(rows: list[dict[str, Any]]) -> str:
    present = {r["system"] for r in rows}
    return next((s for s in REFERENCE_ORDER if s in present), rows[0]["system"])


def _load(values: Any) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "?"


def _rounds(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Fetch p50 of every system in every round: how much of a median ratio each round shares."""
    reps = int(meta["reps"])
    loads = list(meta.get("loadavg_rounds") or [])
    heads = [
        f"round {i + 1}" + (f" (load {loads[i][0]:.1f})" if i < len(loads) and loads[i] else "") for i in range(reps)
    ]
    lines = [
        "## Fetch p50 per round (ms)",
        "",
        "| workload | compute | system | " + " | ".join(heads) + " |",
        "|---" * (3 + reps) + "|",
    ]
    for r in rows:
        values = list(r.get("fetch_p50_ms_by_rep") or [])
        cells = [_fmt(values[i]) if i < len(values) else "–" for i in range(reps)]
        lines.append(
            f"| {r['kind']} | {'on' if r['mode'] == 'compute' else 'off'} | {r['system']} | " + " | ".join(cells) + " |"
        )
    return [*lines, ""]


def write_markdown(summary: dict[str, Any], meta: dict[str, Any], path: Path) -> str:
    """Write (and return) one table per workload/mode with ratios to the reference system."""
    rows = summary["rows"]
    ref = _reference(rows)
    lines = [
        f"# vs_baselines ({'smoke' if meta['smoke'] else 'full'}; {meta['reps']} rep(s); "
        f"{meta['cpus']} CPUs; {meta['time']})",
        "",
        f"Medians over repetitions. `×ref` = system's value / {ref}'s (same run).  "
        f"Correctness: every row's digest equals the generator's; cross-system micro-batch digests "
        f"agree: {summary['cross_system_digests_agree']} "
        f"({summary['cross_system_microbatches_compared']} (workload, rank, micro-batch) slots of systems "
        f"following the canonical plan); every row's digest agrees across all systems: "
        f"{summary.get('cross_system_rows_agree')} ({summary.get('cross_system_rows_compared')} rows).",
        "",
    ]
    if "commit" in meta:
        lines += [
            f"Machine: {meta.get('host')} ({meta.get('cpu_model')}, {meta.get('platform')}); commit "
            f"{meta['commit']}; load average (1/5/15 min) at start {_load(meta.get('loadavg_start'))}, "
            f"at end {_load(meta.get('loadavg_end'))}.",
            "",
        ]
    if meta.get("interleaved"):
        lines += [
            f"Repetitions interleaved: {meta['reps']} rounds, every system once per round (one driver "
            f"each); load average at the start of each round: "
            f"{', '.join(_load(v) for v in meta.get('loadavg_rounds') or [])}.",
            "",
        ]
    cols = [
        "put_s",
        "fetch_p50_ms",
        "fetch_p99_ms",
        "load_p50_ms",
        "exposed_mean_ms",
        "minibatch_s",
        "consumer_cpu_s",
        "startup_s",
        "peak_total_mib",
        "storage_bytes_per_stored_byte",
    ]
    for kind in sorted({r["kind"] for r in rows}):
        for mode in sorted({r["mode"] for r in rows if r["kind"] == kind}):
            sel = [r for r in rows if (r["kind"], r["mode"]) == (kind, mode)]
            base = next((r for r in sel if r["system"] == ref), None)
            lines += [
                f"## {kind}, compute={'on' if mode == 'compute' else 'off'}",
                "",
                "| system | " + " | ".join(METRICS[c] for c in cols) + " | MiB received | correct |",
                "|---" * (len(cols) + 3) + "|",
            ]
            for r in sel:
                cells = []
                for c in cols:
                    cell = _fmt(r.get(c))
                    if base is not None and r is not base and r.get(c) and base.get(c):
                        cell += f" ({r[c] / base[c]:.2g}×ref)"
                    cells.append(cell)
                ok = "yes" if r["correct"] else "**NO**"
                lines.append(
                    f"| {r['system']} | " + " | ".join(cells) + f" | {r['bytes_received'] / 2**20:.1f} | {ok} |"
                )
            lines.append("")
    if meta.get("interleaved") and meta["reps"] > 1:
        lines += _rounds(rows, meta)
    cold = summary.get("cold", [])
    if cold:
        lines += [
            "## Warm-up mini-batches (unrecorded above; compute=off runs first, so its warm-up is cold)",
            "",
            "| system | workload | compute | fetch p50 (ms) | fetch p99 (ms) |",
            "|---" * 5 + "|",
        ]
        lines += [
            f"| {c['system']} | {c['kind']} | {'on' if c['mode'] == 'compute' else 'off'} | "
            f"{_fmt(c['p50_ms'])} | {_fmt(c['p99_ms'])} |"
            for c in cold
        ]
        lines.append("")
    targets = summary.get("targets", [])
    if targets:
        lines += [
            "## Targets (KnitTrans vs baseline, same run; ratio = baseline / KnitTrans)",
            "",
            "| target | system | vs | KnitTrans | baseline | ratio | needed | met |",
            "|---" * 8 + "|",
        ]
        for t in targets:
            lines.append(
                f"| {t['target']} | {t['system']} | {t['baseline']} | {_fmt(t['system_value'])} | "
                f"{_fmt(t['baseline_value'])} | {t['ratio']:.3g} | {t['required']:g} | "
                f"{'yes' if t['met'] else '**no**'} |"
            )
        lines.append("")
    floors = {(r["kind"], r["mode"]): r["minibatch_s"] for r in rows if r["system"] == "local_memory"}
    bounds = [
        (r["kind"], r["mode"], r["minibatch_s"], floors[(r["kind"], r["mode"])])
        for r in rows
        if r["system"] == "tq_kv" and r["mode"] == "compute" and (r["kind"], r["mode"]) in floors
    ]
    if bounds:
        lines += [
            "Host bound on transfer+train: `local_memory` has no transfer at all (the micro-batches are in "
            "each rank's memory before the run), so no system can be more than tq_kv / local_memory times "
            "faster than tq_kv here:",
            "",
        ]
        lines += [
            f"* {kind} (compute): tq_kv {tq:.3g} s / local_memory {floor:.3g} s = **{tq / floor:.2f}×** at most"
            for kind, mode, tq, floor in bounds
        ]
        lines.append("")
    lines += ["Peak RSS by role (MiB, whole run, summed over processes of the role):", ""]
    for r in rows:
        if r["mode"] == "none":
            roles = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["peak_by_role_mib"].items()))
            lines.append(f"* {r['system']} / {r['kind']}: {roles}")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_png(summary: dict[str, Any], path: Path) -> None:
    """Grouped log-scale bars: fetch p50, exposed time, transfer+train and put, per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    kinds = sorted({r["kind"] for r in rows})
    panels = [("fetch_p50_ms", "none"), ("exposed_mean_ms", "compute"), ("minibatch_s", "compute"), ("put_s", "none")]
    fig, axes = plt.subplots(len(kinds), len(panels), figsize=(4 * len(panels), 3.2 * len(kinds)), squeeze=False)
    for i, kind in enumerate(kinds):
        for j, (metric, mode) in enumerate(panels):
            ax = axes[i][j]
            sel = [r for r in rows if r["kind"] == kind and r["mode"] == mode]
            ax.bar([r["system"] for r in sel], [max(r[metric], 1e-6) for r in sel], color="C0")
            ax.set_yscale("log")
            ax.set_title(f"{kind}: {METRICS[metric]}", fontsize=9)
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
