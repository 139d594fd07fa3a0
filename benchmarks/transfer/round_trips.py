"""Round trips to an idle server: a plain TCP echo, the store's data lane, Flight and the control plane's HTTP.

Why this exists: the put path's round trips (a store's ``publish_units``, the control plane's
registration) cost more than their work. A real LocalCluster (a control plane, one store on
``/dev/shm``) and a plain TCP echo server in a process of its own; from this process, one empty request
at a time to each: ``tcp echo`` (one byte each way), ``lane ping`` (an empty-ticket lane request on a
kept connection), ``flight health`` (the store's ``health`` action over Flight), ``http 404`` (a
``GET`` of an unknown path on the control plane over a kept ``http.client`` connection: uvicorn and
the app's routing, no state). Each kind back to back, and after the caller slept 1, 3, 10 and 50 ms
(the server idle as long): medians and p99 over ``--reps`` requests.

    python benchmarks/transfer/round_trips.py [--reps 300] [--out DIR]

Writes ``round_trips.json`` and ``round_trips.md`` under ``--out`` (default benchmarks/transfer/results).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from knittrans.flight import StoreClient, lane
from knittrans.local import ClusterConfig, LocalCluster

ECHO = r"""
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""
IDLE_MS = (0, 1, 3, 10, 50)


def timed(call: Callable[[], object], idle_s: float, reps: int) -> list[float]:
    """``reps`` calls, each after ``idle_s`` of sleep; their times in ms (the first tenth dropped as warm-up)."""
    out = []
    for _ in range(reps + reps // 10):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out[reps // 10 :]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    shm = Path("/dev/shm")
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        assert echo.stdout is not None
        tcp = socket.create_connection(("127.0.0.1", int(echo.stdout.readline())))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with (
            tempfile.TemporaryDirectory(prefix="knittrans_rt_", dir=shm if shm.is_dir() else None) as tmp,
            LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=1)) as cl,
            StoreClient(cl.stores[0].endpoint) as store,
        ):
            port = store.lane_port()
            assert port is not None, "the store opened no data lane"
            lane_conn = socket.create_connection(("127.0.0.1", port))
            lane_conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            url = urlsplit(cl.control_url)
            web = [http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port)]

            def echo_once() -> None:
                tcp.sendall(b"x")
                tcp.recv(8)

            def http_404() -> None:
                try:
                    web[0].request("GET", "/v1/no-such-path")
                    web[0].getresponse().read()
                except (http.client.HTTPException, ConnectionError):  # uvicorn closed it after 5 s idle
                    web[0].close()  # (between the series: the first call of one, a warm-up call)
                    web[0] = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port)
                    http_404()

            kinds: dict[str, Callable[[], object]] = {
                "tcp echo": echo_once,
                "lane ping": lambda: lane.ping(lane_conn, b""),
                "flight health": store.health,
                "http 404": http_404,
            }
            for idle in IDLE_MS:
                for name, call in kinds.items():
                    ms = timed(call, idle / 1e3, args.reps)
                    results.setdefault(name, {})[f"idle {idle} ms"] = {
                        "p50_ms": statistics.median(ms),
                        "p99_ms": pct(ms, 0.99),
                        "mean_ms": statistics.fmean(ms),
                    }
                    print(f"{name:14s} idle {idle:2d} ms: p50 {statistics.median(ms):.3f} ms", flush=True)
            lane_conn.close()
            web[0].close()
        tcp.close()
    finally:
        echo.kill()
        echo.wait()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_start": load0,
        "load_end": os.getloadavg()[0],
        "commit": commit,
        "reps": args.reps,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "round_trips.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    head = " | ".join(f"idle {i} ms" for i in IDLE_MS)
    lines = [
        f"# Round trips to an idle server (commit {commit})",
        "",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs, load average {load0:.1f} at start / "
        f"{machine['load_end']:.1f} at end. {args.reps} requests per cell after a tenth as many warm-up; "
        "p50 / p99 in ms; the caller slept the idle time before each request.",
        "",
        f"| request | {head} |",
        "|---" * (len(IDLE_MS) + 1) + "|",
    ]
    for name, cells in results.items():
        row = " | ".join(f"{c['p50_ms']:.2f} / {c['p99_ms']:.2f}" for c in cells.values())
        lines.append(f"| {name} | {row} |")
    (args.out / "round_trips.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
