"""``knittrans control-plane`` as a real process: --port 0 with a ready file, a taken port refused clearly."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from knittrans.api.cli import add_arguments, settings_from_args
from knittrans.procs import ProcessGroup, control_plane_args, knittrans_command, wait_until


def test_control_plane_args_are_the_commands_own_flags(tmp_path: Path) -> None:
    """The one builder of a control-plane command line (demo, Ray, benchmarks, tests) speaks its parser."""
    args = control_plane_args(
        tmp_path / "cp.db",
        port=8123,
        host="127.0.0.2",
        ready_file=tmp_path / "cp.ready",
        node_timeout_s=7.5,
        log_level="WARNING",
        extra=["--http", "h11"],
    )
    assert args[:3] == ["--log-level", "WARNING", "control-plane"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(args[3:])
    assert (parsed.host, parsed.port, parsed.ready_file, parsed.http) == (
        "127.0.0.2",
        8123,
        tmp_path / "cp.ready",
        "h11",
    )
    settings = settings_from_args(parsed)
    assert (settings.db_path, settings.node_timeout_s) == (str(tmp_path / "cp.db"), 7.5)
    bare = parser.parse_args(control_plane_args(tmp_path / "x.db")[1:])
    assert (bare.port, bare.ready_file, bare.node_timeout_s) == (0, None, None)


@pytest.mark.timing
def test_port_zero_reports_the_real_port_in_the_ready_file(tmp_path: Path) -> None:
    """With --port 0 the ready file names the bound port, the server answers there, and a second server on that
    port exits with an error naming the address instead of a traceback."""
    ready = tmp_path / "cp.ready"
    with ProcessGroup(tmp_path / "logs") as procs:
        procs.start(
            "cp",
            knittrans_command(
                "control-plane", "--db", str(tmp_path / "cp.db"), "--port", "0", "--ready-file", str(ready)
            ),
        )

        def written() -> bool:
            procs.check_alive("cp")
            return ready.exists()

        wait_until(written, timeout_s=60, what="control-plane ready file")
        info = json.loads(ready.read_text())
        assert info["port"] > 0 and info["url"] == f"http://127.0.0.1:{info['port']}"
        assert info["pid"] == procs.children["cp"].pid
        assert not (tmp_path / "cp.ready.tmp").exists()
        health = httpx.get(info["url"] + "/v1/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"

        second = subprocess.run(
            knittrans_command("control-plane", "--db", str(tmp_path / "other.db"), "--port", str(info["port"])),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert f"cannot listen on 127.0.0.1:{info['port']}" in second.stderr
        assert "Traceback" not in second.stderr
        assert httpx.get(info["url"] + "/v1/health", timeout=10).status_code == 200  # the first keeps serving
