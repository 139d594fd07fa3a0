"""The control-plane scale benchmark at its smoke size: a real server, heartbeating nodes, a paced writer and
the trainer client's own ManifestFeed and Progress, in both group layouts.

Checks that the run completes without a rank error and that its JSON and Markdown carry every figure the
results table reports, with sane values (no timing assertions: the machine is shared; the figures themselves
are in benchmarks/control_plane/results/).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scale_smoke_writes_every_figure_for_both_group_layouts(tmp_path: Path) -> None:
    """--smoke --groups shared per-rank: one run per layout, every rank error-free, each figure present and sane.

    Run from a directory holding a ``knittrans`` package that cannot be imported: the server is a ``python -m``
    child, which puts its working directory first on ``sys.path``, and must still run the client's package (a
    paired run puts the baseline tree on ``PYTHONPATH`` from a checkout of the other)."""
    out = tmp_path / "scale.json"
    (tmp_path / "knittrans").mkdir()
    (tmp_path / "knittrans" / "__init__.py").write_text("raise ImportError('the working directory package ran')\n")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "control_plane" / "scale.py"), "--smoke"]
    cmd += ["--groups", "shared", "per-rank", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("commit", "package", "machine", "load_at_start", "date", "args", "table", "runs"):
        assert key in result, key
    assert Path(result["package"]) == ROOT / "knittrans", result["package"]
    assert result["machine"]["cpus"] >= 1 and len(result["load_at_start"]) == 3
    assert result["args"]["smoke"] and result["args"]["ranks"] == [16]
    assert [(r["groups"], r["ranks"]) for r in result["runs"]] == [("shared", 16), ("per-rank", 16)]
    for run in result["runs"]:
        assert run["errors"] == [], run["errors"]
        assert run["consumed_mini_batches"] > 0 and run["consumed_total"] >= run["consumed_mini_batches"], run
        assert run["groups_registered"] >= run["consumed_mini_batches"] * run["groups_per_mini_batch"], run
        assert run["server_cpu_ms_per_mini_batch"] > 0 and run["server_core_share"] > 0, run
        background = run["background_cpu_s_per_s"]  # heartbeats and the idle server before the trainer starts
        assert 0 <= background < 1 and run["server_cpu_ms_per_mini_batch_above_background"] is not None, run
        if background > 0:
            assert run["server_cpu_ms_per_mini_batch_above_background"] < run["server_cpu_ms_per_mini_batch"], run
        assert run["server_rss_mib"] > 0 and run["window_s"] > 0, run
        d = run["delivery_ms"]
        assert d["count"] > 0 and d["max"] >= d["p99"] >= d["p50"] >= 0 and d["mean"] >= 0, d
        cut = run["share_cut_ms"]  # each of the virtual group's ranks cuts its share; per-rank clients cut none
        if run["groups"] == "shared":
            assert cut["count"] == 16 and cut["max"] >= cut["p99"] >= cut["p50"] >= 0, cut
        else:
            assert cut["count"] == 0, cut
    assert [row["groups"] for row in result["table"]] == ["shared", "per-rank"]
    for row in result["table"]:
        assert row["runs"] == 1 and row["mini_batches_per_s"] > 0, row
        assert row["delivery_max_ms"] >= row["delivery_p99_ms"] >= row["delivery_p50_ms"] >= 0, row
    table = out.with_suffix(".md").read_text()
    assert "| ranks | step | groups |" in table and "| 16 | 120 ms | per-rank |" in table, table
