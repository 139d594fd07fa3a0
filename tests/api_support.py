"""Helpers shared by the control-plane tests: job specs, unit descriptors, rank drivers, a real server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from knittrans.api import Settings, create_app
from knittrans.manifest import Manifest, RankPlan
from knittrans.procs import control_plane_args, knittrans_command, stop_process, wait_ready

ENDPOINT = "grpc://127.0.0.1:{port}"


def app_client(db: str | Path, **settings: Any) -> TestClient:
    """The real control-plane app on SQLite file ``db`` (other ``Settings`` fields from ``settings``) in a
    ``TestClient``; use it as a context manager, which runs the app's lifespan (state thread, sweeper)."""
    return TestClient(create_app(Settings(db_path=str(db), **settings)))


def job_spec(**overrides: Any) -> dict[str, Any]:
    """A valid two-source job spec, with fields replaced by ``overrides``.

    Its lookahead is large (admit every mini-batch the policy allows at once): these tests pin admission
    content, flows and restarts; tests/test_api_timing.py pins the lookahead itself.
    """
    spec: dict[str, Any] = {
        "name": "job1",
        "group_size": 2,
        "quotas": {"math": 4, "code": 2},
        "mini_batches_per_step": 3,
        "policy": "constraint_preserving",
        "world_size": 2,
        "micro_batch_size": 2,
        "lookahead": 64,
    }
    spec.update(overrides)
    return spec


def group(
    group_id: str,
    source: str,
    *,
    row_start: int = 0,
    size: int = 2,
    finished_at: float = 0.0,
    version: int = 0,
    tokens: Sequence[int] | None = None,
    media: Sequence[str] = (),
) -> dict[str, Any]:
    """A group record body."""
    toks = list(tokens) if tokens is not None else [10 + i for i in range(size)]
    return {
        "group_id": group_id,
        "source": source,
        "row_start": row_start,
        "num_trajectories": size,
        "trajectory_tokens": toks,
        "version_start": version,
        "version_end": version,
        "version_weighted": float(version),
        "finished_at": finished_at,
        "media_hashes": list(media),
    }


def unit(
    unit_id: str, groups: Sequence[dict[str, Any]], *, job: str = "job1", node: str = "n0", port: int = 1
) -> dict[str, Any]:
    """A unit descriptor body whose groups are laid out one after another from row 0."""
    row = 0
    laid = []
    for g in groups:
        laid.append({**g, "row_start": row})
        row += g["num_trajectories"]
    return {
        "unit_id": unit_id,
        "job": job,
        "node_id": node,
        "endpoint": ENDPOINT.format(port=port),
        "num_rows": row,
        "num_bytes": 100 * row,
        "schema_version": 1,
        "groups": laid,
    }


def one_group_unit_body(**group_changes: Any) -> dict[str, Any]:
    """Unit ``u0`` of ``job1`` on ``n0`` with one 2-trajectory group ``g0`` whose fields ``group_changes``
    replace: the body validation tests vary one field of it."""
    g: dict[str, Any] = {
        "group_id": "g0",
        "source": "math",
        "row_start": 0,
        "num_trajectories": 2,
        "trajectory_tokens": [3, 4],
        "version_start": 1,
        "version_end": 2,
        "version_weighted": 1.5,
        "finished_at": 10.0,
        "media_hashes": [],
    }
    g.update(group_changes)
    return {
        "unit_id": "u0",
        "job": "job1",
        "node_id": "n0",
        "endpoint": "grpc://127.0.0.1:1",
        "num_rows": 2,
        "num_bytes": 10,
        "schema_version": 1,
        "groups": [g],
    }


def single_group_units(
    sources: Sequence[str], *, job: str = "job1", node: str = "n0", size: int = 2, prefix: str = "g", start: int = 0
) -> list[dict[str, Any]]:
    """One unit per group, ``sources[i]`` for group ``i``, finishing in list order."""
    return [
        unit(f"u-{prefix}{i}", [group(f"{prefix}{i}", s, size=size, finished_at=1000.0 + i)], job=job, node=node)
        for i, s in enumerate(sources, start=start)
    ]


def register_from_threads(client: Any, *, threads: int = 4, each: int = 5) -> list[BaseException]:
    """``threads`` threads each registering ``each`` batches of two single-group units of job1 through one
    ``client`` at once (``single_group_units``, prefixes ``t{k}x{j}x``); the exceptions they raised."""
    errors: list[BaseException] = []

    def register(k: int) -> None:
        try:
            for j in range(each):
                client.register_units("job1", single_group_units(["math", "code"], prefix=f"t{k}x{j}x"))
        except BaseException as exc:
            errors.append(exc)

    started = [threading.Thread(target=register, args=(k,)) for k in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(60)
    return errors


def manifest(client: Any, job: str, n: int, *, timeout_s: float = 0) -> Manifest | None:
    """``GET .../minibatches/{n}``: the manifest, or None (204: not admitted within ``timeout_s``)."""
    r = client.get(f"/v1/jobs/{job}/minibatches/{n}", params={"timeout_s": timeout_s})
    if r.status_code == 204:
        return None
    assert r.status_code == 200, r.text
    return Manifest.decode(r.content)


def ack(client: Any, job: str, m: Manifest, *, transfer: dict[str, Any] | None = None, **body: Any) -> dict[str, Any]:
    """``POST .../minibatches/{n}/ack`` of manifest ``m`` for every rank (``transfer``: every rank's figures)."""
    payload = {"attempt": m.attempt, **body}
    if transfer is not None:
        payload["transfer"] = {name: [value] * m.world_size for name, value in transfer.items()}
    a = client.post(f"/v1/jobs/{job}/minibatches/{m.global_index}/ack", json=payload)
    assert a.status_code == 200, a.text
    result: dict[str, Any] = a.json()
    return result


def shares(m: Manifest) -> list[RankPlan]:
    """Every rank's share of ``m``, by rank."""
    return [m.share(rank) for rank in range(m.world_size)]


def rows_of(plans: Sequence[RankPlan]) -> list[tuple[str, int]]:
    """``(group id, row)`` of every row of ``plans``, in order."""
    return [(r.group_id, r.row) for p in plans for micro in p.micro_batches for r in micro.rows]


def drain(client: Any, job: str, *, rounds: int = 1000) -> list[Manifest]:
    """Read and ack (for every rank) each admitted mini-batch from the trainer's position on until none is
    ready; returns the manifests in order."""
    delivered: list[Manifest] = []
    for _ in range(rounds):
        position = client.get(f"/v1/jobs/{job}/minibatches").json()["position"]
        m = manifest(client, job, position)
        if m is None:
            return delivered
        delivered.append(m)
        ack(client, job, m)
    raise AssertionError("the trainer never ran out of mini-batches")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """``knittrans control-plane`` in a subprocess on a free port (a real uvicorn server)."""

    def __init__(self, db: Path, *extra: str) -> None:
        self.db = db
        self.extra = extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> ServerProcess:
        cmd = knittrans_command(*control_plane_args(self.db, port=self.port, log_level="WARNING", extra=self.extra))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        proc = self.proc
        wait_ready(
            proc,
            lambda: httpx.get(self.url + "/v1/health", timeout=1.0).status_code == 200,
            timeout_s=timeout_s,
            what="control plane",
            output=lambda: proc.stderr.read().decode() if proc.stderr else "",
        )
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` (MiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def server(db: Path, *extra: str) -> Iterator[ServerProcess]:
    """A started :class:`ServerProcess`, stopped afterwards."""
    proc = ServerProcess(db, *extra).start()
    try:
        yield proc
    finally:
        proc.stop()


USAGE = {
    "units": 3,
    "rows": 12,
    "bytes_in_memory": 4096,
    "bytes_spilled": 0,
    "budget_bytes": 1 << 20,
    "budget_used": 5000,
    "pending": 1,
    "schema_version": 1,
}
TRANSFER = {
    "exposed_s": 0.25,
    "fetch_s": 0.5,
    "row_bytes": 1000,
    "media_logical_bytes": 800,
    "media_physical_bytes": 200,
}


def populate(c: Any, *, gathered: bool = False) -> None:
    """Two nodes (one with usage), one job with a consumed step and acks carrying transfer figures: each rank
    acks for itself, or (``gathered``) one ack per mini-batch carries every rank's figures."""
    assert c.post("/v1/jobs", json=job_spec(quotas={"math": 2, "code": 2}, mini_batches_per_step=2)).status_code == 201
    for node in ("n0", "n1"):
        assert c.post("/v1/nodes", json={"node_id": node, "endpoint": ENDPOINT.format(port=1)}).status_code == 200
    assert c.post("/v1/nodes/n0/heartbeat", json=USAGE).status_code == 200
    assert c.post("/v1/nodes/n1/heartbeat").status_code == 200  # no body: still a heartbeat
    units = single_group_units(["math", "code", "math", "code"])
    assert c.post("/v1/jobs/job1/units", json={"units": units}).status_code == 200
    for n in range(2):  # the first mini-batch of the step, then the second
        m = manifest(c, "job1", n)
        assert m is not None
        reports = [None] if gathered else [[0], [1]]
        for ranks in reports:
            width = len(ranks or (0, 1))  # one column entry per rank the ack reports for
            body = {"attempt": m.attempt, "ranks": ranks, "transfer": {k: [v] * width for k, v in TRANSFER.items()}}
            assert c.post(f"/v1/jobs/job1/minibatches/{n}/ack", json=body).status_code == 200
            again = c.post(f"/v1/jobs/job1/minibatches/{n}/ack", json=body)  # a repeat is not counted twice
            assert again.status_code == 200 and again.json()["duplicate"]
