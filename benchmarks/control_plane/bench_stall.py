"""Does the control plane stall? ``/v1/health`` latency while 10,000 units are being registered.

Starts ``knittrans control-plane`` (real uvicorn + SQLite) as a subprocess. A prober thread sends
``GET /v1/health`` back to back (one keep-alive connection) and records each latency; the main
thread registers ``--units`` units (one 8-trajectory group each, job G = 1,024 groups over 4
sources, K = 4, W = 8) in requests of at most ``MAX_UNITS_PER_REQUEST`` units. Reported: p50/p99/
max health latency during the registration window. Baseline in the same run: the same prober
against the idle server for the same time. Target: p99 <= 50 ms during registration. Median over
``--runs`` runs, each on a fresh job. Heartbeats are probed the same way (``POST
/v1/nodes/n0/heartbeat``): a stalled heartbeat is what made live nodes look lost.

Run: ``python benchmarks/control_plane/bench_stall.py [--runs 3] [--units 10000] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import SOURCES, create_job, start_server, unit

from knittrans.api.models import MAX_UNITS_PER_REQUEST


def _probe(url: str, stop: threading.Event, path: str, method: str) -> list[float]:
    lat: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.request(method, path).raise_for_status()
            lat.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.002)
    return lat


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _window(url: str, work: Any) -> tuple[dict[str, list[float]], float]:
    stop = threading.Event()
    out: dict[str, list[float]] = {}
    threads = [
        threading.Thread(target=lambda k=k, p=p, m=m: out.__setitem__(k, _probe(url, stop, p, m)))
        for k, p, m in (("health", "/v1/health", "GET"), ("heartbeat", "/v1/nodes/n0/heartbeat", "POST"))
    ]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    work()
    wall = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    return out, wall


def run_once(url: str, run: int, units: int) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=600) as c:
        job = f"stall{run}"
        create_job(c, job, quotas={s: 256 for s in SOURCES}, k=4, w=8)
        c.post(f"/v1/jobs/{job}/supply", json={"started": {s: units for s in SOURCES}}).raise_for_status()
        bodies = [
            {
                "units": [
                    unit(job, i, SOURCES[i % 4], 1000.0 + i) for i in range(lo, min(units, lo + MAX_UNITS_PER_REQUEST))
                ]
            }
            for lo in range(0, units, MAX_UNITS_PER_REQUEST)
        ]

        def register() -> None:
            for body in bodies:
                c.post(f"/v1/jobs/{job}/units", json=body).raise_for_status()

        busy, wall = _window(url, register)
        idle, _ = _window(url, lambda: time.sleep(wall))
    row: dict[str, Any] = {"registration_s": wall}
    for kind in ("health", "heartbeat"):
        row[kind] = {
            "busy_p50_ms": _pct(busy[kind], 0.5),
            "busy_p99_ms": _pct(busy[kind], 0.99),
            "busy_max_ms": max(busy[kind]),
            "idle_p99_ms": _pct(idle[kind], 0.99),
            "probes": len(busy[kind]),
        }
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--units", type=int, default=10_000)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "stall.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp) / "cp.db")
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                for n in range(8):
                    c.post("/v1/nodes", json={"node_id": f"n{n}", "endpoint": f"grpc://127.0.0.1:{9000 + n}"})
            rows = []
            for run in range(args.runs):
                rows.append(run_once(url, run, args.units))
                r = rows[-1]
                print(
                    f"run {run + 1}/{args.runs}: {args.units} units in {r['registration_s']:.1f}s; health p99 "
                    f"{r['health']['busy_p99_ms']:.1f} ms (idle {r['health']['idle_p99_ms']:.1f} ms), max "
                    f"{r['health']['busy_max_ms']:.1f} ms; heartbeat p99 {r['heartbeat']['busy_p99_ms']:.1f} ms",
                    flush=True,
                )
        finally:
            proc.kill()
            proc.wait()
    med = {
        kind: {k: statistics.median(r[kind][k] for r in rows) for k in rows[0][kind]}
        for kind in ("health", "heartbeat")
    }
    result = {
        "units": args.units,
        "runs": rows,
        "median": med,
        "median_registration_s": statistics.median(r["registration_s"] for r in rows),
        "ratio_busy_over_idle_p99": {k: med[k]["busy_p99_ms"] / med[k]["idle_p99_ms"] for k in med},
        "target_p99_ms": 50.0,
        "meets_target": med["health"]["busy_p99_ms"] <= 50.0,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    md = [
        "| probe | p50 busy (ms) | p99 busy (ms) | max busy (ms) | p99 idle (ms) | busy/idle p99 |",
        "|---|---|---|---|---|---|",
    ]
    for k, m in med.items():
        md.append(
            f"| {k} | {m['busy_p50_ms']:.1f} | {m['busy_p99_ms']:.1f} | {m['busy_max_ms']:.1f} | "
            f"{m['idle_p99_ms']:.1f} | {result['ratio_busy_over_idle_p99'][k]:.2f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"target p99 <= 50 ms: {'met' if result['meets_target'] else 'MISSED'}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
