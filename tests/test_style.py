"""STYLE.md's rules for module docstrings: every module has one, of one line (the design is in docs/)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE_DRAWN = {"knittrans/errors.py"}
"""Modules whose docstring draws something (STYLE item 6: errors.py draws the exception tree)."""


def test_every_module_docstring_is_one_line() -> None:
    """STYLE item 9: one line per module; what a module's design needs beyond it belongs in docs/."""
    long, missing = [], []
    for path in sorted((ROOT / "knittrans").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        body = ast.parse(path.read_text()).body
        first = body[0] if body else None
        if not (
            isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        ):
            missing.append(name)
        elif (lines := len(first.value.value.splitlines())) > 1 and name not in TREE_DRAWN:
            long.append(f"{name} ({lines} lines)")
    assert missing == [], f"modules without a docstring: {missing}"
    assert long == [], f"module docstrings over one line: {long}"
