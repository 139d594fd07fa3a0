"""Server CPU per request with the request gate and connection guard (this tree) against a baseline tree.

Starts ``knittrans control-plane`` with worker and admin tokens twice per round, once from this tree and
once from ``--baseline`` (a directory holding another tree's ``knittrans`` package, e.g. ``git archive``
of main), alternating which goes first, and sends each the same requests over one keep-alive connection:
``GET /v1/jobs/{job}`` (no body) and ``POST /v1/jobs/{job}/supply`` (a small JSON body: the gate receives
and scans it before the route). The figure is the server process's CPU time (user + system, psutil) per
request, which depends little on what else loads the machine; the client's wall time per request is
reported beside it. Median, mean and p99 over ``--rounds`` rounds.

Run: ``python benchmarks/control_plane/gate_overhead.py --baseline /tmp/base [--rounds 7] [--requests 2000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import child_env  # this directory is sys.path[0]

from knittrans.procs import control_plane_args, free_port, knittrans_command

ADMIN, WORKER = "bench-admin", "bench-worker"
JOB = {
    "name": "job1",
    "group_size": 2,
    "quotas": {"math": 4, "code": 2},
    "mini_batches_per_step": 3,
    "policy": "constraint_preserving",
    "world_size": 2,
    "micro_batch_size": 2,
}


def _serve(db: Path, pythonpath: str | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = knittrans_command(*control_plane_args(db, port=port, log_level="WARNING"))
    cmd += ["--worker-token", WORKER, "--admin-token", ADMIN]
    env = child_env(pythonpath)  # with cwd: the tree asked for, not the package of the caller's directory
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=db.parent)
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


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _measure(url: str, pid: int, requests: int) -> dict[str, float]:
    server = psutil.Process(pid)
    out: dict[str, float] = {}
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {WORKER}"}, timeout=30) as client:
        admin = {"authorization": f"Bearer {ADMIN}"}
        assert client.post("/v1/jobs", json=JOB, headers=admin).status_code == 201
        for name, call in (
            ("get_job", lambda: client.get("/v1/jobs/job1")),
            ("post_supply", lambda: client.post("/v1/jobs/job1/supply", json={"started": {"math": 0}})),
        ):
            for _ in range(50):  # warm up
                call()
            cpu, wall = _cpu(server), time.perf_counter()
            for _ in range(requests):
                r = call()
                assert r.status_code == 200, r.text
            out[f"{name}_cpu_us"] = (_cpu(server) - cpu) / requests * 1e6
            out[f"{name}_wall_us"] = (time.perf_counter() - wall) / requests * 1e6
    return out


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def main() -> None:
    """Run the paired rounds and write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", required=True, help="directory whose knittrans package is the baseline")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gate_overhead.json")
    args = parser.parse_args()
    load = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {"head": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["head", "baseline"] if i % 2 == 0 else ["baseline", "head"]
            for tree in order:
                db = Path(tmp) / f"{tree}-{i}.db"
                proc, url = _serve(db, args.baseline if tree == "baseline" else None)
                try:
                    runs[tree].append(_measure(url, proc.pid, args.requests))
                finally:
                    proc.terminate()
                    proc.wait(30)
    keys = list(runs["head"][0])
    result: dict[str, Any] = {
        "command": "python benchmarks/control_plane/gate_overhead.py "
        + " ".join(
            f"--{k} {v}" for k, v in (("baseline", args.baseline), ("rounds", args.rounds), ("requests", args.requests))
        ),
        "load_before": load,
        "load_after": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "head": {k: _summary([r[k] for r in runs["head"]]) for k in keys},
        "baseline": {k: _summary([r[k] for r in runs["baseline"]]) for k in keys},
        "ratio_median": {
            k: statistics.median(r[k] for r in runs["head"]) / statistics.median(r[k] for r in runs["baseline"])
            for k in keys
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("head", "baseline", "ratio_median")}, indent=2))


if __name__ == "__main__":
    main()
