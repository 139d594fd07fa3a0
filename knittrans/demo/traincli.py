"""``knittrans train``: one data-parallel trainer rank of the demo (GRPO on a tiny VLM, gloo gradient all-reduce)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def _local_dir(value: str) -> tuple[str, str]:
    node, sep, directory = value.partition("=")
    if not sep or not node or not directory:
        raise argparse.ArgumentTypeError(f"--local-dir wants NODE=DIR, got {value!r}")
    return node, directory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommand (defaults from :class:`TrainerConfig` and :class:`RankConfig`)."""
    from knittrans.cliargs import default_of
    from knittrans.demo.rank import RankConfig
    from knittrans.trainer.client import TrainerConfig

    parser.add_argument("--control-url", required=True, help="control plane, e.g. http://127.0.0.1:8700")
    parser.add_argument("--job", required=True, help="job name")
    parser.add_argument("--rank", type=int, required=True, help="this rank, 0 <= rank < world size")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    parser.add_argument(
        "--dist-url", default=None, help="tcp://HOST:PORT of the gloo process group (not needed for world size 1)"
    )
    parser.add_argument("--model-dir", type=Path, required=True, help="saved transformers causal LM (tiny Qwen2)")
    parser.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="rank 0 publishes policy-v{n}.safetensors here after every optimizer step",
    )
    parser.add_argument(
        "--fetch-mode",
        choices=("eager", "iter"),
        default=default_of(TrainerConfig, "fetch_mode"),
        help="eager: whole share first; iter: next micro-batch fetched while one computes",
    )
    parser.add_argument(
        "--fetch-timeout-s",
        type=float,
        default=default_of(TrainerConfig, "fetch_timeout_s"),
        help="timeout of one Flight call to a store node (a dead host raises instead of blocking)",
    )
    parser.add_argument(
        "--replan-wait-s",
        type=float,
        default=default_of(TrainerConfig, "replan_wait_s"),
        help="after a failed mini-batch, how long to wait for its re-plan before retrying it",
    )
    parser.add_argument(
        "--local-dir",
        type=_local_dir,
        action="append",
        default=[],
        metavar="NODE=DIR",
        help="store dir of a node on this host, read memory-mapped (repeatable)",
    )
    parser.add_argument("--lr", type=float, default=default_of(RankConfig, "lr"), help="AdamW learning rate")
    parser.add_argument(
        "--image-channels",
        type=int,
        default=default_of(RankConfig, "image_channels"),
        help="channels of the media images",
    )
    parser.add_argument("--no-dedup", action="store_true", help="encode every media reference (baseline)")
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file, one record per mini-batch")
    parser.add_argument(
        "--token",
        default=os.environ.get("KNITTRANS_WORKER_TOKEN"),
        help="control-plane worker token (default $KNITTRANS_WORKER_TOKEN)",
    )
    parser.add_argument(
        "--store-token",
        default=os.environ.get("KNITTRANS_STORE_TOKEN"),
        help="store nodes' token (default $KNITTRANS_STORE_TOKEN)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument(
        "--min-step-s",
        type=float,
        default=default_of(RankConfig, "min_step_s"),
        help="pad every mini-batch to at least this many seconds (emulate a heavier model)",
    )


def run(args: argparse.Namespace) -> int:
    """Train until the job is finished; 0 on success."""
    from knittrans.demo.rank import RankConfig, run_rank
    from knittrans.trainer.client import TrainerConfig

    given = vars(args)  # every flag but --local-dir, --threads and --no-dedup is the config field of its name

    def named(config: type) -> dict[str, Any]:
        return {f.name: given[f.name] for f in dataclasses.fields(config) if f.name in given}

    try:
        client = TrainerConfig(
            local_dirs=dict(args.local_dir), torch_threads=args.threads or None, **named(TrainerConfig)
        )
        cfg = RankConfig(client=client, dedup=not args.no_dedup, **named(RankConfig))
    except ValueError as exc:
        logger.error("knittrans train: %s", exc)
        return 2
    trained = run_rank(cfg)
    logger.info("rank %d: job %s finished after %d mini-batches", args.rank, args.job, trained)
    return 0
