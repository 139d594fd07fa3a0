"""Control plane at cluster scale: a real server, simulated clients (asyncio, one process, loopback).

Run: ``python benchmarks/control_plane/scale.py [--smoke] [--ranks 1024] [--nodes 128] [--rate 1000]
[--seconds 60] [--rows-per-rank 1] [--ack-mode next|post|stream|stream-post] [--think-ms 0]
[--mini-batches 10000]``. Three phases
against one ``knittrans control-plane`` process (SQLite WAL in a temp dir), each on its own job:

* ``delivery``: ``--ranks`` ranks long-poll ``next`` on their own keep-alive connection, ``--nodes`` store
  nodes heartbeat every 2 s, a rollout writer registers one-group units at ``--rate`` groups/s (batched
  every 100 ms) for ``--seconds``. Each mini-batch holds ``--rows-per-rank`` rows per rank (1, the stress
  case: ~8 mini-batches/s at 1,024 ranks; 8: a realistic 8,192-trajectory mini-batch, ~1/s). A rank acks
  its plan as soon as it has it and asks for the next: in one request (``next?ack=<plan_id>``,
  ``--ack-mode next``) or two (``POST .../ack`` then ``next``, ``--ack-mode post``); or each rank holds
  one plan stream (``.../plans``) for the whole run and reads its plans as lines, acking as lines of the
  stream's chunked request body (``--ack-mode stream``) or by ``POST .../ack`` (``--ack-mode
  stream-post``, what the trainer client does). ``--think-ms`` (default 0) is the rank's compute time per
  plan: a rank that has a plan "trains" that long before it acks and asks for the next one, as a
  trainer does between mini-batches (1,000 groups/s of 128-group mini-batches is ~128 ms each); with 0
  every rank acks at once and its ack competes with the next admission's plans. Reported: plan
  delivery latency (the plan's ``admitted_at``, set by the server when it admitted the mini-batch, to
  the moment the rank has parsed the plan; same host, same clock; for the stream modes with
  ``--stream-client socket`` also the kernel's receive time at the rank's socket, see ``streamrank.py``),
  registration request latency, mini-batches consumed, server CPU per mini-batch and its share of one
  core, requests/s (so a reader sees whether the server was saturated).
* ``registration``: batches of ``--batch`` one-group units posted back to back to a job with one rank
  that never consumes; units/s (target >= 20,000).
* ``memory``: one rank, one group per mini-batch, ``--mini-batches`` mini-batches registered, planned,
  fetched and acked one after another; the server's RSS and ``/status`` latency sampled along the way
  (target: RSS growth <= 10 % from mini-batch 1,000 to the end).

The clients speak HTTP/1.1 over asyncio streams directly (a small keep-alive client in this file), so
the client side costs far less CPU than the server it measures. Results:
``benchmarks/control_plane/results/scale.{json,md,png}`` with machine, load and commit.
"""

from __future__ import annotations

import argparse
import asyncio
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

import psutil
from streamrank import Arrivals, StreamRank

from knittrans.procs import control_plane_args, knittrans_command

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TOKEN_W, TOKEN_A = "scale-worker", "scale-admin"
GROUP = 8


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "mean": statistics.fmean(values) if values else None,
        "p50": pct(values, 0.5),
        "p99": pct(values, 0.99),
        "max": max(values) if values else None,
    }


class Http:
    """One keep-alive HTTP/1.1 connection (JSON bodies, Content-Length responses)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self, method: str, path: str, body: Any = None, timeout_s: float = 120.0) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._call(method, path, body), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{method} {path}: no answer within {timeout_s:g} s") from None

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        for attempt in range(2):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            try:
                self.writer.write(head.encode() + data)
                await self.writer.drain()
                line = await self.reader.readline()
            except ConnectionError:
                line = b""
            if line:
                break
            # the server closed the idle keep-alive connection (uvicorn: after 5 s): reconnect once
            self.close()
            if attempt:
                raise RuntimeError(f"{method} {path}: connection closed by the server")
        status = int(line.split()[1])
        reader = self.reader
        assert reader is not None
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await reader.readexactly(length) if length else b""

    async def json(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201)) -> Any:
        status, raw = await self.call(method, path, body)
        if status not in ok:
            raise RuntimeError(f"{method} {path} -> {status}: {raw[:300]!r}")
        return json.loads(raw) if raw else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def unit(job: str, uid: str, node: str, source: str, version: int) -> dict[str, Any]:
    return {
        "unit_id": uid,
        "job": job,
        "node_id": node,
        "endpoint": f"grpc://127.0.0.1:{10000 + int(node[1:])}",
        "num_rows": GROUP,
        "num_bytes": 4096,
        "schema_version": 1,
        "groups": [
            {
                "group_id": uid,
                "source": source,
                "row_start": 0,
                "num_trajectories": GROUP,
                "trajectory_tokens": [100] * GROUP,
                "version_start": version,
                "version_end": version,
                "version_weighted": float(version),
                "finished_at": time.time(),
                "media_hashes": [],
            }
        ],
    }


class Server:
    """``knittrans control-plane`` in a subprocess on port 0 (ready file), with psutil handles."""

    def __init__(self, work: Path, source: Path | None = None, http: str | None = None, gateway: bool = False) -> None:
        ready = work / "cp.ready"
        prof = os.environ.get("KNITTRANS_SCALE_PROFILE")  # cProfile output path for the server, if set
        args = control_plane_args(
            work / "cp.db",
            ready_file=ready,
            node_timeout_s=30,
            log_level="WARNING",
            extra=[*(["--http", http] if http else []), *(["--plan-gateway-port", "0"] if gateway else [])],
        )
        cmd = [sys.executable, *(["-m", "cProfile", "-o", prof] if prof else []), *knittrans_command(*args)[1:]]
        env = {**os.environ, "KNITTRANS_WORKER_TOKEN": TOKEN_W, "KNITTRANS_ADMIN_TOKEN": TOKEN_A}
        if source is not None:  # another checkout's knittrans (the 'before' of a comparison) runs the server
            env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
        log = open(work / "cp.log", "wb")  # noqa: SIM115  # kept open for the server's lifetime
        self.proc = subprocess.Popen(cmd, env=env, cwd=source, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"control plane did not start: {(work / 'cp.log').read_text()[-2000:]}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port = int(info["port"])
        self.ps = psutil.Process(self.proc.pid)
        self.gateway_port: int | None = None
        self.gateway_ps: psutil.Process | None = None
        if gateway:  # the plan gateway (knittrans.api.gateway), a child process of the server
            self.gateway_port = int(info["plan_gateway"].rsplit(":", 1)[1])
            (self.gateway_ps,) = self.ps.children()

    def cpu_s(self) -> float:
        """CPU time of the server, its plan gateway included (``state_cpu_s`` + ``gateway_cpu_s``)."""
        return self.state_cpu_s() + self.gateway_cpu_s()

    def state_cpu_s(self) -> float:
        """CPU time of the server's own process (the state thread and its event loop)."""
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def gateway_cpu_s(self) -> float:
        if self.gateway_ps is None:
            return 0.0
        t = self.gateway_ps.cpu_times()
        return float(t.user + t.system)

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def spec(name: str, world: int, quotas: dict[str, int], k: int) -> dict[str, Any]:
    return {
        "name": name,
        "group_size": GROUP,
        "quotas": quotas,
        "mini_batches_per_step": k,
        "policy": "constraint_preserving",
        "world_size": world,
        "micro_batch_size": 1,
    }


async def delivery(port: int, server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 1: many ranks long-polling, nodes heartbeating, a writer at a fixed group rate."""
    job = "delivery"
    admin = Http("127.0.0.1", port, TOKEN_A)
    # --rows-per-rank rows per rank per mini-batch: b = ranks * rows / GROUP groups, K = 2
    per_mb = max(1, args.ranks * args.rows_per_rank // GROUP)
    sources = {"math": per_mb, "code": per_mb // 2, "chat": per_mb - per_mb // 2}
    await admin.json("POST", "/v1/jobs", spec(job, args.ranks, sources, 2))
    nodes = [f"n{i}" for i in range(args.nodes)]
    for n in nodes:
        await admin.json(
            "POST",
            "/v1/nodes",
            {"node_id": n, "endpoint": f"grpc://127.0.0.1:{10000 + int(n[1:])}", "host": f"h{n[1:]}"},
        )
    stop = asyncio.Event()
    latencies: list[float] = []
    ages: list[float] = []
    reg_latencies: list[float] = []
    consumed: dict[int, int] = {}
    errors: list[str] = []
    requests = [0]  # HTTP requests the ranks, nodes and writer made during the timed window
    think_s = args.think_ms / 1e3

    async def heartbeats() -> None:
        conns = [Http("127.0.0.1", port, TOKEN_W) for _ in range(4)]
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            beats = [
                conns[j % 4].json("POST", f"/v1/nodes/{n}/heartbeat") for j, n in enumerate(nodes) if j % 4 == i % 4
            ]
            requests[0] += len(beats)
            await asyncio.gather(*beats)
            i += 1
            await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))  # each node every 2 s

    async def writer() -> None:
        conn = Http("127.0.0.1", port, TOKEN_W)
        src = [s for s, q in sources.items() for _ in range(q)]
        per_tick, n = max(1, args.rate // 10), 0
        next_at = time.monotonic()
        while not stop.is_set():
            batch = [
                unit(job, f"u{n + i}", nodes[(n + i) % len(nodes)], src[(n + i) % len(src)], 0) for i in range(per_tick)
            ]
            n += per_tick
            t0 = time.perf_counter()
            await conn.json("POST", f"/v1/jobs/{job}/units", {"units": batch})
            requests[0] += 1
            reg_latencies.append(time.perf_counter() - t0)
            next_at += 0.1
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def rank(r: int) -> None:
        conn = Http("127.0.0.1", port, TOKEN_W)
        acked = ""  # --ack-mode next: the plan to ack on the next long-poll
        while not stop.is_set():
            asked = time.time()
            query = f"&ack={acked}" if acked else ""
            status, raw = await conn.call("GET", f"/v1/jobs/{job}/ranks/{r}/next?timeout_s=30{query}")
            requests[0] += 1
            if acked and status in (200, 204):
                acked = ""
                consumed[r] = consumed.get(r, 0) + 1
            if status == 204:
                continue
            if status != 200:
                errors.append(f"rank {r} next -> {status}: {raw[:200]!r}")
                return
            plan = json.loads(raw)
            now = time.time()
            # delivery: from admission, or from the request when the plan was admitted before the rank asked
            latencies.append(now - max(plan["admitted_at"], asked))
            ages.append(now - plan["admitted_at"])
            if think_s:
                await asyncio.sleep(think_s)  # the rank trains on its plan before it acks
            if args.ack_mode == "next":
                acked = plan["plan_id"]
                continue
            await conn.json("POST", f"/v1/jobs/{job}/ranks/{r}/ack", {"plan_id": plan["plan_id"]})
            requests[0] += 1
            consumed[r] = consumed.get(r, 0) + 1

    streams: list[asyncio.StreamWriter] = []

    async def rank_stream(r: int) -> None:
        """The rank on its plan stream (``.../plans``): acks as lines of the POST's chunked body
        (--ack-mode stream) or by ``POST .../ack`` on a second connection (--ack-mode stream-post)."""
        in_body = args.ack_mode in ("stream", "gateway")
        at = server.gateway_port if args.ack_mode == "gateway" else port
        assert at is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", at)
        streams.append(writer)
        head = (
            f"{'POST' if in_body else 'GET'} /v1/jobs/{job}/ranks/{r}/plans HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {TOKEN_W}\r\n"
            + ("Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n" if in_body else "")
            + "\r\n"
        )
        writer.write(head.encode())
        status = await reader.readline()
        if not status.startswith(b"HTTP/1.1 200"):
            errors.append(f"rank {r} plans -> {status!r}")
            return
        while (line := await reader.readline()) not in (b"\r\n", b""):
            pass
        acks = None if in_body else Http("127.0.0.1", port, TOKEN_W)
        ready = time.time()  # when the rank was ready for its next plan (it had acked the last one)
        while not stop.is_set():
            size = await reader.readline()
            if not size.strip():
                return  # the stream was closed (end of the run)
            chunk = await reader.readexactly(int(size, 16) + 2)
            if int(size, 16) == 0:
                return
            for raw in chunk[:-2].split(b"\n"):
                if not raw.strip():
                    continue
                msg = json.loads(raw)
                if "plan_id" not in msg:
                    if "ack_error" in msg or "done" in msg:
                        errors.append(f"rank {r} stream: {msg}")
                        return
                    continue  # keep-alive
                now = time.time()
                latencies.append(now - max(msg["admitted_at"], ready))
                ages.append(now - msg["admitted_at"])
                if think_s:
                    await asyncio.sleep(think_s)  # the rank trains on its plan before it acks
                ready = time.time()  # from its ack on, the rank waits for its next plan
                if acks is None:
                    line = json.dumps({"ack": msg["plan_id"]}).encode() + b"\n"
                    writer.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                else:
                    await acks.json("POST", f"/v1/jobs/{job}/ranks/{r}/ack", {"plan_id": msg["plan_id"]})
                    requests[0] += 1
                consumed[r] = consumed.get(r, 0) + 1

    arrivals = Arrivals()
    raw_ranks: list[StreamRank] = []

    def acked(r: int) -> None:
        consumed[r] = consumed.get(r, 0) + 1

    async def rank_raw(r: int) -> None:
        """The rank as a raw socket (streamrank.py): --ack-mode stream or gateway, --stream-client socket."""
        at = server.gateway_port if args.ack_mode == "gateway" else port
        assert at is not None
        path = f"/v1/jobs/{job}/ranks/{r}/plans"
        one = await StreamRank.open("127.0.0.1", at, path, TOKEN_W, r, think_s, arrivals, acked, errors.append)
        raw_ranks.append(one)
        await one.closed.wait()

    raw = args.stream_client == "socket" and args.ack_mode in ("stream", "gateway")
    one = rank_raw if raw else rank_stream if args.ack_mode.startswith("stream") or args.ack_mode == "gateway" else rank
    tasks = [asyncio.create_task(one(r)) for r in range(args.ranks)]
    await asyncio.sleep(1.0)  # ranks connected and waiting
    me = psutil.Process()
    cpu0, t0, requests[0] = server.cpu_s(), time.monotonic(), 0
    state0 = server.state_cpu_s()
    own0 = sum(me.cpu_times()[:2])
    bg = [asyncio.create_task(heartbeats()), asyncio.create_task(writer())]
    while time.monotonic() - t0 < args.seconds:
        await asyncio.sleep(min(5.0, args.seconds))
        log(
            f"delivery: {time.monotonic() - t0:.0f}/{args.seconds} s, {min(consumed.values(), default=0)} "
            f"mini-batches acked by every rank, {len(latencies) + len(arrivals.parsed)} plans delivered"
        )
    stop.set()
    elapsed, cpu, made = time.monotonic() - t0, server.cpu_s() - cpu0, requests[0]
    state_cpu = server.state_cpu_s() - state0
    clients_cpu = sum(me.cpu_times()[:2]) - own0
    for w in streams:  # a rank blocked reading its stream sees the end at once
        w.close()
    for raw_rank in raw_ranks:
        raw_rank.close()
    await asyncio.wait(tasks + bg, timeout=10)
    for t in tasks + bg:
        t.cancel()
    if errors:
        raise RuntimeError(f"{len(errors)} rank errors, first: {errors[0]}")
    mbs = min(consumed.values(), default=0)
    if raw:  # the raw-socket ranks keep three times per plan; "delivery" is the one after parsing, as before
        latencies, ages = arrivals.parsed, arrivals.ages
    return {
        "stream_client": "socket" if raw else "asyncio",
        "ranks": args.ranks,
        "nodes": args.nodes,
        "rate_groups_s": args.rate,
        "rows_per_rank": args.rows_per_rank,
        "groups_per_mini_batch": per_mb,
        "ack_mode": args.ack_mode,
        "think_ms": args.think_ms,
        "seconds": elapsed,
        "mini_batches_consumed": mbs,
        "plans_delivered": len(latencies),
        "plan_delivery_ms": summary([x * 1e3 for x in latencies]),
        "plan_age_ms": summary([x * 1e3 for x in ages]),
        # --stream-client socket only: the kernel's receive time at the rank's socket, and the rank's read
        # callback before parsing (see streamrank.py)
        "plan_arrival_ms": summary([x * 1e3 for x in arrivals.kernel]) if raw else None,
        "plan_arrival_user_ms": summary([x * 1e3 for x in arrivals.user]) if raw else None,
        "plans_before_ready": arrivals.early if raw else None,
        "plans_without_kernel_time": arrivals.untimed if raw else None,
        "registration_request_ms": summary([x * 1e3 for x in reg_latencies]),
        "groups_registered_per_s": len(reg_latencies) * max(1, args.rate // 10) / elapsed,
        "server_cpu_s": cpu,
        "server_cpu_share": cpu / elapsed,
        "server_state_process_cpu_share": state_cpu / elapsed,
        "gateway_cpu_share": (cpu - state_cpu) / elapsed,
        "clients_cpu_share": clients_cpu / elapsed,
        "server_cpu_ms_per_mini_batch": cpu / mbs * 1e3 if mbs else None,
        "requests": made,
        "requests_per_s": made / elapsed,
        "server_cpu_us_per_request": cpu / made * 1e6 if made else None,
    }


async def registration(port: int, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 2: back-to-back batches of one-group units into a job whose only rank never consumes."""
    job = "registration"
    admin = Http("127.0.0.1", port, TOKEN_A)
    await admin.json("POST", "/v1/jobs", spec(job, 1, {"math": 128, "code": 64, "chat": 64}, 4))
    await admin.json("POST", "/v1/nodes", {"node_id": "n1000", "endpoint": "grpc://127.0.0.1:11000", "host": "r"})
    conn = Http("127.0.0.1", port, TOKEN_W)
    src = ["math"] * 2 + ["code", "chat"]
    rates, n = [], 0
    for i in range(args.registration_batches):
        batch = [unit(job, f"r{n + j}", "n1000", src[(n + j) % 4], 0) for j in range(args.batch)]
        n += args.batch
        t0 = time.perf_counter()
        await conn.json("POST", f"/v1/jobs/{job}/units", {"units": batch})
        rates.append(args.batch / (time.perf_counter() - t0))
        if i % 5 == 4:
            log(f"registration: {n} units, last batch {rates[-1]:,.0f} units/s")
    return {
        "batch": args.batch,
        "batches": args.registration_batches,
        "units": n,
        "units_per_s_median": statistics.median(rates),
        "units_per_s": rates,
    }


async def memory(port: int, server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 3, the long job, time-compressed: ``--mini-batches`` mini-batches registered, planned and acked
    as fast as the server answers (no think time), with the server's RSS, CPU and ``/status`` sampled."""
    job = "memory"
    admin = Http("127.0.0.1", port, TOKEN_A)
    per_mb = args.mb_groups
    await admin.json("POST", "/v1/jobs", {**spec(job, 1, {"math": per_mb}, 1), "group_size": 1, "lookahead": 64})
    nodes = [f"m{i}" for i in range(min(args.nodes, 16))]
    for node_id in nodes:
        await admin.json(
            "POST", "/v1/nodes", {"node_id": node_id, "endpoint": "grpc://127.0.0.1:11001", "host": node_id}
        )
    conn, rank = Http("127.0.0.1", port, TOKEN_W), Http("127.0.0.1", port, TOKEN_W)
    beat = time.monotonic()
    samples: list[dict[str, float]] = []
    t0, cpu0 = time.monotonic(), server.cpu_s()
    cpu_at, registered, last_cpu = 0, 0, cpu0
    every = max(1, args.mini_batches // 20)
    for n in range(args.mini_batches):
        if time.monotonic() - beat > 2:
            for node in nodes:
                await conn.json("POST", f"/v1/nodes/{node}/heartbeat")
            beat = time.monotonic()
        if registered <= n:  # the writer runs ahead in batches of 32 mini-batches' groups
            batch = []
            for m in range(n, n + 32):
                for j in range(per_mb):
                    u = unit(job, f"m{m}.{j}", nodes[(m + j) % len(nodes)], "math", m)
                    u["num_rows"], u["groups"][0]["num_trajectories"] = 1, 1
                    u["groups"][0]["trajectory_tokens"] = [100]
                    batch.append(u)
            await conn.json("POST", f"/v1/jobs/{job}/units", {"units": batch})
            registered = n + 32
        plan = await rank.json("GET", f"/v1/jobs/{job}/ranks/0/next?timeout_s=10")
        await rank.json("POST", f"/v1/jobs/{job}/ranks/0/ack", {"plan_id": plan["plan_id"]})
        done = n + 1
        if done % every == 0 or done == 1000:
            s0 = time.perf_counter()
            raw = (await conn.call("GET", f"/v1/jobs/{job}/status"))[1]
            status_ms = (time.perf_counter() - s0) * 1e3
            cpu = server.cpu_s()
            samples.append(
                {
                    "mini_batch": done,
                    "rss_mib": server.rss_mib(),
                    "status_ms": status_ms,
                    "status_bytes": len(raw),
                    "elapsed_s": time.monotonic() - t0,
                    "cpu_ms_per_mini_batch": (cpu - last_cpu) / (done - cpu_at) * 1e3,
                }
            )
            cpu_at, last_cpu = done, cpu
            log(
                f"memory: {done}/{args.mini_batches} mini-batches, server RSS {samples[-1]['rss_mib']:.1f} MiB, "
                f"/status {status_ms:.1f} ms"
            )
    at_1000 = next((s for s in samples if s["mini_batch"] >= 1000), samples[0])
    last = samples[-1]
    return {
        "mini_batches": args.mini_batches,
        "groups_per_mini_batch": per_mb,
        "samples": samples,
        "seconds": time.monotonic() - t0,
        "server_cpu_ms_per_mini_batch": (server.cpu_s() - cpu0) / args.mini_batches * 1e3,
        "rss_mib_at_1000": at_1000["rss_mib"],
        "rss_mib_at_end": last["rss_mib"],
        "rss_growth": last["rss_mib"] / at_1000["rss_mib"] - 1,
        "status_ms_at_1000": at_1000["status_ms"],
        "status_ms_at_end": last["status_ms"],
        "status_bytes_at_1000": at_1000["status_bytes"],
        "status_bytes_at_end": last["status_bytes"],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    samples = result["memory"]["samples"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot([s["mini_batch"] for s in samples], [s["rss_mib"] for s in samples], marker=".")
    ax[0].set(xlabel="mini-batches consumed", ylabel="server RSS (MiB)", title="control-plane memory")
    ax[1].plot([s["mini_batch"] for s in samples], [s["status_ms"] for s in samples], marker=".")
    ax[1].set(xlabel="mini-batches consumed", ylabel="GET /status (ms)", title="status cost vs job length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="32 ranks, 8 nodes, 3 s, 300 mini-batches: a run of well under a minute (CI)",
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--rate", type=int, default=1000, help="groups/s the writer registers")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--rows-per-rank",
        type=int,
        default=1,
        help="rows per rank per mini-batch in the delivery phase (1: the stress case, ~8 mini-batches/s at "
        "1,024 ranks and 1,000 groups/s; 8: 8,192 trajectories a mini-batch, ~1 mini-batch/s)",
    )
    parser.add_argument(
        "--ack-mode",
        choices=["post", "next", "stream", "stream-post", "gateway"],
        default="next",
        help="how a rank gets its plans and acks in the delivery phase: 'post' (POST .../ack, then GET .../next: "
        "two requests per mini-batch), 'next' (GET .../next?ack=<plan_id>: one request; servers before issue 18 "
        "lack it), 'stream' (one POST .../plans per rank for the whole run: plans are lines of its response, acks "
        "lines of its chunked body), 'stream-post' (GET .../plans, acks by POST .../ack) or 'gateway' (as 'stream', "
        "on the plan gateway's port: the server runs with --plan-gateway-port 0)",
    )
    parser.add_argument(
        "--think-ms",
        type=float,
        default=0.0,
        help="delivery phase: how long a rank computes on each plan before it acks and asks for the next "
        "(0: at once, every rank's ack competes with the next admission's plans)",
    )
    parser.add_argument(
        "--stream-client",
        choices=["socket", "asyncio"],
        default="socket",
        help="delivery phase, --ack-mode stream or gateway: how a simulated rank reads its stream. 'socket' (a raw "
        "non-blocking socket with SO_TIMESTAMPNS: the plan's arrival is the kernel's receive time, and the time "
        "after parsing is reported too; streamrank.py) or 'asyncio' (asyncio streams: readline, readexactly, "
        "json.loads, then the time; the client before 2026-12-03)",
    )
    parser.add_argument("--batch", type=int, default=500, help="units per registration request (phase 2; at most 512)")
    parser.add_argument("--registration-batches", type=int, default=20)
    parser.add_argument("--mini-batches", type=int, default=10_000)
    parser.add_argument("--mb-groups", type=int, default=1, help="groups per mini-batch in the long job (phase 3)")
    parser.add_argument("--server-label", default=None, help="what --server-source is (its commit)")
    parser.add_argument(
        "--server-http",
        choices=["auto", "h11", "httptools"],
        default=None,
        help="the server's --http (uvicorn's HTTP parser); default: the server's own default",
    )
    parser.add_argument("--phases", nargs="+", default=["delivery", "registration", "memory"])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scale")
    parser.add_argument(
        "--server-source",
        type=Path,
        default=None,
        help="directory holding another checkout's knittrans package to run as the server "
        "(e.g. `git archive <commit> knittrans | tar -x -C DIR`: the 'before' figures)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.nodes, args.seconds, args.mini_batches = 32, 8, 3.0, 300
        args.registration_batches, args.batch = 3, 500
        args.rate = min(args.rate, 100)
    work = Path(tempfile.mkdtemp(prefix="knittrans-scale-"))
    server = Server(work, args.server_source, args.server_http, gateway=args.ack_mode == "gateway")
    log(f"control plane pid {server.proc.pid} on port {server.port}; phases {args.phases}")
    result: dict[str, Any] = {
        "benchmark": "control_plane_scale",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_1m_start": os.getloadavg()[0],
        "load_avg_1m_end": None,
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "server": args.server_label or ("worktree" if args.server_source is None else str(args.server_source)),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    try:
        if "delivery" in args.phases:
            result["delivery"] = asyncio.run(delivery(server.port, server, args))
        if "registration" in args.phases:
            result["registration"] = asyncio.run(registration(server.port, args))
        if "memory" in args.phases:
            result["memory"] = asyncio.run(memory(server.port, server, args))
    finally:
        server.stop()
    result["load_avg_1m_end"] = os.getloadavg()[0]
    targets: dict[str, bool] = {}
    if "delivery" in result and (arrival := result["delivery"]["plan_arrival_ms"]) and arrival["p99"] is not None:
        targets["plan_arrival_at_rank_socket_p99<=50ms"] = arrival["p99"] <= 50
    elif "delivery" in result and result["delivery"]["plan_delivery_ms"]["p99"] is not None:
        targets["plan_delivery_p99<=50ms"] = result["delivery"]["plan_delivery_ms"]["p99"] <= 50
    if "registration" in result:
        targets["registration>=20000_units_s"] = result["registration"]["units_per_s_median"] >= 20_000
    if "memory" in result:
        targets["rss_growth_1000_to_end<=10%"] = result["memory"]["rss_growth"] <= 0.10
    result["targets"] = targets
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Control plane at scale\n\n{result['machine']}, {result['cpus']} CPUs, load "
        f"{result['load_avg_1m_start']:.1f} at start, commit {result['commit']}, server {result['server']}\n"
    ]
    if "delivery" in result:
        d = result["delivery"]
        pdm, reg = d["plan_delivery_ms"], d["registration_request_ms"]
        lines += [
            f"## Delivery: {d['ranks']} ranks, {d['nodes']} nodes, {d['rate_groups_s']} groups/s, "
            f"{d['seconds']:.0f} s\n",
            "| figure | p50 | p99 | max |",
            "|---|---|---|---|",
            f"| plan delivery after admission, rank has parsed it (ms) | {pdm['p50']:.1f} | {pdm['p99']:.1f} "
            f"| {pdm['max']:.1f} |"
            if pdm["p50"] is not None
            else "| plan delivery after admission, rank has parsed it (ms) | – | – | – |",
            *(
                [
                    f"| plan arrival at the rank's socket, kernel time (ms) | {arr['p50']:.1f} | {arr['p99']:.1f} "
                    f"| {arr['max']:.1f} |"
                ]
                if (arr := d.get("plan_arrival_ms")) and arr["p50"] is not None
                else []
            ),
            f"| registration request (ms) | {reg['p50']:.1f} | {reg['p99']:.1f} | {reg['max']:.1f} |"
            if reg["p50"] is not None
            else "| registration request (ms) | – | – | – |",
            "",
            f"{d['rows_per_rank']} rows per rank ({d['groups_per_mini_batch']} groups per mini-batch), acks via "
            f"{d['ack_mode']!r}, think time {d['think_ms']:g} ms; mini-batches consumed: "
            f"{d['mini_batches_consumed']}; server CPU per mini-batch: "
            f"{d['server_cpu_ms_per_mini_batch'] or float('nan'):.1f} ms; server CPU busy "
            f"{d['server_cpu_share'] * 100:.0f} % of one core (simulated clients "
            f"{d['clients_cpu_share'] * 100:.0f} %); "
            f"{d['requests_per_s']:,.0f} requests/s "
            f"({d['server_cpu_us_per_request'] or float('nan'):.0f} µs server CPU each)\n",
        ]
    if "registration" in result:
        r = result["registration"]
        lines += [
            f"## Registration\n\n{r['units_per_s_median']:,.0f} units/s (median of {r['batches']} batches of "
            f"{r['batch']} one-group units)\n"
        ]
    if "memory" in result:
        m = result["memory"]
        lines += [
            f"## Memory over {m['mini_batches']} mini-batches\n",
            f"RSS {m['rss_mib_at_1000']:.1f} MiB at 1,000 -> {m['rss_mib_at_end']:.1f} MiB at the end "
            f"({m['rss_growth'] * 100:+.1f} %); /status {m['status_ms_at_1000']:.1f} -> "
            f"{m['status_ms_at_end']:.1f} ms\n",
        ]
        plot(result, args.out.with_suffix(".png"))
    lines.append("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items()))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
