"""``knittrans rollout``: one rollout worker process (engine + writer) until the job is finished."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
from typing import Any

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``knittrans rollout`` (defaults from :class:`RolloutWorkerConfig`)."""
    from knittrans.cliargs import default_of
    from knittrans.rollout.worker import RolloutWorkerConfig

    def default(name: str) -> Any:
        return default_of(RolloutWorkerConfig, name)

    parser.add_argument("--control-url", required=True, help="control plane base URL")
    parser.add_argument("--job", required=True, help="job name")
    parser.add_argument("--worker-id", required=True, help="unique worker name (prefixes group ids)")
    parser.add_argument("--node-id", required=True, help="store node this worker writes to")
    parser.add_argument("--store-endpoint", required=True, help="grpc://HOST:PORT of that store node")
    parser.add_argument("--store-dir", default=None, help="the node's directory when on this host (direct writes)")
    parser.add_argument(
        "--source",
        action="append",
        required=True,
        help="NAME:PMIN-PMAX:RMIN-RMAX[:image=CxHxW]; repeat for several sources",
    )
    parser.add_argument("--model-dir", required=True, help="initial policy checkpoint directory")
    parser.add_argument("--weights-dir", required=True, help="where the trainer publishes policy-v<N>.safetensors")
    parser.add_argument("--state-file", required=True, help="worker state file (restarts resume from it)")
    parser.add_argument(
        "--engine", choices=("hf", "vllm"), default=default("engine"), help="inference engine (default %(default)s)"
    )
    parser.add_argument(
        "--group-size", type=int, default=default("group_size"), help="responses per prompt (job's group size)"
    )
    parser.add_argument(
        "--groups-per-call", type=int, default=default("groups_per_call"), help="prompts per generate call / unit"
    )
    parser.add_argument("--temperature", type=float, default=default("temperature"))
    parser.add_argument(
        "--chunk-tokens", type=int, default=default("chunk_tokens"), help="partial rollout chunk (tokens)"
    )
    parser.add_argument(
        "--weights-wait-s",
        type=float,
        default=default("weights_wait_s"),
        help="longest wait for a reported version's weights file before generating with older weights "
        "(counted as late on the control plane; default %(default)s)",
    )
    parser.add_argument("--vocab-size", type=int, default=default("vocab_size"))
    parser.add_argument("--reward", default=default("reward"), help="'parity' or package.module:function")
    parser.add_argument("--seed", type=int, default=default("seed"))
    parser.add_argument("--max-groups", type=int, default=None, help="stop after this many groups")
    parser.add_argument("--token", default=os.environ.get("KNITTRANS_WORKER_TOKEN"), help="control-plane token")
    parser.add_argument("--store-token", default=os.environ.get("KNITTRANS_STORE_TOKEN"), help="store token")


def run(args: Any) -> int:
    """Build the worker and run it; SIGTERM stops it at once, like Ctrl-C (a KeyboardInterrupt wherever it is),
    and the worker is closed either way."""
    from knittrans.rollout.worker import RolloutWorker, RolloutWorkerConfig, SourceProfile

    given = vars(args)  # every flag but --source and --max-groups is the config field of its name
    config = RolloutWorkerConfig(
        sources=tuple(SourceProfile.parse(s) for s in args.source),
        **{f.name: given[f.name] for f in dataclasses.fields(RolloutWorkerConfig) if f.name in given},
    )

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    worker = RolloutWorker(config)
    try:
        written = worker.run(max_groups=args.max_groups)
        logger.info("%s: finished after %d groups", config.worker_id, written)
    except KeyboardInterrupt:
        logger.info("%s: stopped after %d groups", config.worker_id, worker.groups_written)
    finally:
        worker.close()
    return 0
