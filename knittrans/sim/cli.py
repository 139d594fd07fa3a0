"""``knittrans sim``: compare admission policies on simulated workloads (table, JSON, PNG plots)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from knittrans.errors import InvalidRequest
from knittrans.sched.admission import POLICIES
from knittrans.sim.engine import SimulationStalled
from knittrans.sim.sweep import LEGEND, configurations, format_table, run_grid
from knittrans.sim.workload import bundled_workloads, load_workload

__all__ = ["ProgressBar", "add_arguments", "run"]

logger = logging.getLogger(__name__)


class ProgressBar:
    """A one-line progress bar on a text stream (stderr), redrawn at most every 0.1 s."""

    def __init__(self, total: int) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream: TextIO = sys.stderr  # looked up now, not at import
        self.width = 30
        self._last = 0.0
        self._start = time.monotonic()

    def advance(self, label: str) -> None:
        """Count one more unit of work and redraw."""
        self.done += 1
        now = time.monotonic()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = min(1.0, self.done / self.total)
        filled = int(frac * self.width)
        elapsed = now - self._start
        eta = elapsed / frac - elapsed if frac > 0 else math.inf
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {100 * frac:5.1f}% "
            f"{self.done}/{self.total} steps  {elapsed:5.0f}s (eta {eta:4.0f}s)  {label[:48]:<48}"
        )
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        self.stream.write("\n")
        self.stream.flush()


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _lookahead_list(text: str) -> list[int | str]:
    error = argparse.ArgumentTypeError(f"expected integers >= 0 or K, got {text!r}")
    try:
        values: list[int | str] = [v if v == "K" else int(v) for v in (v.strip() for v in text.split(",")) if v]
    except ValueError:
        raise error from None
    if not values or any(isinstance(v, int) and v < 0 for v in values):
        raise error
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``knittrans sim``."""
    parser.add_argument(
        "--workload",
        action="append",
        default=None,
        help=f"bundled name ({', '.join(bundled_workloads())}), a .yaml path, or 'all'; repeatable "
        "(default: all bundled)",
    )
    parser.add_argument("--policy", default="all", help=f"one of {', '.join(POLICIES)}, or 'all' (default)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="train steps per run (default: the workload's)")
    parser.add_argument(
        "--mini-batches",
        type=_int_list,
        default=None,
        help="sweep K, mini-batches per step, e.g. 4,8,16 (default: the workload's)",
    )
    parser.add_argument(
        "--window",
        type=_int_list,
        default=None,
        help="sweep W, off-policy window in train batches, e.g. 1,2 (default: the workload's)",
    )
    parser.add_argument(
        "--lookahead",
        type=_lookahead_list,
        default=None,
        help="sweep L, mini-batches admitted beyond the trainer's position, e.g. 0,1,2,K "
        "(K: one train batch; default: the workload's)",
    )
    parser.add_argument(
        "--publish-delay",
        type=float,
        default=None,
        help="override the trainer's publish delay (s): weights saved after each optimizer step, before its ack",
    )
    parser.add_argument(
        "--sync-delay", type=float, default=None, help="override the delay (s) from the ack until weights reach rollout"
    )
    parser.add_argument(
        "--load-s", type=float, default=None, help="override the time (s) a rollout engine is blocked loading weights"
    )
    parser.add_argument(
        "--groups-per-call",
        type=int,
        default=None,
        help="override the groups a rollout engine generates one after the other and publishes as one unit",
    )
    parser.add_argument(
        "--in-flight", choices=("on", "off"), default=None, help="override in-flight weight updates (partial rollout)"
    )
    parser.add_argument(
        "--launch-weights",
        choices=("arrived", "published"),
        default=None,
        help="override which weights a new group starts with: arrived (background sync) or published "
        "(wait for the newest published weights, as knittrans rollout does)",
    )
    parser.add_argument(
        "--launch-lead",
        type=float,
        default=None,
        help="prototype: duration-aware launches, this fraction of the lead of knittrans.sched.timing.launch_lead "
        "(0 off, 1 whole)",
    )
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="also run the colocated reference (zero architectural staleness by construction)",
    )
    parser.add_argument(
        "--tb-handover",
        choices=("step", "mini_batch"),
        default=None,
        help="how train_batch's groups leave the window: step (default: a conventional trainer "
        "handed the whole train batch) or mini_batch (the project's rule: the paced baseline)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write summaries and per-run metrics here")
    parser.add_argument("--per-step", action="store_true", help="include per-step metrics in the JSON")
    parser.add_argument(
        "--plots", type=Path, default=None, help="write PNG plots (seed 0) of every configuration into this directory"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the sweep, print the table, write JSON and plots; 2 on bad input."""
    try:
        names = args.workload or ["all"]
        if "all" in names:
            names = bundled_workloads() + [n for n in names if n != "all"]
        workloads = [load_workload(n) for n in names]
        overrides: dict[str, Any] = {}
        for flag, name in (
            ("publish_delay", "publish_delay_s"),
            ("sync_delay", "sync_delay_s"),
            ("load_s", "load_s"),
            ("groups_per_call", "groups_per_call"),
            ("launch_lead", "launch_lead"),
            ("launch_weights", "launch_weights"),
            ("tb_handover", "train_batch_handover"),
            ("in_flight", "in_flight_updates"),
        ):
            value = getattr(args, flag)
            if value is not None:
                overrides[name] = value == "on" if flag == "in_flight" else value
        if overrides:
            workloads = [w.with_overrides(**overrides) for w in workloads]
        if args.policy != "all" and args.policy not in POLICIES:
            raise InvalidRequest(f"unknown policy {args.policy!r}; valid: {', '.join(POLICIES)} or all")
        policies = list(POLICIES) if args.policy == "all" else [args.policy]
        if args.seeds < 1:
            raise InvalidRequest(f"--seeds must be >= 1, got {args.seeds}")
        if args.steps is not None and args.steps < 1:
            raise InvalidRequest(f"--steps must be >= 1, got {args.steps}")
        ks = args.mini_batches or [None]
        ws = args.window or [None]
        ls: list[int | str | None] = list(args.lookahead or [None])
        configs = configurations(workloads, ks, ws, ls)  # validates every combination before running anything
    except ValueError as exc:
        print(f"knittrans sim: {exc}", file=sys.stderr)
        return 2
    modes = len(policies) + (1 if args.colocated else 0) + 1  # + the paced baseline
    total = sum((args.steps or w.steps) for w in configs) * modes * args.seeds
    bar = None if args.no_progress else ProgressBar(total)
    try:
        results = run_grid(
            configs,
            policies,
            seeds=args.seeds,
            steps=args.steps,
            colocated=args.colocated,
            progress=None if bar is None else (lambda done, label: bar.advance(label)),
        )
    except SimulationStalled as exc:  # a configuration that can never finish (e.g. colocated, tight staleness bound)
        if bar is not None:
            bar.close()
        print(f"knittrans sim: {exc}", file=sys.stderr)
        return 1
    if bar is not None:
        bar.close()
    print(format_table(results))
    print(LEGEND)
    if args.json is not None:
        payload = {
            "configs": [c.summary() for c in results],
            "runs": [m.to_json(per_step=args.per_step) for c in results for ms in c.runs.values() for m in ms],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, allow_nan=True))
        logger.info("wrote %s", args.json)
    if args.plots is not None:
        from knittrans.sim.plots import write_plots  # matplotlib only when asked

        for c in results:
            w = c.workload
            prefix = f"{w.name}_K{w.mini_batches_per_step}_W{w.window}_L{w.lookahead}"
            metrics = {label: runs[0] for label, runs in c.runs.items()}
            for path in write_plots(metrics, c.traces, args.plots, prefix):
                logger.info("wrote %s", path)
    return 0
