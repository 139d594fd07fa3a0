"""Every code block in README.md and docs/ runs, or says in its info string why CI cannot run it.

A fenced block opens with an info string: its language, then optionally ``skip-ci: <reason>``
(needs a GPU, docker, a cluster, another venv, or minutes). Untagged ``python`` blocks run as a
script in a fresh interpreter from a temporary directory; untagged ``bash``/``sh``/``console``
blocks run from the repository root with ``.venv/bin`` first on ``PATH`` (``console`` lines start
with ``$ ``). Other languages (``text``, ``json``, ``yaml``) are not commands. A block with no
language fails: say what it is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = {"python", "bash", "sh", "console"}
DATA = {"text", "json", "yaml", "toml", "ini"}
TIMEOUT_S = 60
FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: str
    line: int
    language: str
    skip: str | None
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.language or 'no language'})"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with their language and ``skip-ci`` reason."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, ticks, info = opening.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
        words = info.strip().split(None, 1)
        language = words[0] if words else ""
        rest = words[1] if len(words) > 1 else ""
        skip = rest.split("skip-ci:", 1)[1].strip() if "skip-ci:" in rest else None
        found.append(Block(str(path.relative_to(ROOT)), i + 1, language, skip, "\n".join(body) + "\n"))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/**/*.md."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [block for path in files for block in blocks_of(path)]


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.language in RUN and b.skip is None]


def test_every_block_has_a_language_and_every_skip_a_reason() -> None:
    """A block says what it is (a language), and a ``skip-ci`` tag names why CI cannot run it."""
    unknown = [str(b) for b in BLOCKS if b.language not in RUN | DATA]
    assert not unknown, f"blocks with no or an unknown language (use one of {sorted(RUN | DATA)}): {unknown}"
    unreasoned = [str(b) for b in BLOCKS if b.skip is not None and not b.skip]
    assert not unreasoned, f"skip-ci without a reason: {unreasoned}"


def _shell(block: Block) -> str:
    if block.language != "console":
        return block.code
    return "\n".join(line[2:] for line in block.code.splitlines() if line.startswith("$ ")) + "\n"


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    """The block exits 0: Python as a script from a temporary directory, shell from the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KNITTRANS_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        argv, cwd = [sys.executable, str(script)], tmp_path
    else:
        argv, cwd = ["bash", "-euo", "pipefail", "-c", _shell(block)], ROOT
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{block} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_every_untagged_command_block_has_commands() -> None:
    """Each ``python``/shell block without ``skip-ci`` runs something (a ``console`` block needs ``$ `` lines)."""
    empty = [str(b) for b in RUNNABLE if not _shell(b).strip()]
    assert not empty, f"untagged blocks with nothing to run: {empty}"
    assert {b.language for b in RUNNABLE} >= {"python", "bash"}, "the docs' Python and shell examples run in CI"
