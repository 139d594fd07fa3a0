"""STYLE.md's rules for module docstrings: every module has one, of one line (the design is in docs/)."""

from __future__ import annotations

import ast
import re
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


DOC_PATH = re.compile(r"\b(docs/[\w./-]+\.md)(#[\w-]+)?")


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {
        "#" + re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in markdown.splitlines()
        if line.startswith("#")
    }


def test_every_docs_path_the_package_names_exists() -> None:
    """The docstrings and comments that send a reader to docs/ name a file (and heading) that is there."""
    missing = []
    for path in sorted((ROOT / "knittrans").rglob("*.py")):
        for match in DOC_PATH.finditer(path.read_text()):
            doc, anchor = ROOT / match[1], match[2]
            if not doc.is_file() or (anchor and anchor not in _anchors(doc.read_text())):
                missing.append(f"{path.relative_to(ROOT)}: {match[0]}")
    assert missing == [], f"paths into docs/ that do not exist: {missing}"
