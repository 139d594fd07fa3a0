"""A writer's registration over the control plane's lane vs over HTTP, against one control plane.

The text mini-batch's 8 unit descriptors (as a put registers them) are registered with a real
``knittrans control-plane`` (and 2 real store nodes for the units to name), alternating a client
with the lane (``ControlClient()``) and one without (``ControlClient(lane=False)``: the kept-alive
``http.client`` POST), in blocks of ``--block`` registrations, after the caller idled for each of
``--idle-ms`` (a writer's build and file writes come between its registrations). Reported per path
and idle time: wall p50 / p99 / mean and the control plane's CPU per registration (``/proc``, mean
over the blocks).

    python benchmarks/transfer/register_lane.py [--reps 200] [--idle-ms 0,10] [--tag NAME]

Writes ``register_lane[_<tag>].json`` and ``.md`` under ``--out`` (default benchmarks/transfer/results).
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="registrations per path and idle time")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--idle-ms", default="0,10")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    from benchmarks.transfer.put_path import put_job
    from benchmarks.vs_baselines.knittrans_runner import build_groups
    from benchmarks.vs_baselines.workload import WorkloadSpec, generate
    from knittrans.controlclient import ControlClient
    from knittrans.demo.cluster import ClusterConfig, LocalCluster
    from knittrans.rollout.writer import describe_unit
    from knittrans.schema import build_units_tables

    idles = [float(x) for x in args.idle_ms.split(",") if x]
    spec = WorkloadSpec(kind="text")
    workload = generate(spec)
    batches = spec.put_batches()
    paths = ("lane", "http")
    wall: dict[str, dict[float, list[float]]] = {p: {i: [] for i in idles} for p in paths}
    cp_cpu: dict[str, dict[float, list[float]]] = {p: {i: [] for i in idles} for p in paths}
    load_start = os.getloadavg()
    tck = os.sysconf("SC_CLK_TCK")
    with (
        tempfile.TemporaryDirectory(prefix="knittrans_reglane_") as tmp,
        LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=2)) as cl,
    ):
        admin = cl.control()
        admin.create_job(put_job(spec, total_steps=1_000_000))
        children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
        pid = int(children.split()[0])

        def cpu() -> float:  # the control plane's (LocalCluster starts it first)
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tck

        clients = {"lane": ControlClient(cl.control_url), "http": ControlClient(cl.control_url, lane=False)}
        total = args.reps * len(idles) * len(paths)
        n = 0

        def descriptors() -> list[Any]:
            nonlocal n
            groups = build_groups(workload, f"r{n}")
            units = [groups[b.start : b.stop] for b in batches]
            tables = build_units_tables(units)
            n += 1
            return [
                describe_unit(
                    t, u, unit_id=f"u{n}x{i}", job="put", node_id=s.node_id, endpoint=s.endpoint, num_bytes=500_000
                )
                for i, (u, t, s) in enumerate(zip(units, tables, [cl.stores[k % 2] for k in range(8)], strict=True))
            ]

        for path in paths:  # warm-up: connections made, the lane found
            for _ in range(5):
                clients[path].register_units("put", descriptors())
        blocks = max(1, args.reps // args.block)
        for b in range(blocks):
            for idle in idles:
                for path in paths if b % 2 == 0 else paths[::-1]:
                    work = [descriptors() for _ in range(args.block)]
                    spent = 0.0
                    for descs in work:
                        time.sleep(idle / 1e3)
                        c0 = cpu()
                        t0 = time.perf_counter()
                        clients[path].register_units("put", descs)
                        wall[path][idle].append(1e3 * (time.perf_counter() - t0))
                        spent += cpu() - c0
                    cp_cpu[path][idle].append(1e3 * spent / args.block)
            print(f"[register_lane] {min(total, (b + 1) * args.block * len(idles) * 2)}/{total}", file=sys.stderr)
        served = admin._json("GET", "/v1/lane")["served"]
        if clients["lane"].lane is None or clients["lane"].lane.served < args.reps * len(idles):
            raise SystemExit("the lane client did not register over the lane")
        for c in clients.values():
            c.close()
    rows = []
    for idle in idles:
        for path in paths:
            xs = wall[path][idle]
            rows.append(
                {
                    "path": path,
                    "idle_ms": idle,
                    "n": len(xs),
                    "p50_ms": statistics.median(xs),
                    "p99_ms": pct(xs, 0.99),
                    "mean_ms": statistics.mean(xs),
                    "cp_cpu_ms": statistics.mean(cp_cpu[path][idle]),
                }
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "knittrans"], capture_output=True, text=True, cwd=REPO)
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "commit": commit.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else ""),
        "lane_served": served,
    }
    result = {"reps": args.reps, "block": args.block, "rows": rows, "machine": machine}
    name = "register_lane" + (f"_{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# A registration of 8 units: control-plane lane vs HTTP",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, load average {load_start[0]:.1f} at start / "
        f"{os.getloadavg()[0]:.1f} at end; commit {machine['commit']}. {args.reps} registrations per row of the "
        f"text mini-batch's 8 unit descriptors against one `knittrans control-plane`, the two clients alternated "
        f"in blocks of {args.block}. Control-plane CPU: /proc ticks over each block, mean per registration.",
        "",
        "| caller idle before | path | p50 ms | p99 ms | mean ms | control-plane CPU ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['idle_ms']:g} ms | {r['path']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_ms']:.2f} | "
            f"{r['cp_cpu_ms']:.2f} |"
        )
    for idle in idles:
        lane, http = (next(r for r in rows if r["path"] == p and r["idle_ms"] == idle) for p in paths)
        lines.append("")
        lines.append(
            f"After {idle:g} ms idle: lane / HTTP p50 {lane['p50_ms'] / http['p50_ms']:.2f}, mean "
            f"{lane['mean_ms'] / http['mean_ms']:.2f}, control-plane CPU {lane['cp_cpu_ms'] / http['cp_cpu_ms']:.2f}."
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
