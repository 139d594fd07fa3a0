"""``examples/byo_data.py`` runs as a new user would run it: real processes, exit status 0, the rows it printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "byo_data.py"


def test_byo_data_example_runs_and_checks_what_arrived() -> None:
    """The example starts a control plane and a store, writes 4 groups of 4 with user fields, consumes them on
    2 ranks and checks every value; its own check must pass and both ranks must have printed rows."""
    assert len(EXAMPLE.read_text().splitlines()) <= 60
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK"
    assert lines[0].startswith("rank 0: ") and lines[1].startswith("rank 1: ")
    counts = [int(line.split(":")[1].split()[0]) for line in lines[:2]]
    assert sum(counts) == 16 and all(counts), lines
    assert "'p3'" in proc.stdout and "-3.0" in proc.stdout
