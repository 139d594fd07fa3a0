"""``knittrans status``: the dashboard's facts as plain text in a terminal (``--watch`` redraws)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "render", "run"]


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def _bar(fraction: float, width: int = 20) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _job(job: dict[str, Any], now: float) -> list[str]:
    total = f"/{job['total_steps']}" if job.get("total_steps") else ""
    lines = [
        f"job {job['job']}: {job['state'].upper()}  step {job['step']}{total}  mini-batch "
        f"{job['mini_batch_index'] + 1}/{job['mini_batches_per_step']}  policy v{job['version']}  "
        f"{job['policy']}  consumed {job['consumed_mini_batches']} mini-batches / {job['consumed_groups']} groups"
    ]
    lines.append(" quota fill (current step):")
    lines += _table(
        ["source", "admitted/quota", "fill", "pending", "finished", "deficit"],
        [
            [
                s,
                f"{f['admitted']}/{f['quota']}",
                f"{_bar(f['fill'])} {f['fill'] * 100:3.0f}%",
                job["pending"].get(s, 0),
                job["finished"].get(s, 0),
                job["deficits"].get(s, "") or "",
            ]
            for s, f in job["quota_fill"].items()
        ],
    )
    admissions = job["admissions"]
    if admissions:
        waits = [a.get("wait_s") or 0.0 for a in admissions]
        last = admissions[-1]
        lines.append(
            f" admissions: last #{last['global_index']} waited {_secs(last.get('wait_s') or 0.0)}, "
            f"policy+assignment {_secs(last['seconds'])}; recent {len(waits)}: mean wait "
            f"{_secs(sum(waits) / len(waits))}, max {_secs(max(waits))}"
        )
    stale = job["staleness"].get("end", {})
    if stale:
        lines.append(
            " architectural staleness (end reading), last consumed step: "
            + ", ".join(
                f"{s} mean {pts[-1]['mean']:.2f} max {pts[-1]['max']:.0f} (step {pts[-1]['step']})"
                for s, pts in sorted(stale.items())
            )
        )
    in_flight = job["in_flight_mini_batches"]
    shown = ", ".join(
        f"#{m['global_index']} (fetched {m['fetched']}/{m['world_size']}, acked {m['acked']}/{m['world_size']})"
        for m in in_flight[:8]
    )
    lines.append(f" in flight: {len(in_flight)} mini-batches" + (f": {shown}" if shown else ""))
    lines.append(f" lost groups: {job['lost_groups_total']}, waiting for regeneration: {job['to_regenerate_total']}")
    lines.append(" ranks:")
    lines += _table(
        ["rank", "version", "mini-batches", "exposed", "fetch", "logical", "physical", "last ack"],
        [
            [
                r["rank"],
                r.get("version") if r.get("version") is not None else "-",
                r["mini_batches"],
                _secs(r.get("exposed_s")),
                _secs(r.get("fetch_s")),
                _bytes(r.get("row_bytes", 0) + r.get("media_logical_bytes", 0)) if "row_bytes" in r else "-",
                _bytes(r.get("row_bytes", 0) + r.get("media_physical_bytes", 0)) if "row_bytes" in r else "-",
                (
                    f"{r['last_ack']['manifest_id']} ({_secs(now - r['last_ack']['at'])} ago)"
                    if r.get("last_ack")
                    else "-"
                ),
            ]
            for r in job["ranks"]
        ],
    )
    return lines


def render(overview: dict[str, Any], job: str | None = None) -> str:
    """The overview (``GET /v1/overview``) as text; only ``job`` when given."""
    now = overview["at"]
    jobs = [j for j in overview["jobs"] if job is None or j["job"] == job]
    lines = [f"KnitTrans control plane - {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}", ""]
    if job is not None and not jobs:
        lines.append(f"no job {job!r} (jobs: {', '.join(j['job'] for j in overview['jobs']) or 'none'})")
    elif not jobs:
        lines.append("no job yet")
    for j in jobs:
        lines += [*_job(j, now), ""]
    lines.append("store nodes:")
    rows = []
    for n in overview["nodes"]:
        u = n.get("usage") or {}
        budget = u.get("budget_bytes")
        rows.append(
            [
                n["node_id"],
                n["state"].upper(),
                n["endpoint"],
                _secs(n["seconds_since_heartbeat"]) + " ago",
                u.get("units", "-"),
                _bytes(u.get("bytes_in_memory")),
                _bytes(u.get("bytes_spilled")),
                f"{_bytes(u.get('budget_used'))}/{_bytes(budget)}" if budget else _bytes(u.get("budget_used")),
            ]
        )
    lines += (
        _table(["node", "state", "endpoint", "heartbeat", "units", "memory", "spilled", "budget"], rows)
        if rows
        else ["  no store node registered"]
    )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommand."""
    parser.add_argument(
        "--control-url",
        default=os.environ.get("KNITTRANS_CONTROL_URL", "http://127.0.0.1:8700"),
        help="control plane (default $KNITTRANS_CONTROL_URL or http://127.0.0.1:8700)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("KNITTRANS_ADMIN_TOKEN"),
        help="admin bearer token (default $KNITTRANS_ADMIN_TOKEN)",
    )
    parser.add_argument("--job", default=None, help="show only this job")
    parser.add_argument("--watch", action="store_true", help="redraw until interrupted")
    parser.add_argument("--interval-s", type=float, default=2.0, help="seconds between redraws with --watch")


def run(args: argparse.Namespace) -> int:
    """Print the overview once, or redraw it every ``--interval-s`` with ``--watch``."""
    from knittrans.controlclient import ControlClient
    from knittrans.errors import KnitTransError

    if args.interval_s <= 0:
        raise SystemExit("knittrans status: --interval-s must be positive")
    with ControlClient(args.control_url, token=args.token, retries=2) as control:
        while True:
            try:
                text = render(control.overview(), args.job)
            except KnitTransError as exc:
                print(f"knittrans status: {args.control_url}: {exc}", file=sys.stderr)
                if not args.watch:
                    return 1
            else:
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")  # home + clear screen
                sys.stdout.write(text)
                sys.stdout.flush()
            if not args.watch:
                return 0
            time.sleep(args.interval_s)
