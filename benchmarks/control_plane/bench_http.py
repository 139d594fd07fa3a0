"""Control plane through its real HTTP server: unit-registration throughput and plan-delivery latency.

Starts ``knittrans control-plane`` (uvicorn, SQLite WAL state in a temp dir) as a subprocess and
drives it with ``httpx`` from this process.

* Registration throughput (target >= 5,000 units/s): units of one 8-trajectory group each, posted
  in batches of ``--batch`` units to ``POST /v1/jobs/{job}/units``; admission and assignment run
  inside the server on every request (job: G = 1,024 groups over 4 sources, K = 4, W = 8), so
  the figure includes planning ~1 mini-batch per 256 units. Baseline in the same run: one unit per
  request. Median over ``--runs`` runs, each on a fresh job. Also reported: units per second of
  server-process CPU time (psutil), which does not depend on what else loads the machine.
* Plan-delivery latency (target <= 10 ms): a rank thread waits in the long-poll
  ``GET .../ranks/0/next``; the main thread registers one unit, which admits a mini-batch
  (G = K = W = 1). Latency = time the plan reached the rank minus time the registration response
  reached the writer; also reported from when the registration request was sent, which includes the
  server's admission, assignment and commit. Writer and rank run in one process, so the first figure
  can be slightly negative when the rank's thread reads its response first. Median over
  ``--trials`` trials. Baseline in the same run: the rank polls ``?timeout_s=0`` with a sleep loop
  (``--poll-interval-ms``, default 50 ms).

Run: ``python benchmarks/control_plane/bench_http.py [--runs 5] [--trials 30] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from knittrans.procs import control_plane_args, free_port, knittrans_command

SOURCES = ("math", "code", "chat", "mm_qa")
GROUP_SIZE = 8


def _start_server(db: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    # the benchmark sends no heartbeats
    cmd = knittrans_command(*control_plane_args(db, port=port, node_timeout_s=86400, log_level="WARNING"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("control plane did not start")


def _unit(job: str, i: int, source: str, t: float) -> dict[str, Any]:
    toks = [200 + (i * 37 + k * 101) % 1800 for k in range(GROUP_SIZE)]
    return {
        "unit_id": f"u{i}",
        "job": job,
        "node_id": f"n{i % 8}",
        "endpoint": f"grpc://127.0.0.1:{9000 + i % 8}",
        "num_rows": GROUP_SIZE,
        "num_bytes": 4096,
        "schema_version": 1,
        "groups": [
            {
                "group_id": f"g{i}",
                "source": source,
                "row_start": 0,
                "num_trajectories": GROUP_SIZE,
                "trajectory_tokens": toks,
                "version_start": 0,
                "version_end": 0,
                "version_weighted": 0.0,
                "finished_at": t,
                "media_hashes": [],
            }
        ],
    }


def _job(c: httpx.Client, name: str, *, quotas: dict[str, int], k: int, w: int, size: int = GROUP_SIZE) -> None:
    spec = {
        "name": name,
        "group_size": size,
        "quotas": quotas,
        "mini_batches_per_step": k,
        "policy": "constraint_preserving",
        "world_size": w,
        "micro_batch_tokens": 16384,
    }
    c.post("/v1/jobs", json=spec).raise_for_status()


def registration(c: httpx.Client, server: psutil.Process, run: int, units: int, batch: int) -> tuple[float, float]:
    """(units per wall second, units per server CPU second) for ``units`` units posted ``batch`` at a time."""
    job = f"reg{run}-b{batch}"
    _job(c, job, quotas={s: 256 for s in SOURCES}, k=4, w=8)
    c.post(f"/v1/jobs/{job}/supply", json={"started": {s: units for s in SOURCES}}).raise_for_status()
    bodies = [
        {"units": [_unit(job, i, SOURCES[i % 4], 1000.0 + i) for i in range(lo, min(units, lo + batch))]}
        for lo in range(0, units, batch)
    ]
    cpu0 = sum(server.cpu_times()[:2])
    t0 = time.perf_counter()
    for body in bodies:
        r = c.post(f"/v1/jobs/{job}/units", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"registration failed: {r.status_code} {r.text}")
    wall = time.perf_counter() - t0
    return units / wall, units / max(1e-9, sum(server.cpu_times()[:2]) - cpu0)


def delivery(url: str, run: str, trials: int, poll_interval_s: float | None) -> dict[str, list[float]]:
    """Per-trial ms from registration response (and request) to the plan reaching the waiting rank."""
    job = f"lat-{run}"
    with httpx.Client(base_url=url, timeout=60) as writer, httpx.Client(base_url=url, timeout=60) as rank:
        _job(writer, job, quotas={"math": 1}, k=1, w=1, size=GROUP_SIZE)
        got: dict[int, float] = {}
        ready = threading.Event()
        stop = threading.Event()

        def rank_loop() -> None:
            n = 0
            while n < trials and not stop.is_set():
                ready.set()
                if poll_interval_s is None:
                    r = rank.get(f"/v1/jobs/{job}/ranks/0/next", params={"timeout_s": 30})
                else:
                    r = rank.get(f"/v1/jobs/{job}/ranks/0/next", params={"timeout_s": 0})
                    if r.status_code == 204:
                        time.sleep(poll_interval_s)
                        continue
                arrived = time.perf_counter()
                if r.status_code != 200:
                    continue
                plan = r.json()
                got[plan["global_index"]] = arrived
                rank.post(f"/v1/jobs/{job}/ranks/0/ack", json={"plan_id": plan["plan_id"]}).raise_for_status()
                n += 1

        thread = threading.Thread(target=rank_loop, daemon=True)
        thread.start()
        from_response: list[float] = []
        from_request: list[float] = []
        for i in range(trials):
            ready.wait(10)
            time.sleep(0.03)  # let the rank settle into its wait (or its sleep loop)
            ready.clear()
            body = {"units": [_unit(job, i, "math", 1000.0 + i)]}
            sent = time.perf_counter()
            r = writer.post(f"/v1/jobs/{job}/units", json=body)
            answered = time.perf_counter()
            r.raise_for_status()
            assert r.json()["admitted"] == [i], r.text
            deadline = time.monotonic() + 10
            while i not in got and time.monotonic() < deadline:
                time.sleep(0.0002)
            from_response.append((got[i] - answered) * 1e3)
            from_request.append((got[i] - sent) * 1e3)
        stop.set()
        thread.join(35)
    return {"from_response_ms": from_response, "from_request_ms": from_request}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="throughput runs per variant (median)")
    parser.add_argument("--units", type=int, default=20_000, help="units per batched run")
    parser.add_argument("--baseline-units", type=int, default=2_000, help="units per one-per-request run")
    parser.add_argument("--batch", type=int, default=500, help="units per request (batched)")
    parser.add_argument("--trials", type=int, default=30, help="plan-delivery trials (median)")
    parser.add_argument("--poll-interval-ms", type=float, default=50.0, help="baseline polling sleep")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("bench_http.json"))
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="knittrans-bench-http-"))
    proc, url = _start_server(tmp / "cp.db")
    try:
        batched: list[float] = []
        single: list[float] = []
        batched_cpu: list[float] = []
        single_cpu: list[float] = []
        server = psutil.Process(proc.pid)
        with httpx.Client(base_url=url, timeout=120) as c:
            for n in range(8):
                c.post("/v1/nodes", json={"node_id": f"n{n}", "endpoint": f"grpc://127.0.0.1:{9000 + n}"})
            for run in range(args.runs):
                wall, cpu = registration(c, server, run, args.units, args.batch)
                batched.append(wall)
                batched_cpu.append(cpu)
                wall, cpu = registration(c, server, run, args.baseline_units, 1)
                single.append(wall)
                single_cpu.append(cpu)
                print(
                    f"  run {run}: batched {batched[-1]:,.0f} units/s ({batched_cpu[-1]:,.0f} per server CPU-s), "
                    f"one-per-request {single[-1]:,.0f} units/s (load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        lp = delivery(url, "longpoll", args.trials, None)
        print(f"  long-poll: median {statistics.median(lp['from_response_ms']):.2f} ms", flush=True)
        poll = delivery(url, "polling", args.trials, args.poll_interval_ms / 1e3)
        print(f"  polling:   median {statistics.median(poll['from_response_ms']):.2f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(10)

    reg_med, base_med = statistics.median(batched), statistics.median(single)
    lp_med = statistics.median(lp["from_response_ms"])
    poll_med = statistics.median(poll["from_response_ms"])
    lp_req = statistics.median(lp["from_request_ms"])
    poll_req = statistics.median(poll["from_request_ms"])
    result = {
        "benchmark": "control_plane/bench_http",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "registration": {
            "batched_units_per_s": batched,
            "batched_median": reg_med,
            "one_per_request_units_per_s": single,
            "one_per_request_median": base_med,
            "batched_units_per_server_cpu_s": batched_cpu,
            "batched_per_cpu_s_median": statistics.median(batched_cpu),
            "one_per_request_per_cpu_s_median": statistics.median(single_cpu),
            "ratio_vs_baseline": reg_med / base_med,
            "target_units_per_s": 5000,
            "meets_target": reg_med >= 5000,
        },
        "plan_delivery": {
            "long_poll": lp,
            "long_poll_median_ms": lp_med,
            "long_poll_median_from_request_ms": statistics.median(lp["from_request_ms"]),
            "long_poll_max_ms": max(lp["from_response_ms"]),
            "polling": poll,
            "polling_median_ms": poll_med,
            "polling_median_from_request_ms": poll_req,
            "ratio_polling_over_long_poll_from_request": poll_req / lp_req,
            "target_ms": 10,
            "meets_target": lp_med <= 10,
        },
    }
    args.out.write_text(json.dumps(result, indent=2))
    rows = [
        (
            f"unit registration, batches of {args.batch}",
            f"{reg_med:,.0f} units/s",
            ">= 5,000 units/s",
            "yes" if reg_med >= 5000 else "NO",
        ),
        ("  per second of server CPU (load-independent)", f"{statistics.median(batched_cpu):,.0f} units/s", "", ""),
        ("unit registration, 1 per request (baseline)", f"{base_med:,.0f} units/s", "", ""),
        ("  ratio batched / baseline", f"{reg_med / base_med:.1f}x", "", ""),
        (
            "plan delivery, long-poll (from reg. response)",
            f"{lp_med:.2f} ms",
            "<= 10 ms",
            "yes" if lp_med <= 10 else "NO",
        ),
        ("plan delivery, long-poll (from reg. request)", f"{lp_req:.2f} ms", "", ""),
        (
            f"plan delivery, polling every {args.poll_interval_ms:g} ms (from reg. response)",
            f"{poll_med:.2f} ms",
            "",
            "",
        ),
        (
            f"plan delivery, polling every {args.poll_interval_ms:g} ms (from reg. request)",
            f"{poll_req:.2f} ms",
            "",
            "",
        ),
        ("  ratio polling / long-poll (from request)", f"{poll_req / lp_req:.1f}x", "", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'median':>16}  {'target':>16}  met")
    for name, value, target, met in rows:
        print(f"{name:<{width}}  {value:>16}  {target:>16}  {met}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
