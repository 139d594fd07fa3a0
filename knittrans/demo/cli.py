"""``knittrans demo``: the whole pipeline on this machine on embedded defaults (``--compare``: against baselines)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from knittrans.cliargs import default_of
from knittrans.demo.config import DemoConfig
from knittrans.sched.admission import POLICIES

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``knittrans demo`` (defaults from :class:`DemoConfig`)."""

    def default(name: str) -> Any:
        return default_of(DemoConfig, name)

    parser.add_argument("--policy", choices=POLICIES, default=default("policy"), help="admission policy")
    parser.add_argument(
        "--engine", choices=("hf", "vllm"), default=default("engine"), help="rollout engine (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=default("steps"), help="train steps (default %(default)s)")
    parser.add_argument(
        "--mini-batches",
        type=int,
        default=default("mini_batches_per_step"),
        help="mini-batches per step K (default %(default)s)",
    )
    parser.add_argument("--fetch-mode", choices=("iter", "eager"), default=default("fetch_mode"))
    parser.add_argument("--out", type=Path, default=default("out_dir"), help="output directory")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run constraint_preserving and both train_batch baselines (whole-step and paced handover) on the "
        "same workload and compare",
    )
    parser.add_argument(
        "--tb-handover",
        choices=("mini_batch", "step"),
        default=default("train_batch_handover"),
        help="with --policy train_batch: step frees the whole train batch when a step starts (the conventional "
        "baseline), mini_batch each mini-batch's groups (default %(default)s)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=default("window"),
        help="off-policy window W in train batches (default %(default)s)",
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        default=default("lookahead"),
        help="admission lookahead L: mini-batches admitted beyond the trainer (default %(default)s)",
    )
    parser.add_argument(
        "--scenario",
        choices=("default", "slow-trainer"),
        default="default",
        help="slow-trainer: every mini-batch takes >= --min-step-s (3 s unless given), about 3x "
        "rollout's pace, so the window, not rollout, sets the pace (docs/getting-started/local-stack.md)",
    )
    parser.add_argument(
        "--min-step-s",
        type=float,
        default=None,
        help="pad every mini-batch to at least this many seconds (default 0; 3 for slow-trainer)",
    )
    parser.add_argument("--hidden", type=int, default=default("hidden"), help="policy hidden size, a multiple of 64")
    parser.add_argument("--layers", type=int, default=default("layers"), help="policy decoder layers")
    parser.add_argument("--seed", type=int, default=default("seed"))
    parser.add_argument("--timeout-s", type=float, default=default("timeout_s"))


def run(args: Any) -> int:
    """Run the demo (or the comparison), print the tables, write JSON and PNG."""
    from knittrans.demo.report import compare_runs, format_comparison, format_table, plot_results
    from knittrans.demo.run import run_demo

    slow = args.scenario == "slow-trainer"
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(DemoConfig)}}
    given.update(out_dir=args.out, mini_batches_per_step=args.mini_batches)  # the flags not named as their field
    if args.min_step_s is None:
        given["min_step_s"] = 3.0 if slow else default_of(DemoConfig, "min_step_s")
    # the slow trainer's time is the padding, not the model: a small policy keeps the run short
    if slow and (args.hidden, args.layers) == (default_of(DemoConfig, "hidden"), default_of(DemoConfig, "layers")):
        given.update(hidden=128, layers=2)

    runs = (
        [("train_batch", "step"), ("train_batch", "mini_batch"), ("constraint_preserving", "mini_batch")]
        if args.compare
        else [(args.policy, args.tb_handover)]
    )
    results = {}
    for policy, handover in runs:
        res = run_demo(DemoConfig(**given | {"policy": policy, "train_batch_handover": handover}))
        results[res["label"]] = res
        print(f"\n== {res['label']} ==")
        print(format_table(res))
    png = plot_results(results, Path(args.out) / "demo.png")
    summary: dict[str, Any] = {
        "runs": {label: {"staleness": r["staleness"], "wall_s": r["wall_s"]} for label, r in results.items()}
    }
    if args.compare:
        summary["reductions"] = compare_runs(results)
        print("\n" + format_comparison(results))
    out = Path(args.out) / "summary.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"\nresults: {out}, per-run JSON in {args.out}/<run>/results.json, plot: {png}")
    return 0
