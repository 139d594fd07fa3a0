"""Every code block in README.md and docs/ runs in CI, is checked against what CI runs, or needs a cluster/GPU.

A fenced block opens with an info string: its language, then optionally one tag. Untagged ``python``
blocks run as a script in a fresh interpreter from a temporary directory; untagged
``bash``/``sh``/``console`` blocks run from the repository root with ``.venv/bin`` first on ``PATH``
(``console`` lines start with ``$ ``). Other languages (``text``, ``json``, ``yaml``) are not commands;
a block with no language fails. The tags, each checked here:

* ``fragment-of: PATH`` — the block's lines appear in ``PATH`` (a file CI runs) in the same order (a line
  ``...`` stands for lines left out);
* ``outline-of: NAME ...`` — an API outline: its imports import, and every ``.name(`` it calls is an
  attribute of something it imports or of the modules / classes named;
* ``runs-in: WHERE ...`` — a command that takes minutes, run by CI at ``WHERE`` (``tests/x.py::test_y``, or
  ``scripts/test.sh`` itself); each ``knittrans ...`` line (and each baselines-harness line) is parsed with
  the real argument parser, so every flag and choice in the docs exists;
* ``needs: WHAT`` — only what this machine cannot have: :data:`NEEDS`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from knittrans import cli

ROOT = Path(__file__).resolve().parent.parent
RUN = {"python", "bash", "sh", "console"}
DATA = {"text", "json", "yaml", "toml", "ini"}
TIMEOUT_S = 60
FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")
TAGS = ("fragment-of", "outline-of", "runs-in", "needs")
NEEDS = frozenset({"a GPU", "a Ray cluster", "verl and a Ray cluster", "NeMo-RL and GPUs", "AReaL and store nodes"})
"""What a ``needs:`` block may need: GPUs, multi-host clusters, frameworks not installed here."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: str
    line: int
    language: str
    tag: str | None
    """``fragment-of``, ``outline-of``, ``runs-in``, ``needs``, or another word (refused), or None: the block runs."""
    value: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.language or 'no language'})"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with their language and tag."""
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
        tag, _, value = rest.partition(":")
        found.append(
            Block(
                str(path.relative_to(ROOT)),
                i + 1,
                language,
                tag.strip() or None,
                value.strip(),
                "\n".join(body) + "\n",
            )
        )
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/**/*.md."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [block for path in files for block in blocks_of(path)]


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.language in RUN and b.tag is None]


def tagged(tag: str) -> list[Block]:
    """The blocks carrying ``tag``."""
    return [b for b in BLOCKS if b.tag == tag]


def test_every_block_has_a_language_and_a_known_tag() -> None:
    """A block has a language; a tag is one of :data:`TAGS` with a value; ``needs:`` is one of :data:`NEEDS`."""
    unknown = [str(b) for b in BLOCKS if b.language not in RUN | DATA]
    assert not unknown, f"blocks with no or an unknown language (use one of {sorted(RUN | DATA)}): {unknown}"
    bad = [f"{b}: {b.tag!r}" for b in BLOCKS if b.tag is not None and (b.tag not in TAGS or not b.value)]
    assert not bad, f"unknown or empty tags (use one of {TAGS}): {bad}"
    needs = [f"{b}: {b.value!r}" for b in tagged("needs") if b.value not in NEEDS]
    assert not needs, f"needs: only {sorted(NEEDS)}; run it, or check it with another tag: {needs}"


def _stripped(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("block", tagged("fragment-of"), ids=str)
def test_fragment_is_in_its_file(block: Block) -> None:
    """A ``fragment-of`` block's lines stand in that file, in the same order (it cannot drift from what CI runs)."""
    lines = iter(_stripped((ROOT / block.value).read_text()))
    wanted = [line for line in _stripped(block.code) if line != "..."]  # "...": lines left out
    missing = [line for line in wanted if not any(line == other for other in lines)]
    assert not missing, f"{block}: not in {block.value} (in this order): {missing[:3]}"


@pytest.mark.parametrize("block", tagged("outline-of"), ids=str)
def test_outline_names_exist(block: Block) -> None:
    """An API outline's imports import and every ``.name(`` it calls is an attribute of something imported."""
    imported: list[object] = []
    for line in block.code.splitlines():
        found = re.match(r"from ([\w.]+) import (.+)", line)
        if found:
            module = importlib.import_module(found.group(1))
            imported += [getattr(module, name.strip()) for name in found.group(2).split(",")]
    for name in block.value.split():  # a module (its members count) or a module's attribute, e.g. torch.Tensor
        try:
            module = importlib.import_module(name)
            imported += [getattr(module, member) for member in dir(module)]
        except ModuleNotFoundError:
            parent, _, attr = name.rpartition(".")
            imported.append(getattr(importlib.import_module(parent), attr))
    called = set(re.findall(r"\.(\w+)\(", block.code))
    unknown = sorted(name for name in called if not any(hasattr(obj, name) for obj in imported))
    assert imported, f"{block}: names no module"
    assert not unknown, f"{block}: calls names that nothing imported has: {unknown}"


def _command_lines(code: str) -> list[list[str]]:
    """The block's shell commands as argument lists (comments dropped, continuations joined, split at && and ;)."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        for part in re.split(r"&&|;", line.split(" #", 1)[0]):
            if part.strip():
                commands.append(shlex.split(part, comments=True))
    return commands


def _parse(argv: list[str]) -> str | None:
    """Parse a ``knittrans`` or baselines-harness command with its real parser: None, or what is wrong."""
    while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    if argv[:1] == ["knittrans"] or (argv and argv[0].endswith("/knittrans")):
        name, rest = argv[1], argv[2:]
        module_name, _ = cli.SUBCOMMANDS[name]
        parser = argparse.ArgumentParser(prog=f"knittrans {name}", exit_on_error=False)
        importlib.import_module(module_name).add_arguments(parser)
    elif "benchmarks.vs_baselines.harness" in argv:
        from benchmarks.vs_baselines.harness import parse_args

        rest = argv[argv.index("benchmarks.vs_baselines.harness") + 1 :]
        try:
            parse_args(rest)
        except SystemExit:
            return f"{' '.join(argv)}: refused by the harness"
        return None
    else:
        return None
    try:
        parser.parse_args(rest)
    except (argparse.ArgumentError, SystemExit) as exc:
        return f"{' '.join(argv)}: {exc}"
    return None


@pytest.mark.parametrize("block", tagged("runs-in"), ids=str)
def test_long_command_runs_in_ci_and_parses(block: Block) -> None:
    """A ``runs-in`` block names where CI runs it (that test exists, or scripts/test.sh), and its commands parse."""
    for where in block.value.split():
        path, _, test = where.partition("::")
        assert (ROOT / path).is_file(), f"{block}: {path} does not exist"
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(), re.M), f"{block}: no {where}"
        else:
            assert path == "scripts/test.sh", f"{block}: name a test (path::test_name) or scripts/test.sh"
    wrong = [msg for argv in _command_lines(block.code) if (msg := _parse(argv))]
    assert not wrong, f"{block}: {wrong}"


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
    """Each ``python``/shell block without a tag runs something (a ``console`` block needs ``$ `` lines)."""
    empty = [str(b) for b in RUNNABLE if not _shell(b).strip()]
    assert not empty, f"untagged blocks with nothing to run: {empty}"
    assert {b.language for b in RUNNABLE} >= {"python", "bash"}, "the docs' Python and shell examples run in CI"
