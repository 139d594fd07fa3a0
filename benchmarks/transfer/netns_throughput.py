"""Cross-host throughput: Flight DoGet vs a raw TCP socket over the same veth link, 1 and 4 streams.

One command (root, ``ip netns``): ``python benchmarks/transfer/netns_throughput.py [--quick] [--runs N]``.
Two network namespaces, ``store`` and ``trainer``, joined by veth pairs through a bridge (the lab of
``tests/netns_support.py``: nothing in the root namespace is touched). The store namespace runs a real
``knittrans store`` process and a raw TCP sender; the trainer namespace runs the client half of this
script, which times

* ``doget``: a whole unit read with S parallel DoGets (contiguous row ranges, one connection each);
* ``tcp``: the same number of bytes received over S raw TCP connections (``sendall`` / ``recv_into``),

for units of 16 and 256 MiB and S = 1 and 4. Every figure is the median of ``--runs`` repetitions,
measured alternately in one run; the ratio ``doget / tcp`` is the headline (target >= 0.8 with 4
streams). Writes JSON + markdown to ``benchmarks/transfer/results/netns_throughput.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
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


def doget(clients: list[Any], tickets: list[Any]) -> tuple[float, int]:
    """Seconds and payload bytes of reading ``tickets`` in parallel, one client (connection) each."""
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


def client_main(args: argparse.Namespace) -> None:
    """Runs in the trainer namespace: alternate DoGet and raw TCP for every size and stream count."""
    from knittrans.flight.client import StoreClient
    from knittrans.tickets import Ticket, UnitRead

    units = json.loads(args.units)  # {size_mib: [unit_id, rows]}
    out: dict[str, Any] = {}
    for size, (unit_id, rows) in units.items():
        for streams in args.streams:
            bounds = [rows * i // streams for i in range(streams + 1)]
            tickets = [
                Ticket(job="bench", reads=(UnitRead(unit_id=unit_id, row_ranges=((lo, hi),)),))
                for lo, hi in itertools.pairwise(bounds)
            ]
            clients = [StoreClient(args.endpoint, token=TOKEN, timeout_s=300) for _ in range(streams)]
            doget(clients, tickets)  # warm-up: connections, page cache of the store's mmap
            nbytes = doget(clients, tickets)[1]
            tcp_receive(args.tcp_host, TCP_PORT, nbytes, streams)
            t_get, t_tcp = [], []
            for _ in range(args.runs):
                t_get.append(doget(clients, tickets)[0])
                t_tcp.append(tcp_receive(args.tcp_host, TCP_PORT, nbytes, streams))
            for c in clients:
                c.close()
            get_gbps = [nbytes / t / 1e9 for t in t_get]
            tcp_gbps = [nbytes / t / 1e9 for t in t_tcp]
            key = f"{size}MiB_x{streams}"
            out[key] = {
                "bytes": nbytes,
                "streams": streams,
                "runs": args.runs,
                "doget_GBps_median": statistics.median(get_gbps),
                "tcp_GBps_median": statistics.median(tcp_gbps),
                "doget_GBps": get_gbps,
                "tcp_GBps": tcp_gbps,
                "ratio_median": statistics.median(get_gbps) / statistics.median(tcp_gbps),
            }
            print(
                f"[netns] {key}: DoGet {out[key]['doget_GBps_median']:.2f} GB/s, "
                f"TCP {out[key]['tcp_GBps_median']:.2f} GB/s",
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
    parser.add_argument("--out", type=Path, default=HERE / "results" / "netns_throughput")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 7)
    sizes = [16] if args.quick else [16, 256]
    if os.geteuid() != 0:
        log("needs root for ip netns; nothing measured")
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    from netns_support import lab

    from knittrans.procs import ProcessGroup, knittrans_command, wait_until

    work = Path(tempfile.mkdtemp(prefix="knittrans-netns-", dir="/dev/shm"))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with lab(["store", "trainer"]) as the_lab, ProcessGroup(work / "logs") as procs:
        store_ip = the_lab.hosts["store"]
        endpoint = f"grpc://{store_ip}:{STORE_PORT}"
        ready = work / "store.ready"
        procs.start(
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
        "commit": _commit(),
        "runs": runs,
        "results": results,
        "target_4_streams_ratio>=0.8": {k: v["ratio_median"] >= 0.8 for k, v in results.items() if v["streams"] == 4},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = ["| unit | streams | DoGet GB/s | raw TCP GB/s | DoGet / TCP |", "|---|---|---|---|---|"]
    for r in results.values():
        lines.append(
            f"| {r['bytes'] / MiB:.0f} MiB | {r['streams']} | {r['doget_GBps_median']:.2f} | "
            f"{r['tcp_GBps_median']:.2f} | {r['ratio_median']:.2f} |"
        )
    md = (
        f"# Cross-host throughput (veth between network namespaces)\n\n{platform.platform()}, "
        f"{os.cpu_count()} CPUs, load {report['load_avg_1m']:.1f}, commit {report['commit']}, median of {runs} "
        f"runs\n\n" + "\n".join(lines) + "\n"
    )
    args.out.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {args.out.with_suffix('.json')} and .md")
    return 0


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
        p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
        client_main(p.parse_args())
    else:
        sys.exit(main())
