"""``knittrans token``: mint a scoped bearer token offline, with the admin token as the key."""

from __future__ import annotations

import argparse
import os
import sys

from knittrans.api.auth import Scope, mint_token
from knittrans.errors import InvalidRequest
from knittrans.names import check_name

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommand."""
    parser.add_argument(
        "--role",
        required=True,
        choices=("worker", "rank", "store"),
        help="worker: one job's rollout; rank: one job's trainer (one rank with --rank); store: node registration",
    )
    parser.add_argument("--job", default=None, help="the job (worker and rank tokens)")
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the one rank a rank token reports for (without it: every rank, as rank 0 of a collective group does)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the token on stdout; errors name what is missing."""
    secret = os.environ.get("KNITTRANS_ADMIN_TOKEN")
    if not secret:
        print(
            "knittrans token: set KNITTRANS_ADMIN_TOKEN (the control plane's admin token signs the token)",
            file=sys.stderr,
        )
        return 2
    try:
        job = check_name(args.job, "job") if args.role != "store" and args.job else None
        print(mint_token(secret.encode(), Scope(role=args.role, job=job, rank=args.rank)))
    except InvalidRequest as exc:
        print(f"knittrans token: {exc} (--job, --rank)", file=sys.stderr)
        return 2
    return 0
