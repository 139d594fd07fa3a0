"""Cross-host throughput: Flight DoGet and the store's data lane vs raw TCP over one veth link, 1 and 4 streams.

One command (root, ``ip netns``): ``python benchmarks/transfer/netns_throughput.py [--quick] [--runs N]``.
Two network namespaces, ``store`` and ``trainer``, joined by veth pairs through a bridge (the lab of
``tests/netns_support.py``: nothing in the root namespace is touched). The store namespace runs a real
``knittrans store`` process and a raw TCP sender; the trainer namespace runs the client half of this
script, which times

* ``doget``: a whole unit read with S parallel DoGets (contiguous row ranges, one connection each;
  ``StoreClient(data_lane=False)``);
* ``lane``: what a default client does: the same S tickets read with ``StoreClient(...).get`` (no
  options) from a store started with its defaults, i.e. over the store's bulk data lane (checked:
  the lane stays reachable, no fallback happened), one connection each: one length-prefixed Arrow
  IPC stream per ticket received with ``recv_into`` into a pooled, reused buffer;
* ``nopool`` (with ``--pool-ab``): the same lane reads, each into a fresh buffer from Arrow's pool
  (the client before the receive pool), for the pool's effect in the same runs;
* ``tcp``: the same number of bytes received over S raw TCP connections (``sendall`` / ``recv_into``),

for units of 16 and 256 MiB and S = 1 and 4. Every figure is the median of ``--runs`` repetitions,
measured alternately in one run (doget, lane, tcp); the ratios ``doget / tcp`` and ``lane / tcp``
are the headline (target >= 0.8 with 4 streams). After the timed runs, each method moves
``--cpu-mib`` more MiB per case while the CPU time
(user + system) of both ends is clocked: the client process (``getrusage``) and the store process or
the raw sender (``/proc/<pid>/stat``), with the client's minor page faults. Both ends share the
host's cores, so ``tcp CPU / doget CPU`` is about the throughput ratio the CPU alone allows.
Writes JSON + markdown to ``benchmarks/transfer/results/netns_throughput.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import platform
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MiB = 1 << 20
STORE_PORT, TCP_PORT = 8815, 9000
TOKEN = "netns-bench-token"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def log(msg: str) -> None:
    print(f"[netns] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- store side
def tcp_serve(host: str, port: int) -> None:
    """Raw sender: each connection sends an 8-byte length, we answer with that many bytes, then close."""
    payload = memoryview(os.urandom(256 * MiB + 64 * MiB))
    srv = socket.create_server((host, port), backlog=64)

    def serve(conn: socket.socket) -> None:
        with conn:
            (n,) = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))
            sent = 0
            while sent < n:
                chunk = min(n - sent, len(payload))
                conn.sendall(payload[:chunk])
                sent += chunk

    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


# -------------------------------------------------------------------------------------------- trainer side
def tcp_receive(host: str, port: int, nbytes: int, streams: int) -> float:
    """Seconds to receive ``nbytes`` split over ``streams`` connections (connect time excluded)."""
    shares = [nbytes // streams + (1 if i < nbytes % streams else 0) for i in range(streams)]
    conns = [socket.create_connection((host, port)) for _ in shares]
    sinks = [bytearray(min(share, 16 * MiB)) for share in shares]
    start = threading.Barrier(len(conns) + 1)

    def pull(i: int) -> int:
        conn, share, view = conns[i], shares[i], memoryview(sinks[i])
        start.wait()
        conn.sendall(struct.pack("!Q", share))
        got = 0
        while got < share:
            n = conn.recv_into(view, min(len(view), share - got))
            if n == 0:
                raise RuntimeError(f"raw TCP stream {i} closed after {got} of {share} bytes")
            got += n
        conn.close()
        return got

    with ThreadPoolExecutor(len(conns)) as pool:
        futures = [pool.submit(pull, i) for i in range(len(conns))]
        start.wait()
        t0 = time.perf_counter()
        total = sum(f.result() for f in futures)
        dt = time.perf_counter() - t0
    assert total == nbytes
    return dt


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_gb(transfer: Any, nbytes: int, total: int, peer_pid: int) -> dict[str, float]:
    """CPU seconds per GB of both ends (and the client's minor faults per GB) over ``total`` bytes of ``transfer()``."""
    reps = max(1, -(-total // nbytes))
    ru0, peer0 = resource.getrusage(resource.RUSAGE_SELF), proc_cpu_s(peer_pid)
    for _ in range(reps):
        transfer()
    ru1, peer1 = resource.getrusage(resource.RUSAGE_SELF), proc_cpu_s(peer_pid)
    gb = reps * nbytes / 1e9
    client = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    return {
        "client_s_per_GB": client / gb,
        "client_user_s_per_GB": (ru1.ru_utime - ru0.ru_utime) / gb,
        "server_s_per_GB": (peer1 - peer0) / gb,
        "total_s_per_GB": (client + peer1 - peer0) / gb,
        "client_faults_per_GB": (ru1.ru_minflt - ru0.ru_minflt) / gb,
        "GB": gb,
    }


def parallel_reads(clients: list[Any], tickets: list[Any]) -> tuple[float, int]:
    """Seconds and payload bytes of reading ``tickets`` in parallel with ``get``, one client (connection) each."""
    start = threading.Barrier(len(clients) + 1)

    def read(i: int) -> int:
        start.wait()
        return int(clients[i].get(tickets[i]).nbytes)

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(read, i) for i in range(len(clients))]
        start.wait()
        t0 = time.perf_counter()
        total = sum(f.result() for f in futures)
        return time.perf_counter() - t0, total


doget = lane = parallel_reads  # the clients decide: data_lane=False, or a default client


def client_main(args: argparse.Namespace) -> None:
    """Runs in the trainer namespace: alternate DoGet, the data lane and raw TCP for every size and stream count."""
    from knittrans.flight.client import StoreClient
    from knittrans.flight.recv_pool import ReceivePool, default_pool
    from knittrans.tickets import Ticket, UnitRead

    no_pool = ReceivePool(min_bytes=1 << 62)  # every read into a fresh buffer from Arrow's pool

    units = json.loads(args.units)  # {size_mib: [unit_id, rows]}
    out: dict[str, Any] = {}
    for size, (unit_id, rows) in units.items():
        for streams in args.streams:
            bounds = [rows * i // streams for i in range(streams + 1)]
            tickets = [
                Ticket(job="bench", reads=(UnitRead(unit_id=unit_id, row_ranges=((lo, hi),)),))
                for lo, hi in itertools.pairwise(bounds)
            ]
            clients = [StoreClient(args.endpoint, token=TOKEN, timeout_s=300, data_lane=False) for _ in range(streams)]
            lane_clients = [StoreClient(args.endpoint, token=TOKEN, timeout_s=300) for _ in range(streams)]
            nopool_clients = [
                StoreClient(args.endpoint, token=TOKEN, timeout_s=300, recv_pool=no_pool)
                for _ in range(streams if args.pool_ab else 0)
            ]
            doget(clients, tickets)  # warm-up: connections, page cache of the store's mmap
            nbytes = doget(clients, tickets)[1]
            if lane(lane_clients, tickets)[1] != nbytes:
                raise RuntimeError("the default client (data lane) returned other bytes than DoGet")
            if nopool_clients and lane(nopool_clients, tickets)[1] != nbytes:
                raise RuntimeError("the unpooled lane client returned other bytes than DoGet")
            tcp_receive(args.tcp_host, TCP_PORT, nbytes, streams)
            t_get, t_lane, t_nopool, t_tcp = [], [], [], []
            for _ in range(args.runs):
                t_get.append(doget(clients, tickets)[0])
                t_lane.append(lane(lane_clients, tickets)[0])
                if nopool_clients:
                    t_nopool.append(lane(nopool_clients, tickets)[0])
                t_tcp.append(tcp_receive(args.tcp_host, TCP_PORT, nbytes, streams))
            if not all(c.lane_reachable() for c in lane_clients + nopool_clients):
                raise RuntimeError("a default client fell back to DoGet: the lane arm would not measure the lane")
            get_all = functools.partial(doget, clients, tickets)
            lane_all = functools.partial(lane, lane_clients, tickets)
            tcp_all = functools.partial(tcp_receive, args.tcp_host, TCP_PORT, nbytes, streams)
            cpu: dict[str, list[dict[str, float]]] = {"doget": [], "lane": [], "tcp": []}
            for _ in range(2):  # alternate, like the timed runs
                cpu["doget"].append(cpu_per_gb(get_all, nbytes, args.cpu_mib * MiB, args.store_pid))
                cpu["lane"].append(cpu_per_gb(lane_all, nbytes, args.cpu_mib * MiB, args.store_pid))
                cpu["tcp"].append(cpu_per_gb(tcp_all, nbytes, args.cpu_mib * MiB, args.tcp_pid))
            for c in clients + lane_clients + nopool_clients:
                c.close()
            get_gbps = [nbytes / t / 1e9 for t in t_get]
            lane_gbps = [nbytes / t / 1e9 for t in t_lane]
            tcp_gbps = [nbytes / t / 1e9 for t in t_tcp]
            key = f"{size}MiB_x{streams}"
            out[key] = {
                "bytes": nbytes,
                "streams": streams,
                "runs": args.runs,
                "doget_GBps_median": statistics.median(get_gbps),
                "lane_GBps_median": statistics.median(lane_gbps),
                "tcp_GBps_median": statistics.median(tcp_gbps),
                "doget_GBps": get_gbps,
                "lane_GBps": lane_gbps,
                "tcp_GBps": tcp_gbps,
                "ratio_median": statistics.median(get_gbps) / statistics.median(tcp_gbps),
                "lane_ratio_median": statistics.median(lane_gbps) / statistics.median(tcp_gbps),
                "doget_GBps_slowest": min(get_gbps),
                "lane_GBps_slowest": min(lane_gbps),
                "tcp_GBps_slowest": min(tcp_gbps),
                "lane_ms_p50_p99": _p50_p99(t_lane),
                "doget_ms_p50_p99": _p50_p99(t_get),
                "tcp_ms_p50_p99": _p50_p99(t_tcp),
                "cpu": {m: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for m, xs in cpu.items()},
                "pool": {"mapped": default_pool().mapped, "reused": default_pool().reused},
            }
            if t_nopool:
                nopool_gbps = [nbytes / t / 1e9 for t in t_nopool]
                out[key]["nopool_GBps"] = nopool_gbps
                out[key]["nopool_GBps_median"] = statistics.median(nopool_gbps)
                out[key]["nopool_ratio_median"] = statistics.median(nopool_gbps) / statistics.median(tcp_gbps)
                out[key]["nopool_ms_p50_p99"] = _p50_p99(t_nopool)
            cpu_get, cpu_lane, cpu_tcp = (out[key]["cpu"][m] for m in ("doget", "lane", "tcp"))
            out[key]["cpu_ratio"] = cpu_tcp["total_s_per_GB"] / cpu_get["total_s_per_GB"]
            out[key]["lane_cpu_ratio"] = cpu_tcp["total_s_per_GB"] / cpu_lane["total_s_per_GB"]
            print(
                f"[netns] {key}: DoGet {out[key]['doget_GBps_median']:.2f} GB/s, "
                f"lane {out[key]['lane_GBps_median']:.2f} GB/s, "
                f"TCP {out[key]['tcp_GBps_median']:.2f} GB/s; CPU s/GB client + server: "
                f"DoGet {cpu_get['client_s_per_GB']:.2f} + {cpu_get['server_s_per_GB']:.2f}, "
                f"lane {cpu_lane['client_s_per_GB']:.2f} + {cpu_lane['server_s_per_GB']:.2f}, "
                f"TCP {cpu_tcp['client_s_per_GB']:.2f} + {cpu_tcp['server_s_per_GB']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------- driver
def write_units(store_dir: Path, endpoint: str, sizes: list[int]) -> dict[str, list[Any]]:
    """Runs in the store namespace: sealed units of about ``size`` MiB each, written into the store's directory."""
    sys.path.insert(0, str(HERE))
    from run import make_groups  # the transfer benchmark's workload: prompt 256, responses ~2048 tokens

    from knittrans.rollout.writer import TrajectoryWriter

    writer = TrajectoryWriter(job="bench", node_id="store", endpoint=endpoint, store_dir=store_dir, token=TOKEN)
    units: dict[str, list[Any]] = {}
    for size in sizes:
        log(f"writing a {size} MiB unit")
        desc = writer.write_groups(make_groups(size * MiB, seed=size), unit_id=f"u{size}")
        units[str(size)] = [desc.unit_id, desc.num_rows]
    writer.close()
    return units


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 MiB only, 3 runs")
    parser.add_argument("--runs", type=int, default=None, help="repetitions per figure (default 7, quick 3)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="unit sizes in MiB (default 16 256)")
    parser.add_argument(
        "--cpu-mib", type=int, default=None, help="MiB per method and case clocked for CPU (default 1024, quick 256)"
    )
    parser.add_argument(
        "--client-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the client (trainer side) process, e.g. GLIBC_TUNABLES=...; repeatable, recorded",
    )
    parser.add_argument(
        "--pool-ab", action="store_true", help="also time lane reads without the receive pool (fresh buffer per read)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "netns_throughput")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 7)
    sizes = args.sizes or ([16] if args.quick else [16, 256])
    cpu_mib = args.cpu_mib or (256 if args.quick else 1024)
    if any("=" not in e or e.startswith("=") for e in args.client_env):
        parser.error(f"--client-env takes KEY=VALUE, not {args.client_env}")
    if os.geteuid() != 0:
        log("needs root for ip netns; nothing measured")
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    from netns_support import lab

    from knittrans.procs import ProcessGroup, knittrans_command, wait_until

    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="knittrans-netns-", dir="/dev/shm"))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with lab(["store", "trainer"]) as the_lab, ProcessGroup(work / "logs") as procs:
        store_ip = the_lab.hosts["store"]
        endpoint = f"grpc://{store_ip}:{STORE_PORT}"
        ready = work / "store.ready"
        store = procs.start(
            "store",
            knittrans_command(
                "--log-level",
                "WARNING",
                "store",
                "--dir",
                str(work / "store"),
                "--host",
                store_ip,
                "--port",
                str(STORE_PORT),
                "--node-id",
                "store",
                "--ready-file",
                str(ready),
            ),
            prefix=the_lab.exec_prefix("store"),
            env={**env, "KNITTRANS_STORE_TOKEN": TOKEN},
        )
        tcp = subprocess.Popen(
            [*the_lab.exec_prefix("store"), sys.executable, __file__, "tcp-serve", store_ip],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

        def store_up() -> bool:
            procs.check_alive("store")
            return ready.exists()

        wait_until(store_up, timeout_s=120, what="store in its namespace")
        assert tcp.stdout is not None and tcp.stdout.readline().strip() == "ready"
        writer = subprocess.run(
            [
                *the_lab.exec_prefix("store"),
                sys.executable,
                __file__,
                "write",
                endpoint,
                str(work / "store"),
                *map(str, sizes),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            timeout=900,
            check=True,
        )
        units = json.loads(writer.stdout.strip().splitlines()[-1])
        log(f"store at {endpoint}; measuring {sizes} MiB x streams 1, 4, {runs} runs each")
        client = subprocess.run(
            [
                *the_lab.exec_prefix("trainer"),
                "env",
                *args.client_env,
                sys.executable,
                __file__,
                "client",
                "--endpoint",
                endpoint,
                "--tcp-host",
                store_ip,
                "--units",
                json.dumps(units),
                "--runs",
                str(runs),
                "--cpu-mib",
                str(cpu_mib),
                "--store-pid",
                str(store.pid),
                "--tcp-pid",
                str(tcp.pid),
                *(["--pool-ab"] if args.pool_ab else []),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            timeout=1800,
            check=True,
        )
        tcp.kill()
        tcp.wait(10)
        results = json.loads(client.stdout.strip().splitlines()[-1])
    subprocess.run(["rm", "-rf", str(work)], check=False)
    report = {
        "benchmark": "netns_throughput",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "load_avg_1m_before": load_before,
        "cpu_mib": cpu_mib,
        "client_env": args.client_env,
        "commit": _commit(),
        "runs": runs,
        "results": results,
        "target_4_streams_ratio>=0.8": {k: v["ratio_median"] >= 0.8 for k, v in results.items() if v["streams"] == 4},
        "target_4_streams_lane_ratio>=0.8": {
            k: v["lane_ratio_median"] >= 0.8 for k, v in results.items() if v["streams"] == 4
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = [
        "| unit | streams | DoGet GB/s | lane GB/s | raw TCP GB/s | DoGet / TCP | lane / TCP "
        "| slowest run DoGet / lane / TCP GB/s | p50 / p99 ms DoGet, lane, TCP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cpu_lines = [
        "| unit | streams | DoGet client + server | lane client + server | raw TCP client + sender "
        "| TCP / DoGet total | TCP / lane total | client faults/GB DoGet / lane / TCP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        unit = f"{r['bytes'] / MiB:.0f} MiB"
        lat = ", ".join("{:.0f} / {:.0f}".format(*r[f"{m}_ms_p50_p99"]) for m in ("doget", "lane", "tcp"))
        lines.append(
            f"| {unit} | {r['streams']} | {r['doget_GBps_median']:.2f} | {r['lane_GBps_median']:.2f} | "
            f"{r['tcp_GBps_median']:.2f} | {r['ratio_median']:.2f} | {r['lane_ratio_median']:.2f} | "
            f"{r['doget_GBps_slowest']:.2f} / {r['lane_GBps_slowest']:.2f} / {r['tcp_GBps_slowest']:.2f} | {lat} |"
        )
        g, ln, t = r["cpu"]["doget"], r["cpu"]["lane"], r["cpu"]["tcp"]
        cpu_lines.append(
            f"| {unit} | {r['streams']} | {g['client_s_per_GB']:.2f} + {g['server_s_per_GB']:.2f} | "
            f"{ln['client_s_per_GB']:.2f} + {ln['server_s_per_GB']:.2f} | "
            f"{t['client_s_per_GB']:.2f} + {t['server_s_per_GB']:.2f} | {r['cpu_ratio']:.2f} | "
            f"{r['lane_cpu_ratio']:.2f} | {g['client_faults_per_GB'] / 1e3:.0f}k / "
            f"{ln['client_faults_per_GB'] / 1e3:.0f}k / {t['client_faults_per_GB'] / 1e3:.0f}k |"
        )
    nopool = [
        f"| {r['bytes'] / MiB:.0f} MiB | {r['streams']} | {r['lane_ratio_median']:.2f} | "
        f"{r['nopool_ratio_median']:.2f} | "
        + ", ".join("{:.0f} / {:.0f}".format(*r[f"{m}_ms_p50_p99"]) for m in ("lane", "nopool"))
        + " |"
        for r in results.values()
        if "nopool_ratio_median" in r
    ]
    md = (
        "# Cross-host throughput (veth between network namespaces)\n\nStore and clients with their defaults "
        "(lane = what a default `StoreClient` does: the data lane, pooled receive buffers); "
        f"{platform.platform()}, "
        f"{os.cpu_count()} CPUs, load {report['load_avg_1m']:.1f} (before: {load_before:.1f}), "
        f"commit {report['commit']}, median of {runs} runs"
        + (f", client environment `{' '.join(args.client_env)}`" if args.client_env else "")
        + "\n\n"
        + "\n".join(lines)
        + f"\n\nCPU seconds per GB moved (user + system, median of 2 alternating passes of {cpu_mib} MiB per "
        "method and case):\n\n" + "\n".join(cpu_lines) + "\n"
    )
    if nopool:
        md += (
            "\nReceive pool A/B in the same runs (lane = default client, pooled buffers; no pool = the same lane "
            "reads into a fresh Arrow buffer each):\n\n| unit | streams | lane / TCP | no pool / TCP "
            "| p50 / p99 ms lane, no pool |\n|---|---|---|---|---|\n" + "\n".join(nopool) + "\n"
        )
    args.out.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {args.out.with_suffix('.json')} and .md")
    return 0


def _p50_p99(seconds: list[float]) -> list[float]:
    """p50 and p99 (nearest rank) of run times, in milliseconds."""
    ms = sorted(x * 1e3 for x in seconds)
    return [statistics.median(ms), ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]]


def _commit() -> str:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


if __name__ == "__main__":
    if sys.argv[1:2] == ["tcp-serve"]:
        tcp_serve(sys.argv[2], TCP_PORT)
    elif sys.argv[1:2] == ["write"]:
        print(json.dumps(write_units(Path(sys.argv[3]), sys.argv[2], [int(x) for x in sys.argv[4:]])), flush=True)
    elif sys.argv[1:2] == ["client"]:
        p = argparse.ArgumentParser()
        p.add_argument("client")
        p.add_argument("--endpoint", required=True)
        p.add_argument("--tcp-host", required=True)
        p.add_argument("--units", required=True)
        p.add_argument("--runs", type=int, required=True)
        p.add_argument("--cpu-mib", type=int, required=True)
        p.add_argument("--store-pid", type=int, required=True)
        p.add_argument("--tcp-pid", type=int, required=True)
        p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
        p.add_argument("--pool-ab", action="store_true")
        client_main(p.parse_args())
    else:
        sys.exit(main())
