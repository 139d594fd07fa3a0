"""The ``knittrans`` console command: one subcommand per process kind, each in its own module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("knittrans.demo.cli", "run the whole pipeline on this machine (rollout, stores, control plane, trainers)"),
    "store": ("knittrans.flight.cli", "serve a node-local store over Arrow Flight"),
    "control-plane": ("knittrans.api.cli", "serve the control plane (FastAPI + uvicorn, SQLite state)"),
    "rollout": ("knittrans.rollout.cli", "run a rollout worker: generate groups, write units, register them"),
    "train": ("knittrans.demo.traincli", "run one trainer rank (GRPO on a tiny policy, gloo all-reduce)"),
    "token": ("knittrans.api.tokencli", "mint a scoped bearer token offline (admin token from the environment)"),
    "status": ("knittrans.statusview", "show jobs, store nodes and ranks of a control plane (--watch redraws)"),
    "sim": ("knittrans.sim.cli", "simulate admission policies under rollout skew"),
    "bench": ("knittrans.benchcli", "run a benchmark from benchmarks/ (transfer, control_plane, trainer, baselines)"),
}

# Packages of the optional extras (pyproject.toml); a subcommand that needs a missing one names its extra.
MODEL_STACK = frozenset({"torch", "transformers", "safetensors", "PIL", "matplotlib"})
EXTRAS: dict[str, str] = {"rollout": "rollout", "train": "demo", "demo": "demo", "bench": "demo"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``knittrans`` command."""
    parser = argparse.ArgumentParser(prog="knittrans", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only import the module of the chosen subcommand: heavy imports (torch, vllm) stay lazy.
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                modules[name] = importlib.import_module(module_name)
                modules[name].add_arguments(p)
            except ModuleNotFoundError as exc:
                parser.exit(2, _missing_extra(name, exc))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    try:
        return int(modules[args.command].run(args))
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        sys.stderr.write(_missing_extra(args.command, exc))
        return 2


def _missing_extra(command: str, exc: ModuleNotFoundError) -> str:
    """The message for a subcommand whose optional dependency is not installed (other import errors re-raised)."""
    if exc.name is None or exc.name.split(".")[0] not in MODEL_STACK:
        raise exc
    return (
        f"knittrans {command} needs {exc.name}, which the core install leaves out: "
        f"pip install 'knittrans[{EXTRAS.get(command, 'demo')}]'\n"
    )


if __name__ == "__main__":
    sys.exit(main())
