"""Role-sized installs: the store node and the control plane start without the model stack.

``pip install knittrans`` (core) has no torch, transformers or matplotlib; these tests run each
entry point in a fresh interpreter and check that none of those modules was imported. The trainer
library (``knittrans.trainer``) must not import the demo that is built on it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_STACK = ("torch", "transformers", "matplotlib", "safetensors", "PIL")

_PROBE = """
import contextlib, importlib, io, json, sys
what, arg = sys.argv[1], sys.argv[2]
if what == "command":
    from knittrans.cli import main
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([arg, "--help"])
else:
    for name in arg.split(","):
        importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(what: str, arg: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, what, arg], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in MODEL_STACK)


@pytest.mark.parametrize(
    ("what", "arg"),
    [
        ("command", "store"),
        ("command", "control-plane"),
        ("import", "knittrans.flight.server"),
        ("import", "knittrans.flight.cli"),
        ("import", "knittrans.api.app"),
        ("import", "knittrans.api.cli"),
        ("import", "knittrans.controlclient"),
    ],
)
def test_store_and_control_plane_do_not_import_the_model_stack(what: str, arg: str) -> None:
    """``knittrans store --help``, ``knittrans control-plane --help`` and their modules: no torch & co."""
    modules = _modules_after(what, arg)
    assert "knittrans" in modules  # the probe really ran the entry point
    assert _heavy(modules) == [], f"{what} {arg} imports the model stack"


def test_trainer_library_does_not_import_the_demo() -> None:
    """Every ``knittrans.trainer`` module imports without ``knittrans.demo`` (the demo builds on it)."""
    names = sorted(
        f"knittrans.trainer.{p.stem}" for p in (ROOT / "knittrans" / "trainer").glob("*.py") if p.stem != "__init__"
    )
    modules = _modules_after("import", ",".join(names))
    assert set(names) <= modules
    assert sorted(m for m in modules if m.startswith("knittrans.demo")) == []


_WITHOUT_MODEL_STACK = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):  # as if only the core install were there
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "matplotlib", "safetensors", "PIL"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
from knittrans.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("command", "code", "extra"),
    [
        ("store", 0, None),
        ("control-plane", 0, None),
        ("status", 0, None),
        ("sim", 0, None),
        ("train", 2, "demo"),
        ("rollout", 2, "rollout"),
    ],
)
def test_without_the_model_stack_commands_work_or_name_their_extra(command: str, code: int, extra: str | None) -> None:
    """With torch & co. absent, core commands still answer; the others exit 2 naming the extra to install."""
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_MODEL_STACK, command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == code, out.stderr
    if extra is None:
        assert f"usage: knittrans {command}" in out.stdout
    else:
        assert f"pip install 'knittrans[{extra}]'" in out.stderr
        assert "Traceback" not in out.stderr


def _imports_of(path: Path) -> set[str]:
    """``knittrans`` modules a source file imports anywhere (``TYPE_CHECKING`` blocks and functions too)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this file's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [base] * bool(base))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("knittrans.")}


@pytest.mark.parametrize(
    "package", ["trainer", "api", "flight", "store", "rollout", "sched", "sim", "demo", "integrations", "."]
)
def test_no_import_cycles_between_modules(package: str) -> None:
    """No two modules of a package import each other, even lazily or for type checking only (a cycle hidden
    behind ``TYPE_CHECKING`` is still two modules that cannot be understood apart)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for p in (ROOT / "knittrans" / package).rglob("*.py")
        if p.stem != "__init__"
    }
    graph = {name: _imports_of(path) & set(files) for name, path in files.items()}
    assert len(files) > 1

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*path, start]
                if nxt not in path:
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for c in (cycle_from(name) for name in sorted(graph)) if c is not None]
    assert cycles == [], " -> ".join(cycles[0]) if cycles else ""
