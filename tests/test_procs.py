"""``knittrans.procs.wait_ready``: a real child that gets ready, exits first, or never gets ready."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from knittrans.procs import stop_process, wait_ready


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
