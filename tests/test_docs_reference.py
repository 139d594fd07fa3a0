"""The reference in docs/ covers the real interfaces: every REST route, every CLI flag, every relative link."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import re
from pathlib import Path

import pytest

from knittrans import errors
from knittrans.api.app import create_app
from knittrans.api.settings import Settings
from knittrans.api.spec import JobSpec
from knittrans.cli import SUBCOMMANDS
from knittrans.rollout.worker import RolloutWorkerConfig
from knittrans.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section of a Markdown file (up to the next ``## ``)."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_every_openapi_route_is_in_the_rest_reference(tmp_path: Path) -> None:
    """Each method + path of the app's OpenAPI has a row in docs/reference/rest.md's endpoint table."""
    spec = create_app(Settings(db_path=str(tmp_path / "cp.db"))).openapi()
    table = _section((DOCS / "reference" / "rest.md").read_text(), "Endpoints")
    missing = [
        f"{method.upper()} {path}"
        for path, operations in spec["paths"].items()
        for method in operations
        if f"`{method.upper()} {path}`" not in table
    ]
    assert not missing, f"routes missing from docs/reference/rest.md: {missing}"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_cli_flag_is_in_the_cli_reference(command: str) -> None:
    """Each flag of ``knittrans <command>`` appears in its section of docs/reference/cli.md."""
    parser = argparse.ArgumentParser(prog=f"knittrans {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    section = _section((DOCS / "reference" / "cli.md").read_text(), f"`knittrans {command}`")
    missing = [
        flag
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        for flag in (action.option_strings or [action.dest])
        if f"`{flag}`" not in section
    ]
    assert not missing, f"`knittrans {command}` flags missing from docs/reference/cli.md: {missing}"


@pytest.mark.parametrize("config", [TrainerConfig, JobSpec, RolloutWorkerConfig, Settings], ids=lambda c: c.__name__)
def test_every_config_field_is_in_the_config_reference(config: type) -> None:
    """Each field of a public config has a row in its section of docs/reference/config.md."""
    fields = Settings.model_fields if config is Settings else {f.name: f for f in dataclasses.fields(config)}
    section = _section((DOCS / "reference" / "config.md").read_text(), config.__name__)
    missing = [name for name in fields if f"| `{name}` |" not in section]
    assert not missing, f"{config.__name__} fields missing from docs/reference/config.md: {missing}"


def test_every_error_is_in_the_errors_reference() -> None:
    """Each exception class knittrans.errors exports is named in docs/reference/errors.md."""
    text = (DOCS / "reference" / "errors.md").read_text()
    classes = [name for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    missing = [name for name in classes if name not in text]
    assert not missing, f"errors missing from docs/reference/errors.md: {missing}"


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*/README.md"))]


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # a ``#`` line in a code block is no heading
    return {
        "#" + re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in text.splitlines()
        if line.startswith("#")
    }


def _missing(target: Path, anchor: str) -> bool:
    """Whether ``target`` (and, in a Markdown file, the heading ``anchor``, when not empty) is not there."""
    if not target.exists():
        return True
    return bool(anchor) and target.suffix == ".md" and f"#{anchor}" not in _anchors(target)


def test_every_relative_link_resolves() -> None:
    """Each relative link in README.md, docs/**/*.md and the benchmark READMEs points at an existing path, and
    a ``#heading`` in it at a heading of that file."""
    broken = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # links inside code are code
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            if _missing(md.parent / path if path else md, anchor):
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_path_the_package_names_exists() -> None:
    """The docstrings and comments that send a reader to ``docs/…md`` (or ``docs/…md#heading``) name a file and
    heading that are there."""
    broken = []
    for path in sorted((ROOT / "knittrans").rglob("*.py")):
        for match in re.finditer(r"\b(docs/[\w./-]+\.md)(?:#([\w-]+))?", path.read_text()):
            if _missing(ROOT / match[1], match[2] or ""):
                broken.append(f"{path.relative_to(ROOT)}: {match[0]}")
    assert not broken, "paths into docs/ that are not there:\n" + "\n".join(broken)


def test_generated_reference_pages_are_up_to_date(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/reference/cli.md and config.md equal what scripts/docs_reference.py makes from the parsers and
    config classes (rerun the script after changing a flag, a help text or a config field)."""
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    for key in [k for k in os.environ if k.startswith("KNITTRANS_")]:
        monkeypatch.delenv(key)
    for page, make in (("cli.md", generator.cli_md), ("config.md", generator.config_md)):
        committed = (ROOT / "docs" / "reference" / page).read_text()
        assert make() == committed, f"docs/reference/{page} is stale: run .venv/bin/python scripts/docs_reference.py"
