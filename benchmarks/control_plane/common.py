"""Shared pieces of the control-plane benchmarks: a real server process, job specs and unit bodies."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

import knittrans
from knittrans.procs import control_plane_args, knittrans_command

SOURCES = ("math", "code", "chat", "mm_qa")
GROUP_SIZE = 8
TOKEN_W, TOKEN_A = "bench-worker", "bench-admin"


def child_env(tree: str | Path | None = None) -> dict[str, str]:
    """This process's environment with ``tree`` (default: the directory this process imported ``knittrans``
    from) first on ``PYTHONPATH``. ``python -m`` puts its working directory before ``PYTHONPATH``, so a server
    started from a checkout would run that checkout's package whatever ``PYTHONPATH`` says: the callers also
    start it in a directory of its own."""
    root = str(Path(tree) if tree is not None else Path(knittrans.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


class Server:
    """``knittrans control-plane`` in a subprocess on a free port (its ready file), with a psutil handle."""

    def __init__(self, work: Path, *, node_timeout_s: float = 86400, tokens: bool = True) -> None:
        ready = work / "cp.ready"
        args = control_plane_args(work / "cp.db", ready_file=ready, node_timeout_s=node_timeout_s, log_level="WARNING")
        env = child_env()  # the package this process runs, not one in the caller's working directory
        if tokens:
            env.update(KNITTRANS_WORKER_TOKEN=TOKEN_W, KNITTRANS_ADMIN_TOKEN=TOKEN_A)
        self.log = open(work / "cp.log", "wb")  # noqa: SIM115  # kept open for the server's lifetime
        cmd = knittrans_command(*args)
        self.proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"control plane did not start: {(work / 'cp.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["url"]
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        """CPU seconds the server process used so far (user + system, all its threads)."""
        t = self.ps.cpu_times()
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
        self.log.close()


def start_server(db: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A server without tokens on ``db`` (no heartbeats expected): its process and URL."""
    server = Server(db.parent, tokens=False)
    return server.proc, server.url


def unit(job: str, i: int, source: str, t: float, *, nodes: int = 8, tokens: int | None = None) -> dict[str, Any]:
    """Unit ``u{i}`` holding one 8-trajectory group ``g{i}`` of ``source`` on node ``n{i % nodes}``."""
    toks = [tokens or 200 + (i * 37 + k * 101) % 1800 for k in range(GROUP_SIZE)]
    return {
        "unit_id": f"u{i}",
        "job": job,
        "node_id": f"n{i % nodes}",
        "endpoint": f"grpc://127.0.0.1:{9000 + i % nodes}",
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


def create_job(c: httpx.Client, name: str, *, quotas: dict[str, int], k: int, w: int, **extra: Any) -> None:
    spec = {
        "name": name,
        "group_size": GROUP_SIZE,
        "quotas": quotas,
        "mini_batches_per_step": k,
        "policy": "constraint_preserving",
        "world_size": w,
        **({} if "micro_batch_size" in extra else {"micro_batch_tokens": 16384}),
        **extra,
    }
    c.post("/v1/jobs", json=spec).raise_for_status()


def register_nodes(c: httpx.Client, nodes: int) -> float:
    """Register nodes ``n0``..; returns the heartbeat interval the server asks of them (2 s, the store's
    old fixed default, from a server that does not say)."""
    interval = 2.0
    for i in range(nodes):
        body = {"node_id": f"n{i}", "endpoint": f"grpc://127.0.0.1:{9000 + i}", "host": f"h{i}"}
        answer = c.post("/v1/nodes", json=body)
        answer.raise_for_status()
        interval = float(answer.json().get("heartbeat_s", interval))
    return interval


def write_results(out: Path, fields: dict[str, Any], table_lines: list[str]) -> dict[str, Any]:
    """Write ``out`` (JSON: commit, date, machine, load at start, then ``fields``) and ``out`` with ``.md``
    (a line naming those, then ``table_lines``); print the table. Returns the JSON document."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    doc = {
        "commit": commit.stdout.strip(),
        "package": str(Path(knittrans.__file__).resolve().parent),  # what the client and the server ran
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_at_start": os.getloadavg(),
        **fields,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    header = f"Commit {doc['commit']}, {doc['date']}, {os.cpu_count()} CPUs, load {doc['load_at_start']}"
    out.with_suffix(".md").write_text(header + "\n\n" + "\n".join(table_lines) + "\n")
    print("\n".join(table_lines))
    return doc
