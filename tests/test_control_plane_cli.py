"""``knittrans control-plane`` as a real process: --port 0 with a ready file, a taken port refused clearly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx

from knittrans.procs import ProcessGroup, knittrans_command, wait_until


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
