"""``knittrans store``: run one store node (Flight server over a directory) until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from knittrans.cliargs import default_of
from knittrans.errors import KnitTransError
from knittrans.flight.server import StoreServer, StoreServerConfig
from knittrans.rlimits import raise_open_files_limit
from knittrans.store import StoreConfig

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8815
"""The store's well-known port on the command line (the library's :class:`StoreServerConfig` binds any free one)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``knittrans store``."""
    parser.add_argument(
        "--dir", type=Path, default=default_of(StoreConfig, "root"), help="store directory (default %(default)s)"
    )
    parser.add_argument(
        "--host", default=default_of(StoreServerConfig, "host"), help="interface to bind (default %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="TCP port, 0 for any free one (default %(default)s)"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("KNITTRANS_STORE_TOKEN"),
        help="bearer token required on every call (default $KNITTRANS_STORE_TOKEN)",
    )
    parser.add_argument(
        "--budget-bytes",
        type=int,
        default=default_of(StoreConfig, "budget_bytes"),
        help="byte budget of the store directory (default: none)",
    )
    parser.add_argument(
        "--spill-dir",
        type=Path,
        default=default_of(StoreConfig, "spill_dir"),
        help="disk directory for units over budget",
    )
    parser.add_argument(
        "--node-id",
        default=default_of(StoreServerConfig, "node_id"),
        help="name of this store node (default %(default)s)",
    )
    parser.add_argument(
        "--max-put-bytes",
        type=int,
        default=default_of(StoreServerConfig, "max_put_bytes"),
        help="largest unit a DoPut may upload (default %(default)s)",
    )
    parser.add_argument(
        "--data-lane-port",
        type=int,
        default=default_of(StoreServerConfig, "data_lane_port"),
        help="TCP port of the bulk data lane that serves reads beside Flight (default: any free one; "
        "clients find it with the data_lane action; a TLS store opens no lane, and this flag with "
        "--tls-cert is an error)",
    )
    parser.add_argument(
        "--no-data-lane",
        dest="data_lane",
        action="store_false",
        help="serve reads through Flight DoGet only (no data lane; e.g. where only the Flight port is reachable)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write the endpoint to this file once listening (for launchers and tests)",
    )
    parser.add_argument(
        "--advertise", default=None, help="grpc://HOST:PORT others should use (default: the bound address)"
    )
    parser.add_argument(
        "--control-url",
        default=os.environ.get("KNITTRANS_CONTROL_URL"),
        help="control plane to register with and heartbeat to (default $KNITTRANS_CONTROL_URL)",
    )
    parser.add_argument(
        "--control-token",
        default=os.environ.get("KNITTRANS_WORKER_TOKEN"),
        help="worker token of the control plane (default $KNITTRANS_WORKER_TOKEN)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=None,
        help="seconds between heartbeats (default: what the control plane asks, a sixth of its node timeout)",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=os.environ.get("KNITTRANS_TLS_CERT") or None,
        help="PEM certificate: serve grpc+tls (needs --tls-key; default $KNITTRANS_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        type=Path,
        default=os.environ.get("KNITTRANS_TLS_KEY") or None,
        help="PEM private key of --tls-cert (default $KNITTRANS_TLS_KEY)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving a non-loopback address without --token (anyone could read and write)",
    )


def run(args: Any) -> int:
    """Start the server, announce the endpoint, serve until a signal."""
    if not (args.token or args.insecure or _loopback(args.host)):
        logger.error(
            "refusing to serve %s without a token: set KNITTRANS_STORE_TOKEN (or --token), "
            "or pass --insecure to accept an open store",
            args.host,
        )
        return 2
    try:
        config = _config(args)
    except ValueError as exc:  # e.g. --data-lane-port with --tls-cert
        logger.error("cannot start the store: %s", exc)
        return 2
    raise_open_files_limit()  # every connection (Flight and the data lane) is a descriptor
    server = StoreServer(config)
    logger.info(
        "store node %s ready at %s (%s units recovered)", config.node_id, server.endpoint, server.store.recovered
    )
    if args.ready_file is not None:
        tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
        tmp.write_text(server.endpoint)
        tmp.rename(args.ready_file)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stopped = threading.Event()
    if args.control_url:
        endpoint = args.advertise or server.endpoint
        threading.Thread(
            target=_announce,
            args=(args, endpoint, stopped, server.store.stats),
            daemon=True,
            name="knittrans-heartbeat",
        ).start()
    try:
        server.serve()
    finally:
        stopped.set()
    return 0


def _config(args: Any) -> StoreServerConfig:
    """The server configuration the options ask for (ValueError: options that do not go together)."""
    return StoreServerConfig(
        store=StoreConfig(root=args.dir, budget_bytes=args.budget_bytes, spill_dir=args.spill_dir),
        host=args.host,
        port=args.port,
        node_id=args.node_id,
        token=args.token or None,
        max_put_bytes=args.max_put_bytes,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        data_lane=args.data_lane,
        data_lane_port=args.data_lane_port,
        ticket_key=os.environ.get("KNITTRANS_TICKET_KEY") or None,  # never a flag: keys stay off command lines
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _node_key(root: Path, node_id: str) -> str:
    """The node's own control-plane credential, kept beside its units so a restart keeps it (mode 0600)."""
    path = root / f".node-key-{node_id}"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        key = secrets.token_hex(24)
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return key


def _announce(args: Any, endpoint: str, stopped: threading.Event, usage: Callable[[], Mapping[str, Any]]) -> None:
    """Register the node with the control plane, then heartbeat with ``usage()`` until stopped (errors retried)."""
    from knittrans.controlclient import ControlClient  # the store itself needs no HTTP client

    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    node_key = _node_key(Path(args.dir), args.node_id)
    registered = False
    interval = args.heartbeat_s or 2.0  # until the control plane says (it answers with its heartbeat_s)
    with ControlClient(args.control_url, token=args.control_token) as control:
        while not stopped.is_set():
            try:
                if not registered:
                    answer = control.register_node(args.node_id, endpoint, host, node_key=node_key)
                    registered = True
                    logger.info("registered node %s (%s) with %s", args.node_id, endpoint, args.control_url)
                else:
                    answer = control.heartbeat(args.node_id, usage())
                if args.heartbeat_s is None:
                    interval = float(answer.get("heartbeat_s", interval))
            except KnitTransError as exc:  # away, restarting, or it declared this node lost: register again
                logger.warning("control plane %s: %s", args.control_url, exc)
                registered = False
            except Exception:  # a bug here must not stop the heartbeats (the node would be declared lost)
                logger.exception("heartbeat to %s failed unexpectedly", args.control_url)
                registered = False
            stopped.wait(interval)
