"""Transfer benchmark: DoGet vs raw TCP vs memcpy, same-host short-circuit, latency floor, Arrow->torch.

One command: ``python benchmarks/transfer/run.py [--quick] [--runs N] [--json PATH]``. Prints a table
and writes JSON (default ``benchmarks/transfer/results/transfer.json``). Every figure is the median of
``--runs`` repetitions; baselines are measured in the same run. The store runs as a separate
``knittrans store`` process on 127.0.0.1, as in deployment.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from knittrans.flight.client import StoreClient
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TrajectoryGroup
from knittrans.store import LocalReader
from knittrans.tickets import Ticket, UnitRead
from knittrans.trainer.convert import to_micro_batch

MiB = 1 << 20
PROMPT, RESPONSE, GROUP = 256, 2048, 8


def log(msg: str) -> None:
    print(f"[transfer] {msg}", file=sys.stderr, flush=True)


def median_time(fn: Callable[[], Any], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_groups(target_bytes: int, seed: int) -> list[TrajectoryGroup]:
    """Groups whose trajectory table is about ``target_bytes`` (prompt 256, responses ~2048 tokens)."""
    rng = np.random.default_rng(seed)
    per_row = PROMPT * 4 + RESPONSE * 9 + 64
    rows = max(GROUP, target_bytes // per_row // GROUP * GROUP)
    groups = []
    for g in range(rows // GROUP):
        lens = rng.integers(RESPONSE // 2, RESPONSE * 3 // 2, GROUP)
        groups.append(
            TrajectoryGroup(
                group_id=f"g{g}",
                source="math",
                prompt_ids=rng.integers(0, 150_000, PROMPT, dtype=np.int32),
                response_ids=[rng.integers(0, 150_000, n, dtype=np.int32) for n in lens],
                response_logprobs=[-rng.random(n, dtype=np.float32) for n in lens],
                rewards=rng.random(GROUP).astype(np.float32),
                version_start=0,
                version_end=1,
            )
        )
    return groups


def tcp_copy(payload: memoryview, sink: bytearray) -> float:
    """Seconds to send ``payload`` over a loopback TCP socket (server thread sendall, client recv_into)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.sendall(payload)
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    cli = socket.create_connection(srv.getsockname())
    view, got = memoryview(sink), 0
    t0 = time.perf_counter()
    while got < len(payload):
        n = cli.recv_into(view[got:], min(16 * MiB, len(payload) - got))
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t0
    cli.close()
    thread.join()
    srv.close()
    assert got == len(payload)
    return dt


def touch_copy(table: pa.Table) -> int:
    """Copy every buffer of a (memory-mapped) table into fresh memory, as a DoGet would deliver it."""
    total = 0
    for col in table.columns:
        for chunk in col.chunks:
            for buf in chunk.buffers():
                if buf is not None:
                    dst = np.empty(buf.size, np.uint8)
                    np.copyto(dst, np.frombuffer(buf, np.uint8))
                    total += buf.size
    return total


def naive_padding(table: pa.Table) -> torch.Tensor:
    """The path to beat: Python lists, per-row padding, torch.tensor."""
    rows = table.column("response_ids").to_pylist()
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    lp = table.column("response_logprobs").to_pylist()
    torch.tensor([r + [0.0] * (width - len(r)) for r in lp])
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB only, 3 runs")
    parser.add_argument("--runs", type=int, default=None, help="repetitions per figure (default 7, quick 3)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "transfer.json")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 7)
    sizes = [1, 16] if args.quick else [1, 16, 256]
    root = Path(tempfile.mkdtemp(prefix="knittrans-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ready = root / "endpoint"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "knittrans.cli",
            "--log-level",
            "WARNING",
            "store",
            "--dir",
            str(root / "store"),
            "--port",
            "0",
            "--ready-file",
            str(ready),
        ]
    )
    results: dict[str, Any] = {"runs": runs, "machine": platform.platform(), "cpus": __import__("os").cpu_count()}
    rows_out: list[tuple[str, str, str]] = []
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise SystemExit("store process exited")
            time.sleep(0.05)
        endpoint = ready.read_text()
        writer = TrajectoryWriter(job="bench", node_id="node-0", endpoint=endpoint, store_dir=root / "store")
        client, local = StoreClient(endpoint), LocalReader([root / "store"])
        throughput = {}
        for size in sizes:
            log(f"building and writing {size} MiB unit")
            desc = writer.write_groups(make_groups(size * MiB, seed=size), unit_id=f"u{size}")
            read = Ticket(job="bench", reads=(UnitRead(unit_id=desc.unit_id),))
            nbytes = client.get(read).nbytes
            log(f"{size} MiB: DoGet")
            t_get = median_time(lambda r=read: client.get(r), runs)
            log(f"{size} MiB: TCP loopback and memcpy")
            payload = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))
            sink = bytearray(nbytes)
            t_tcp = statistics.median([tcp_copy(payload, sink) for _ in range(runs)])
            dst = np.empty(nbytes, np.uint8)
            src = np.frombuffer(payload, np.uint8)
            t_mem = median_time(lambda d=dst, s=src: np.copyto(d, s), runs)
            log(f"{size} MiB: short-circuit")
            assert local.read(read).equals(client.get(read))
            t_map = median_time(lambda r=read: local.read(r), runs)
            t_map_copy = median_time(lambda r=read: touch_copy(local.read(r)), runs)
            times = {"doget": t_get, "tcp": t_tcp, "memcpy": t_mem, "local_view": t_map, "local_copy": t_map_copy}
            gbps = {k: nbytes / v / 1e9 for k, v in times.items()}
            throughput[f"{size}MiB"] = {
                "bytes": nbytes,
                "GBps": gbps,
                "doget_vs_tcp": gbps["doget"] / gbps["tcp"],
                "local_view_vs_doget": gbps["local_view"] / gbps["doget"],
                "local_copy_vs_doget": gbps["local_copy"] / gbps["doget"],
            }
            rows_out += [
                (
                    f"DoGet {size} MiB",
                    f"{gbps['doget']:.2f} GB/s",
                    f"{gbps['doget'] / gbps['tcp']:.2f}x TCP "
                    f"({gbps['tcp']:.2f}), {gbps['doget'] / gbps['memcpy']:.2f}x memcpy ({gbps['memcpy']:.2f})",
                ),
                (
                    f"short-circuit {size} MiB",
                    f"{gbps['local_view']:.1f} GB/s",
                    f"{gbps['local_view'] / gbps['doget']:.0f}x DoGet (mmap views, {t_map * 1e3:.2f} ms)",
                ),
                (
                    f"short-circuit+copy {size} MiB",
                    f"{gbps['local_copy']:.2f} GB/s",
                    f"{gbps['local_copy'] / gbps['doget']:.1f}x DoGet (every byte copied out, pessimistic)",
                ),
            ]
        results["throughput"] = throughput
        log("tiny DoGet latency")
        tiny = Ticket(job="bench", reads=(UnitRead(unit_id="u1", row_ranges=((0, 1),)),), columns=("reward",))
        t_tiny = median_time(lambda: client.get(tiny), 50 * runs, warmup=20)
        results["tiny_doget_ms"] = t_tiny * 1e3
        rows_out.append(("tiny DoGet (1 row, 1 col)", f"{t_tiny * 1e3:.3f} ms", "target <= 1 ms"))
        log("Arrow -> torch conversion")
        big = local.read(Ticket(job="bench", reads=(UnitRead(unit_id=f"u{sizes[-1]}"),)))
        conv: dict[str, Any] = {}
        for rows in (16, 64, 256):
            mb_table = big.slice(0, rows)
            t_fast = median_time(lambda t=mb_table: to_micro_batch(t), 20 * runs, warmup=5)
            t_pack = median_time(lambda t=mb_table: to_micro_batch(t).pack(), 5 * runs, warmup=2)
            t_naive = median_time(lambda t=mb_table: naive_padding(t), runs)
            conv[str(rows)] = {
                "to_micro_batch_us": t_fast * 1e6,
                "with_pack_us": t_pack * 1e6,
                "naive_ms": t_naive * 1e3,
                "speedup": t_naive / t_fast,
            }
            rows_out.append(
                (
                    f"to_micro_batch {rows} rows",
                    f"{t_fast * 1e6:.1f} us",
                    f"{t_naive / t_fast:.0f}x naive ({t_naive * 1e3:.1f} ms); +pack() {t_pack * 1e6:.0f} us",
                )
            )
        results["conversion"] = conv
        client.close()
        writer.close()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)
    big_key = f"{sizes[-1]}MiB"
    results["targets"] = {
        f"doget_{big_key}_vs_tcp>=0.6": results["throughput"][big_key]["doget_vs_tcp"] >= 0.6,
        "short_circuit_vs_doget>=3": results["throughput"][big_key]["local_view_vs_doget"] >= 3,
        "conversion_vs_naive>=100": results["conversion"]["16"]["speedup"] >= 100,
        "tiny_doget<=1ms": results["tiny_doget_ms"] <= 1.0,
    }
    width = max(len(r[0]) for r in rows_out)
    print(f"\n{'measurement'.ljust(width)}  {'median':>12}  comparison (same run, {runs} runs)")
    for name, value, note in rows_out:
        print(f"{name.ljust(width)}  {value:>12}  {note}")
    print("targets:", ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in results["targets"].items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
