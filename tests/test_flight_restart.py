"""A `knittrans store` process killed with SIGKILL loses no sealed unit and serves no half-written one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from data_support import make_groups

from knittrans.flight import StoreClient
from knittrans.procs import wait_ready
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import build_unit_tables
from knittrans.tickets import Ticket, UnitRead


def _launch(store_dir: Path, ready: Path, port: int = 0) -> subprocess.Popen[bytes]:
    ready.unlink(missing_ok=True)
    log = ready.with_suffix(".log")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "knittrans.cli",
                "store",
                "--dir",
                str(store_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--node-id",
                "node-a",
                "--token",
                "tok",
                "--ready-file",
                str(ready),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_ready(proc, ready.exists, timeout_s=30, what="store", output=lambda: log.read_text(errors="replace"))
    return proc


def test_kill_9_restart_recovers_sealed_units_and_drops_partial(store_dir: Path, tmp_path: Path) -> None:
    """Sealed units (local and DoPut writers) come back after kill -9; a half-put unit and .tmp dirs do not."""
    ready = tmp_path / "endpoint"
    proc = _launch(store_dir, ready)
    try:
        endpoint = ready.read_text()
        local = TrajectoryWriter(job="job", node_id="node-a", endpoint=endpoint, store_dir=store_dir, token="tok")
        remote = TrajectoryWriter(job="job", node_id="node-a", endpoint=endpoint, token="tok")
        descs = [
            local.write_groups(make_groups(2, seed=1, prefix="a")),
            remote.write_groups(make_groups(3, seed=2, prefix="b")),
        ]
        expected = {
            d.unit_id: remote.client.get(Ticket(job="job", reads=(UnitRead(unit_id=d.unit_id),))) for d in descs
        }
        half = make_groups(1, seed=3, prefix="c")
        remote.client.put_part("job", "half", "traj", build_unit_tables(half).traj)  # never sealed
        (store_dir / "job" / ".tmp-crashed-0000").mkdir()
        (store_dir / "job" / ".tmp-crashed-0000" / "traj.arrow").write_bytes(b"partial")
        local.close()
        remote.close()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    proc = _launch(store_dir, ready)
    try:
        with StoreClient(ready.read_text(), token="tok") as c:
            listed = {u["unit_id"] for u in c.list_units("job")}
            assert listed == set(expected)
            for uid, table in expected.items():
                assert c.get(Ticket(job="job", reads=(UnitRead(unit_id=uid),))).equals(table)
            assert c.stats()["recovered"] == 2
        assert not [p for p in (store_dir / "job").iterdir() if p.name.startswith(".tmp-")]
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0
