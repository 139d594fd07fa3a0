"""``knittrans.procs``: a real child that gets ready, exits first, or never gets ready; a ProcessGroup's checks;
a LocalCluster that fails to start stops what it started, and its store heartbeats as often as the control
plane asks; a server's open-files limit it cannot raise."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from knittrans.local import ClusterConfig, LocalCluster
from knittrans.procs import ProcessGroup, stop_process, wait_ready
from knittrans.rlimits import raise_open_files_limit


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def test_wait_ready_returns_once_the_child_is_ready(tmp_path: Path) -> None:
    """A running child's ready file ends the wait."""
    ready = tmp_path / "ready"
    proc = _child(f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    try:
        wait_ready(proc, ready.exists, timeout_s=60, what="child")
        assert proc.poll() is None
    finally:
        stop_process(proc)


def test_wait_ready_names_a_child_that_exited_first(tmp_path: Path) -> None:
    """A child that exits before it is ready raises RuntimeError with its name, exit code and output."""
    proc = _child("raise SystemExit(3)")
    with pytest.raises(RuntimeError, match=r"(?s)child exited with code 3 before it was ready:\nthe log"):
        wait_ready(proc, (tmp_path / "never").exists, timeout_s=60, what="child", output=lambda: "the log")
    stop_process(proc)


def test_wait_ready_times_out_on_a_running_child(tmp_path: Path) -> None:
    """A child that runs but never gets ready raises TimeoutError naming it."""
    proc = _child("import time; time.sleep(60)")
    try:
        with pytest.raises(TimeoutError, match="child not ready"):
            wait_ready(proc, (tmp_path / "never").exists, timeout_s=0.3, what="child")
    finally:
        stop_process(proc)


def test_process_group_names_a_failed_child_and_refuses_a_second_start(tmp_path: Path) -> None:
    """check_alive raises with the exit code and log of a child that failed; a name still running cannot be
    started again; a name never started has no log."""
    with ProcessGroup(tmp_path / "logs") as group:
        failed = group.start("failed", [sys.executable, "-c", "print('went wrong'); raise SystemExit(3)"])
        failed.wait(60)
        with pytest.raises(RuntimeError, match=r"(?s)failed exited with code 3:\nwent wrong"):
            group.check_alive()
        group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        group.check_alive("sleeper")
        with pytest.raises(RuntimeError, match="child 'sleeper' is already running"):
            group.start("sleeper", [sys.executable, "-c", "pass"])
        assert group.log_tail("never") == ""
    assert group.children["sleeper"].poll() is not None, "leaving the block stops every child"


def test_a_local_cluster_that_fails_to_start_stops_its_processes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_stores must be >= 1"):
        ClusterConfig(work_dir=tmp_path, num_stores=0)
    cluster = LocalCluster(ClusterConfig(work_dir=tmp_path, start_timeout_s=0.01))
    with pytest.raises(TimeoutError, match="control plane not ready"), cluster:
        pass
    assert cluster.procs.children["control-plane"].poll() is not None


def test_a_store_heartbeats_as_often_as_its_control_plane_asks(tmp_path: Path) -> None:
    """A store started without ``--heartbeat-s`` follows the ``heartbeat_s`` its control plane answers with
    (a sixth of the node timeout): under a 3 s timeout it heartbeats every 0.5 s, so the age of its last
    heartbeat stays mostly under that, where the old fixed 2 s interval gave a median age near 1 s."""
    config = ClusterConfig(work_dir=tmp_path, num_stores=1, node_timeout_s=3.0)
    with LocalCluster(config) as cluster, cluster.control() as control:
        (node,) = control.list_nodes()
        assert node["heartbeat_s"] == pytest.approx(0.5)
        ages = []
        deadline = time.monotonic() + 2 * 3.0
        while time.monotonic() < deadline:
            (node,) = control.list_nodes()
            assert node["state"] == "alive", node
            ages.append(node["seconds_since_heartbeat"])
            time.sleep(0.05)
    assert sorted(ages)[len(ages) // 2] < 0.75, ages


def test_an_open_files_limit_that_cannot_be_raised_is_kept_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(which: int, limits: tuple[int, int]) -> None:
        raise ValueError("not allowed here")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    with caplog.at_level(logging.WARNING, logger="knittrans.rlimits"):
        assert raise_open_files_limit() == 1024
    assert "cannot raise the open-files limit from 1024 to 4096: not allowed here" in caplog.text
