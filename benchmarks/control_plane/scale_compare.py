"""Before/after table and plot of two ``scale.py`` results (same machine, same session).

Run: ``python benchmarks/control_plane/scale_compare.py BEFORE.json AFTER.json --out results/scale_compare``
(writes ``.md`` and ``.png``: server RSS and ``/status`` latency over mini-batches, delivery figures).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _get(result: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


ROWS = [
    ("plan delivery p50 (ms)", ("delivery", "plan_delivery_ms", "p50")),
    ("plan delivery p99 (ms)", ("delivery", "plan_delivery_ms", "p99")),
    ("plan age at delivery p50 (ms)", ("delivery", "plan_age_ms", "p50")),
    ("registration request p99 (ms)", ("delivery", "registration_request_ms", "p99")),
    ("mini-batches consumed by every rank", ("delivery", "mini_batches_consumed")),
    ("server CPU per mini-batch, 1,024 ranks (ms)", ("delivery", "server_cpu_ms_per_mini_batch")),
    ("registration, batches of 500 (units/s)", ("registration", "units_per_s_median")),
    ("long job: server CPU per mini-batch (ms)", ("memory", "server_cpu_ms_per_mini_batch")),
    ("long job: RSS at 1,000 (MiB)", ("memory", "rss_mib_at_1000")),
    ("long job: RSS at end (MiB)", ("memory", "rss_mib_at_end")),
    ("long job: RSS growth 1,000 -> end", ("memory", "rss_growth")),
    ("long job: /status at 1,000 (ms)", ("memory", "status_ms_at_1000")),
    ("long job: /status at end (ms)", ("memory", "status_ms_at_end")),
    ("long job: /status bytes at end", ("memory", "status_bytes_at_end")),
]


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1 else f"{value:,.1f}"
    return f"{value:,}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    lines = [
        "# Control plane at scale: before / after\n",
        f"{after['machine']}, {after['cpus']} CPUs. Before: server {before['server']}, load "
        f"{before['load_avg_1m_start']:.1f} at start. After: server {after['server']} (commit "
        f"{after['commit']}), load {after['load_avg_1m_start']:.1f} at start. Arguments: "
        f"`{' '.join(f'{k}={v}' for k, v in after['args'].items() if k not in ('out', 'server_source'))}`\n",
        "| figure | before | after | after / before |",
        "|---|---|---|---|",
    ]
    for name, path in ROWS:
        b, a = _get(before, *path), _get(after, *path)
        ratio = f"{a / b:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and b else "–"
        lines.append(f"| {name} | {_fmt(b)} | {_fmt(a)} | {ratio} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    for label, result in (("before", before), ("after", after)):
        samples = _get(result, "memory", "samples") or []
        xs = [s["mini_batch"] for s in samples]
        ax[0].plot(xs, [s["rss_mib"] for s in samples], marker=".", label=label)
        ax[1].plot(xs, [s["status_ms"] for s in samples], marker=".", label=label)
    ax[0].set(xlabel="mini-batches consumed", ylabel="server RSS (MiB)", title="memory over the long job")
    ax[1].set(xlabel="mini-batches consumed", ylabel="GET /status (ms)", title="/status vs job length")
    names = ["p50", "p99"]
    for i, (label, result) in enumerate((("before", before), ("after", after))):
        vals = [_get(result, "delivery", "plan_delivery_ms", q) or 0.0 for q in names]
        ax[2].bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4, label=label)
    ax[2].set_xticks([0.2, 1.2], names)
    ax[2].set(ylabel="ms", title="plan delivery after admission, 1,024 ranks")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
