"""``knittrans`` itself: no command, an interrupted command, a command whose optional dependency is missing;
``knittrans bench`` without a checkout and with a failing script; ``knittrans status`` argument checks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from knittrans import benchcli, statusview
from knittrans.cli import main


def test_no_command_prints_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "status" in capsys.readouterr().out


def _status_run_raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def run(args: Any) -> int:
        raise exc

    monkeypatch.setattr(statusview, "run", run)


def test_an_interrupted_command_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    _status_run_raising(monkeypatch, KeyboardInterrupt())
    assert main(["status"]) == 130


def test_a_missing_model_stack_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command that needs torch at run time, where it is not installed, says which extra brings it; a missing
    module of another kind (a broken install) is raised as it is."""
    _status_run_raising(monkeypatch, ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert main(["status"]) == 2
    assert "knittrans status needs torch" in capsys.readouterr().err
    _status_run_raising(monkeypatch, ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow"))
    with pytest.raises(ModuleNotFoundError, match="pyarrow"):
        main(["status"])


def test_bench_needs_a_checkout_and_returns_the_first_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(benchcli, "__file__", str(tmp_path / "knittrans" / "benchcli.py"))
    assert benchcli.run(argparse.Namespace(name="transfer", args=[])) == 2
    assert "needs a source checkout" in capsys.readouterr().err
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "fails.py").write_text("import sys; sys.exit(int(sys.argv[1]))")
    (tmp_path / "benchmarks" / "never.py").write_text("raise SystemExit('not run after a failure')")
    monkeypatch.setitem(benchcli.BENCHMARKS, "transfer", ("fails.py", "never.py"))
    assert benchcli.run(argparse.Namespace(name="transfer", args=["5"])) == 5


def test_status_refuses_a_non_positive_interval() -> None:
    args = argparse.Namespace(control_url="http://127.0.0.1:1", token=None, job=None, watch=True, interval_s=0.0)
    with pytest.raises(SystemExit, match="--interval-s must be positive"):
        statusview.run(args)


def test_status_view_without_jobs_shows_the_nodes() -> None:
    node = {"node_id": "n0", "state": "alive", "endpoint": "grpc://h:1", "seconds_since_heartbeat": 0.5}
    usage = {"units": 1, "bytes_in_memory": 3 * 2**30, "bytes_spilled": 0, "budget_used": 0}
    text = statusview.render({"at": 0.0, "jobs": [], "nodes": [{**node, "usage": usage}]})
    assert "no job yet" in text and "3.0 GiB" in text and "ALIVE" in text
