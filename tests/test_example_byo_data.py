"""``examples/byo_data.py`` runs as a new user would run it: real processes, exit status 0, the rows it printed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "byo_data.py"
PUBLIC = {"knittrans.local", "knittrans.rollout.writer", "knittrans.schema", "knittrans.trainer.client"}


def test_byo_data_example_runs_and_checks_what_arrived() -> None:
    """The example starts a control plane and a store, writes 4 groups of 4 with user fields, consumes them on
    2 ranks and checks every value; its own check must pass and both ranks must have printed rows."""
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK" and "MISMATCH" not in proc.stdout, proc.stdout
    assert lines[0].startswith("rank 0: ") and lines[1].startswith("rank 1: ")
    counts = [int(line.split(":")[1].split()[0]) for line in lines[:2]]
    assert sum(counts) == 16 and all(counts), lines
    for index in range(4):
        assert f"({float(index)}, 'p{index}', {float(-index)})" in proc.stdout


def test_byo_data_example_imports_only_the_public_api() -> None:
    """The example a user copies imports KnitTrans only through its public modules (no demo internals)."""
    tree = ast.parse(EXAMPLE.read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in imported if name.startswith("knittrans")} == PUBLIC
