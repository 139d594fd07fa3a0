"""Regenerate docs/reference/cli.md and docs/reference/config.md from their single sources.

    .venv/bin/python scripts/docs_reference.py          # rewrite both files, then review the diff

cli.md comes from each subcommand's argparse parser (``knittrans.cli.SUBCOMMANDS``), config.md from
the config classes' fields and the docstring under each. tests/test_docs_reference.py checks that
every flag and field is there.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import textwrap
from pathlib import Path

from knittrans.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    ("knittrans.trainer.config", "TrainerConfig", "one trainer rank (`TrainerClient(config)`)"),
    ("knittrans.api.spec", "JobSpec", "a job (`POST /v1/jobs`; the body is this as JSON)"),
    ("knittrans.local", "ClusterConfig", "`knittrans.local.LocalCluster`"),
    ("knittrans.rollout.worker", "RolloutWorkerConfig", "one rollout worker (`knittrans rollout`)"),
    (
        "knittrans.api.settings",
        "Settings",
        "the control plane's settings (`KNITTRANS_*` environment variables; `knittrans control-plane` flags set them)",
    ),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("``", "`")


def cli_md() -> str:
    """The CLI reference: one table of flags per subcommand."""
    out = [
        "# CLI reference",
        "",
        "Every flag of every `knittrans` subcommand, from its argparse parser (defaults with no",
        "`KNITTRANS_*` variable set). `knittrans <command> --help` prints the same. `tests/data/cli_flags.json`",
        "freezes flags and defaults; `tests/test_docs_reference.py` checks that every flag appears here;",
        "`python scripts/docs_reference.py` regenerates this page.",
        "",
        "Global: `knittrans [--log-level LEVEL] COMMAND ...` (default `INFO`).",
        "",
    ]
    for name, (module, help_text) in SUBCOMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"knittrans {name}")
        importlib.import_module(module).add_arguments(parser)
        out += [f"## `knittrans {name}`", "", help_text[0].upper() + help_text[1:] + ".", ""]
        out += ["| flag | default | what |", "|---|---|---|"]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}` (positional)"
            if action.choices:
                flags += " {" + ",".join(str(c) for c in action.choices) + "}"
            default = action.default
            shown = "" if default is None or default is argparse.SUPPRESS else f"`{default}`"
            if action.required:
                shown = "required"
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                shown = "switch"
            what = (action.help or "").replace("\n", " ").replace("%(default)s", str(default)).replace("%%", "%")
            out.append(f"| {flags} | {shown} | {_cell(what)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _fields(cls: type) -> dict[str, tuple[str, str, str | None]]:
    """``{field: (docstring, annotation, default source or None)}`` from the class body, in order."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, tuple[str, str, str | None]] = {}
    last = None
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            last = node.target.id
            value = ast.unparse(node.value) if node.value else None
            found[last] = ("", ast.unparse(node.annotation), value)
        elif last and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            _doc, annotation, value = found[last]
            found[last] = (" ".join(str(node.value.value).split()), annotation, value)
            last = None
        else:
            last = None
    return found


def _default(source: str | None) -> str:
    if source is None:
        return "required"
    if "default_factory=" in source:
        return f"`{source.split('default_factory=')[1].rstrip(')')}()`"
    if source.startswith("Field("):
        match = re.search(r"default=([^,)]+)", source)
        return f"`{match.group(1)}`" if match else ""
    return f"`{source}`"


def config_md() -> str:
    """The configuration reference: one table of fields per config class."""
    out = [
        "# Configuration reference",
        "",
        "Every field of the public configuration objects, from their source (type, default and the",
        "docstring under each field). Configs are frozen, keyword-only dataclasses that raise `ValueError` for",
        "bad values; the control plane's `Settings` is pydantic-settings. `python scripts/docs_reference.py`",
        "regenerates this page.",
        "",
    ]
    for module, name, what in CONFIGS:
        cls = getattr(importlib.import_module(module), name)
        out += [f"## {name}", "", f"`{module}.{name}`: {what}.", ""]
        out += ["| field | type | default | what |", "|---|---|---|---|"]
        for field, (doc, annotation, value) in _fields(cls).items():
            out.append(f"| `{field}` | `{_cell(annotation)}` | {_cell(_default(value))} | {_cell(doc)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    """Rewrite both pages."""
    for key in [k for k in os.environ if k.startswith("KNITTRANS_")]:
        del os.environ[key]
    (ROOT / "docs" / "reference" / "cli.md").write_text(cli_md())
    (ROOT / "docs" / "reference" / "config.md").write_text(config_md())


if __name__ == "__main__":
    main()
