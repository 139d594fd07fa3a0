"""``knittrans control-plane``: serve the control plane with uvicorn on one SQLite state file."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

    from knittrans.api.settings import Settings

__all__ = ["add_arguments", "run", "settings_from_args"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the subcommand."""
    parser.add_argument("--db", required=True, help="SQLite state file (created if missing; WAL mode)")
    parser.add_argument(
        "--init",
        action="store_true",
        default=None,
        help="initialise an existing empty or foreign --db file (otherwise refused; "
        "default $KNITTRANS_DB_INIT, else off)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument(
        "--port",
        type=int,
        default=8700,
        help="TCP port (0 picks a free one; the log and the ready file give the real one)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="once serving, write {url, host, port, pid} as JSON to this file (for launchers and "
        "tests); written atomically",
    )
    # Flags that fill Settings default to None: an absent flag leaves the field to its KNITTRANS_<FIELD>
    # environment variable, then to the Settings default (settings_from_args).
    parser.add_argument(
        "--worker-token",
        default=None,
        help="bearer token for writers, ranks and stores (default $KNITTRANS_WORKER_TOKEN)",
    )
    parser.add_argument(
        "--admin-token",
        default=None,
        help="bearer token for job and node administration (default $KNITTRANS_ADMIN_TOKEN)",
    )
    parser.add_argument(
        "--node-timeout-s",
        type=float,
        default=None,
        help="heartbeat timeout of store nodes (default $KNITTRANS_NODE_TIMEOUT_S, else "
        f"{_settings_default('node_timeout_s')})",
    )
    parser.add_argument(
        "--tls-cert",
        default=os.environ.get("KNITTRANS_TLS_CERT") or None,
        help="PEM certificate: serve HTTPS (needs --tls-key; default $KNITTRANS_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get("KNITTRANS_TLS_KEY") or None,
        help="PEM private key of --tls-cert (default $KNITTRANS_TLS_KEY)",
    )
    parser.add_argument(
        "--http",
        choices=("auto", "h11", "httptools"),
        default=os.environ.get("KNITTRANS_HTTP") or "auto",
        help="uvicorn's HTTP/1.1 implementation: auto = httptools when installed, else h11 "
        "(default $KNITTRANS_HTTP, else auto)",
    )
    parser.add_argument(
        "--db-synchronous",
        choices=("NORMAL", "FULL"),
        default=None,
        help="SQLite synchronous pragma (FULL also survives power loss; default "
        f"$KNITTRANS_DB_SYNCHRONOUS, else {_settings_default('db_synchronous')})",
    )


def _settings_default(name: str) -> object:
    from knittrans.api.settings import Settings
    from knittrans.cliargs import default_of

    return default_of(Settings, name)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The service's settings: the flags given, then ``KNITTRANS_<FIELD>`` variables, then the defaults."""
    from knittrans.api.settings import Settings

    given = {name: getattr(args, name) for name in ("worker_token", "admin_token", "node_timeout_s", "db_synchronous")}
    given["db_init"] = args.init
    return Settings(db_path=args.db, **{k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from knittrans.api.app import create_app
    from knittrans.api.connguard import ConnectionGuard
    from knittrans.rlimits import raise_open_files_limit

    settings = settings_from_args(args)
    app = create_app(settings)
    if (args.tls_cert is None) != (args.tls_key is None):
        logger.error("--tls-cert and --tls-key go together")
        return 2
    # Bind here, not in uvicorn, so that --port 0 gives a port we can report before serving.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the socket says it
    # is TCP (otherwise responses wait for the client's delayed ACK). Accepted sockets inherit NODELAY.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        logger.error("control plane cannot listen on %s:%d: %s", args.host, args.port, exc.strerror or exc)
        return 2
    port = int(sock.getsockname()[1])
    # every connection is a descriptor: unauthenticated ones may take at most half of them
    open_files = raise_open_files_limit()
    cap = settings.max_unauthenticated_connections
    if open_files > 0 and cap > open_files // 2:
        cap = max(1, open_files // 2)
        logger.info("at most %d unauthenticated connections: half the open-files limit of %d", cap, open_files)
    guard = ConnectionGuard(timeout_s=settings.unauthenticated_timeout_s, max_unauthenticated=cap)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            ssl_certfile=args.tls_cert,
            ssl_keyfile=args.tls_key,
            http=guard.protocol(args.http),
        )
    )
    scheme = "https" if args.tls_cert else "http"
    url = f"{scheme}://{f'[{args.host}]' if ':' in args.host else args.host}:{port}"
    return asyncio.run(_serve(server, sock, url, args.ready_file, args.db))


async def _serve(server: uvicorn.Server, sock: socket.socket, url: str, ready_file: Path | None, db: str) -> int:
    """Serve on ``sock``; once uvicorn reports started, log the URL and write the ready file. The exit status:
    0, or 2 when start-up failed (uvicorn logged why)."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():  # start-up failed: surface its exception
            await task
            return 2
        await asyncio.sleep(0.01)
    # Everything made so far (modules, routes, models, the loaded state) lives as long as the process: moved out
    # of the collector's reach, a full collection scans the job state made since, not the ~90k objects of the
    # start-up as well; a full pass then stops every thread, the event loop included, for ~4 ms instead of
    # ~50 ms (docs/decisions/0009-freeze-startup-objects.md).
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    logger.info("control plane on %s (state %s)", url, db)
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(json.dumps({"url": url, "host": host, "port": port, "pid": os.getpid()}))
        tmp.rename(ready_file)
    await task
    return 0
