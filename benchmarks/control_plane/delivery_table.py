"""Table of ``scale.py --phases delivery`` runs: medians per configuration, every run listed.

Run: ``python benchmarks/control_plane/delivery_table.py results/delivery_*.json --out results/delivery_1024.md``.
A configuration is the server (its label), ``--rows-per-rank`` and ``--ack-mode``; each figure is the
median over its runs (runs of one session, interleaved, so load is comparable), with the load
average at the start of each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _key(result: dict[str, Any]) -> tuple[str, int, str]:
    d = result["delivery"]
    server = result["server"]
    if server.startswith("worktree"):  # the checkout's own server: name its commit
        server = f"{server} @ {result['commit']}"
    return server, int(d["rows_per_rank"]), str(d["ack_mode"])


def _fmt(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _registered(d: dict[str, Any]) -> float:
    """Groups the writer registered per second (it waits for each request: a slow server slows it)."""
    if "groups_registered_per_s" in d:
        return float(d["groups_registered_per_s"])
    return d["registration_request_ms"]["count"] * max(1, int(d["rate_groups_s"]) // 10) / float(d["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [(path, json.loads(path.read_text())) for path in sorted(args.results)]
    groups: dict[tuple[str, int, str], list[tuple[Path, dict[str, Any]]]] = {}
    for path, result in runs:
        groups.setdefault(_key(result), []).append((path, result))
    first = runs[0][1]
    lines = [
        "# Plan delivery at 1,024 ranks: medians per configuration\n",
        f"{first['machine']}, {first['cpus']} CPUs; {len(runs)} runs of "
        f"{first['delivery']['seconds']:.0f} s, {first['delivery']['ranks']} ranks, {first['delivery']['nodes']} "
        f"nodes, {first['delivery']['rate_groups_s']} groups/s\n",
        "| server | rows/rank | acks | runs | load at start | delivery p50 ms | delivery p99 ms | mini-batches "
        "| server CPU ms / mini-batch | server CPU busy (one core) | requests/s | server CPU µs / request "
        "| groups registered /s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (server, rows, mode), items in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        ds = [r["delivery"] for _, r in items]
        loads = ", ".join(f"{r['load_avg_1m_start']:.1f}" for _, r in items)
        share = _median([d.get("server_cpu_share") for d in ds])
        lines.append(
            f"| {server} | {rows} | {mode} | {len(items)} | {loads} "
            f"| {_fmt(_median([d['plan_delivery_ms']['p50'] for d in ds]))} "
            f"| {_fmt(_median([d['plan_delivery_ms']['p99'] for d in ds]))} "
            f"| {_fmt(_median([d['mini_batches_consumed'] for d in ds]))} "
            f"| {_fmt(_median([d['server_cpu_ms_per_mini_batch'] for d in ds]))} "
            f"| {_fmt(None if share is None else 100 * share)} % "
            f"| {_fmt(_median([d.get('requests_per_s') for d in ds]))} "
            f"| {_fmt(_median([d.get('server_cpu_us_per_request') for d in ds]))} "
            f"| {_fmt(_median([_registered(d) for d in ds]))} |"
        )
    lines += [
        "",
        "Every run:",
        "",
        "| file | load | p50 ms | p99 ms | mini-batches | CPU ms / mini-batch |",
        "|---|---|---|---|---|---|",
    ]
    for path, r in runs:
        d = r["delivery"]
        lines.append(
            f"| {path.name} | {r['load_avg_1m_start']:.1f} | {_fmt(d['plan_delivery_ms']['p50'])} "
            f"| {_fmt(d['plan_delivery_ms']['p99'])} | {d['mini_batches_consumed']} "
            f"| {_fmt(d['server_cpu_ms_per_mini_batch'])} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
