"""``knittrans control-plane``: serve the control plane with uvicorn on one SQLite state file."""

from __future__ import annotations

import argparse
import logging
import os

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommand."""
    parser.add_argument("--db", required=True, help="SQLite state file (created if missing; WAL mode)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8700, help="TCP port (0 picks a free one)")
    parser.add_argument("--worker-token", default=os.environ.get("KNITTRANS_WORKER_TOKEN"),
                        help="bearer token for writers, ranks and stores (default $KNITTRANS_WORKER_TOKEN)")
    parser.add_argument("--admin-token", default=os.environ.get("KNITTRANS_ADMIN_TOKEN"),
                        help="bearer token for job and node administration (default $KNITTRANS_ADMIN_TOKEN)")
    parser.add_argument("--node-timeout-s", type=float, default=30.0, help="heartbeat timeout of store nodes")
    parser.add_argument("--db-synchronous", choices=("NORMAL", "FULL"), default="NORMAL",
                        help="SQLite synchronous pragma (FULL also survives power loss)")


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from knittrans.api.app import create_app
    from knittrans.api.settings import Settings

    settings = Settings(db_path=args.db, worker_token=args.worker_token, admin_token=args.admin_token,
                        node_timeout_s=args.node_timeout_s, db_synchronous=args.db_synchronous)
    app = create_app(settings)
    logger.info("control plane on http://%s:%d (state %s)", args.host, args.port, args.db)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
