"""The control-plane scale benchmark at its smoke size: a real server, simulated ranks, nodes and writer.

Checks that the run completes and its JSON carries every figure the README cites (no timing assertions:
the machine is shared; the figures themselves are in benchmarks/control_plane/results/).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scale_smoke_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "scale"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "control_plane" / "scale.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    for key in ("machine", "cpus", "load_avg_1m_start", "commit", "server", "targets"):
        assert key in result, key
    d = result["delivery"]
    assert d["ranks"] == 32 and d["nodes"] == 8 and d["plans_delivered"] > 0 and d["mini_batches_consumed"] > 0
    for figure in ("plan_delivery_ms", "plan_age_ms", "registration_request_ms"):
        assert d[figure]["count"] > 0 and d[figure]["p99"] >= d[figure]["p50"] >= 0, figure
    assert d["server_cpu_ms_per_mini_batch"] > 0
    assert result["registration"]["units"] == 3 * 500 and result["registration"]["units_per_s_median"] > 0
    m = result["memory"]
    assert m["mini_batches"] == 300 and m["samples"][-1]["mini_batch"] == 300
    for key in (
        "rss_mib_at_1000",
        "rss_mib_at_end",
        "rss_growth",
        "status_ms_at_end",
        "status_bytes_at_end",
        "server_cpu_ms_per_mini_batch",
    ):
        assert key in m, key
    assert set(result["targets"]) == {
        "plan_delivery_p99<=50ms",
        "registration>=20000_units_s",
        "rss_growth_1000_to_end<=10%",
    }
    assert out.with_suffix(".md").read_text().startswith("# Control plane at scale")


def test_scale_think_time_paces_the_ranks(tmp_path: Path) -> None:
    """--think-ms: a rank waits that long on each plan before it acks, so no rank acks more than one plan per
    think time (an upper bound only: a slow machine consumes fewer), in the long-poll and the stream modes."""
    for mode in ("next", "stream"):
        out = tmp_path / f"think_{mode}"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "control_plane" / "scale.py"), "--smoke", "--phases"]
        cmd += ["delivery", "--ack-mode", mode, "--think-ms", "400", "--rate", "400", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        d = json.loads(out.with_suffix(".json").read_text())["delivery"]
        assert d["think_ms"] == 400 and d["ack_mode"] == mode
        assert 0 < d["mini_batches_consumed"] <= d["seconds"] / 0.4 + 1, d


def test_scale_stream_clients_report_arrival_at_the_socket(tmp_path: Path) -> None:
    """--stream-client socket (default): every plan also has its kernel receive time, never later than the time
    after parsing, and the target is judged on it; --stream-client asyncio (the old client) has no arrival."""
    for client in ("socket", "asyncio"):
        out = tmp_path / f"stream_{client}"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "control_plane" / "scale.py"), "--smoke", "--phases"]
        cmd += ["delivery", "--ack-mode", "stream", "--stream-client", client, "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(out.with_suffix(".json").read_text())
        d = result["delivery"]
        assert d["stream_client"] == client and d["plans_delivered"] > 0 and d["mini_batches_consumed"] > 0
        if client == "socket":
            arrival, parsed = d["plan_arrival_ms"], d["plan_delivery_ms"]
            assert arrival["count"] == parsed["count"] == d["plans_delivered"] == d["plan_arrival_user_ms"]["count"]
            assert 0 <= arrival["p50"] <= parsed["p50"] and arrival["max"] <= parsed["max"], d
            assert d["plans_without_kernel_time"] == 0  # SO_TIMESTAMPNS gave every read its receive time
            assert set(result["targets"]) == {"plan_arrival_at_rank_socket_p99<=50ms"}
        else:
            assert d["plan_arrival_ms"] is None and d["plans_before_ready"] is None
            assert set(result["targets"]) == {"plan_delivery_p99<=50ms"}
