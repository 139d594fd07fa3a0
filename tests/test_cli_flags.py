"""Every ``knittrans`` command's flags and defaults, frozen: a change must be deliberate.

The table (flag, destination, default, type, choices, required, action) of each subcommand is
compared with ``tests/data/cli_flags.json``. After an intended change of flags or defaults,
regenerate the file and review its diff::

    .venv/bin/python -m tests.test_cli_flags --write

Help texts are left out (rewording them is not a change of behaviour). Defaults read from
``KNITTRANS_*`` environment variables are taken with those variables unset.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from knittrans.cli import SUBCOMMANDS

SNAPSHOT = Path(__file__).parent / "data" / "cli_flags.json"


def _action_row(action: argparse.Action) -> dict[str, Any]:
    kind = type(action).__name__.lstrip("_").removesuffix("Action")
    return {
        "flags": list(action.option_strings) or [action.dest],
        "dest": action.dest,
        "default": None if action.default is None else repr(action.default),
        "type": getattr(action.type, "__name__", None if action.type is None else repr(action.type)),
        "choices": None if action.choices is None else [str(c) for c in action.choices],
        "required": bool(action.required),
        "action": kind,
        "nargs": action.nargs,
    }


def flag_table() -> dict[str, list[dict[str, Any]]]:
    """``{command: [one row per flag]}`` built from each subcommand's ``add_arguments``."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KNITTRANS_")}
    try:
        table: dict[str, list[dict[str, Any]]] = {}
        for name, (module_name, _help) in sorted(SUBCOMMANDS.items()):
            parser = argparse.ArgumentParser(prog=f"knittrans {name}")
            importlib.import_module(module_name).add_arguments(parser)
            table[name] = [_action_row(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        return table
    finally:
        os.environ.update(saved)


def test_flags_and_defaults_match_the_snapshot() -> None:
    """A flag added, removed or given another default shows here; regenerate the snapshot if intended."""
    expected = json.loads(SNAPSHOT.read_text())
    actual = flag_table()
    assert sorted(actual) == sorted(expected), "commands differ from tests/data/cli_flags.json"
    for command in expected:
        assert actual[command] == expected[command], (
            f"`knittrans {command}` flags differ from tests/data/cli_flags.json "
            "(if intended: .venv/bin/python -m tests.test_cli_flags --write)"
        )


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_answers_help(command: str) -> None:
    """``knittrans <command> --help`` parses and exits 0 for every command in the table."""
    from knittrans.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0


def _control_plane_settings(argv: list[str]) -> Any:
    from knittrans.api.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(argv))


def test_control_plane_flags_leave_unset_fields_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """An absent flag takes KNITTRANS_<FIELD> (as Settings promises), a given flag wins, else the default."""
    for name in (
        "KNITTRANS_NODE_TIMEOUT_S",
        "KNITTRANS_DB_SYNCHRONOUS",
        "KNITTRANS_DB_INIT",
        "KNITTRANS_WORKER_TOKEN",
        "KNITTRANS_ADMIN_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)
    plain = _control_plane_settings(["--db", "x.db"])
    assert (plain.node_timeout_s, plain.db_synchronous, plain.db_init, plain.worker_token) == (
        30.0,
        "NORMAL",
        False,
        None,
    )
    monkeypatch.setenv("KNITTRANS_NODE_TIMEOUT_S", "7.5")
    monkeypatch.setenv("KNITTRANS_DB_SYNCHRONOUS", "FULL")
    monkeypatch.setenv("KNITTRANS_DB_INIT", "true")
    monkeypatch.setenv("KNITTRANS_WORKER_TOKEN", "w-token")
    from_env = _control_plane_settings(["--db", "x.db"])
    assert (from_env.node_timeout_s, from_env.db_synchronous, from_env.db_init) == (7.5, "FULL", True)
    assert from_env.worker_token is not None and from_env.worker_token.get_secret_value() == "w-token"
    flags = _control_plane_settings(
        ["--db", "x.db", "--node-timeout-s", "3", "--db-synchronous", "NORMAL", "--worker-token", "flag-token"]
    )
    assert (flags.node_timeout_s, flags.db_synchronous) == (3.0, "NORMAL")
    assert flags.worker_token is not None and flags.worker_token.get_secret_value() == "flag-token"
    assert flags.db_path == "x.db"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_cli_flags --write")
    table = flag_table()
    lines = ",\n".join(
        f"  {json.dumps(command)}: [\n" + ",\n".join(f"    {json.dumps(row, sort_keys=True)}" for row in rows) + "\n  ]"
        for command, rows in table.items()
    )
    SNAPSHOT.write_text("{\n" + lines + "\n}\n")  # one flag a line: a change is a one-line diff
    print(f"wrote {SNAPSHOT}")
