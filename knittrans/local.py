"""A whole KnitTrans stack on this machine: a control plane and store nodes as real processes on loopback."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from knittrans.controlclient import ControlClient
from knittrans.procs import ProcessGroup, control_plane_args, knittrans_command, token_env, wait_ready, wait_until

__all__ = ["ClusterConfig", "LocalCluster", "StoreNode"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Shape of a local cluster."""

    work_dir: Path
    """Holds the SQLite file, the store directories and the process logs."""
    num_stores: int = 2
    """Store nodes (one per simulated rollout host)."""
    host: str = "127.0.0.1"
    """Address every process binds to."""
    worker_token: str | None = None
    """Control-plane worker token (also used as the stores' token)."""
    admin_token: str | None = None
    """Control-plane admin token."""
    node_timeout_s: float = 30.0
    """Heartbeat timeout after which the control plane declares a store node lost."""
    start_timeout_s: float = 60.0
    """How long to wait for each process to come up."""

    def __post_init__(self) -> None:
        if self.num_stores < 1:
            raise ValueError("num_stores must be >= 1")


@dataclass(frozen=True, kw_only=True)
class StoreNode:
    """One running store node: what a :class:`~knittrans.rollout.writer.TrajectoryWriter` needs to write to it."""

    node_id: str
    """Its node id (``node-<index>``)."""
    endpoint: str
    """Its Flight endpoint, ``grpc://127.0.0.1:<port>``."""
    store_dir: Path
    """Its data directory (a writer on this host may pass it as ``store_dir`` to write there directly)."""
    name: str
    """Child process name in the cluster's :class:`ProcessGroup`."""


class LocalCluster:
    """A control plane and store nodes running as child processes of this one.

    Start it with ``with LocalCluster(config) as cluster:`` (or :meth:`start`); every process stops when the
    block exits (or on :meth:`stop`).

    Attributes:
        control_url: The control plane's base URL (``http://127.0.0.1:<port>``), for
            :class:`~knittrans.trainer.client.TrainerConfig` and :class:`~knittrans.controlclient.ControlClient`.
        stores: The running store nodes, in index order.
        procs: The child processes; their logs are in ``work_dir/logs``.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.work_dir = Path(config.work_dir)
        self.procs = ProcessGroup(self.work_dir / "logs")
        self._clients: list[ControlClient] = []  # handed out by control(); closed by stop()
        self.control_url = ""
        self.stores: list[StoreNode] = []
        self._db = self.work_dir / "control.db"

    def start_control_plane(self, *, port: int | None = None) -> None:
        """Start (or restart on the same database and port) the control plane and wait until it serves.

        ``port``: listen there. Default: the first start binds port 0 and reads the real port from the
        ready file (no free-port race); a restart binds the same port again, so the stores' and
        workers' URL stays valid.
        """
        if port is None:
            port = int(self.control_url.rsplit(":", 1)[1]) if self.control_url else 0
        ready = self.work_dir / "control-plane.ready"
        argv = control_plane_args(
            self._db, port=port, host=self.config.host, ready_file=ready, node_timeout_s=self.config.node_timeout_s
        )
        env = token_env(worker_token=self.config.worker_token, admin_token=self.config.admin_token)
        self.control_url = json.loads(self._start("control-plane", argv, env, ready, "control plane"))["url"]

    def rollout_args(
        self,
        job: str,
        *,
        worker_id: str,
        sources: list[str],
        model_dir: Path,
        weights_dir: Path,
        state_file: Path,
        group_size: int,
        store: int = 0,
    ) -> list[str]:
        """``knittrans rollout`` arguments of a worker writing into store node ``store`` of this cluster
        (append further flags, then start it with ``knittrans_command(*args)``)."""
        node = self.stores[store]
        args = ["rollout", "--control-url", self.control_url, "--job", job, "--worker-id", worker_id]
        args += ["--node-id", node.node_id, "--store-endpoint", node.endpoint, "--store-dir", str(node.store_dir)]
        for source in sources:
            args += ["--source", source]
        args += ["--model-dir", str(model_dir), "--weights-dir", str(weights_dir), "--state-file", str(state_file)]
        return [*args, "--group-size", str(group_size)]

    def train_args(
        self,
        job: str,
        *,
        rank: int,
        world_size: int,
        model_dir: Path,
        out: Path,
        weights_dir: Path | None = None,
        dist_url: str | None = None,
    ) -> list[str]:
        """``knittrans train`` arguments of rank ``rank`` of ``job`` on this cluster (append further flags,
        then start it with ``knittrans_command(*args)``)."""
        args = ["train", "--control-url", self.control_url, "--job", job, "--rank", str(rank)]
        args += ["--world-size", str(world_size), "--model-dir", str(model_dir), "--out", str(out)]
        if weights_dir is not None:
            args += ["--weights-dir", str(weights_dir)]
        if dist_url is not None:
            args += ["--dist-url", dist_url]
        return args

    def start_store(self, index: int, *, port: int = 0) -> StoreNode:
        """Start store node ``index`` (``node-<index>``) and wait until it has registered with the control plane.

        ``port``: listen there (a restart at the same endpoint); default a free port.
        """
        node_id = f"node-{index}"
        store_dir = self.work_dir / "stores" / node_id
        store_dir.mkdir(parents=True, exist_ok=True)
        ready = self.work_dir / f"{node_id}.ready"
        argv = [
            "store",
            "--dir",
            str(store_dir),
            "--host",
            self.config.host,
            "--port",
            str(port),
            "--node-id",
            node_id,
            "--ready-file",
            str(ready),
            "--control-url",
            self.control_url,
        ]
        env = token_env(store_token=self.config.worker_token, worker_token=self.config.worker_token)
        name = f"store-{index}"
        endpoint = self._start(name, argv, env, ready, f"store {node_id}").strip()
        node = StoreNode(node_id=node_id, endpoint=endpoint, store_dir=store_dir, name=name)
        with self.control() as control:
            wait_until(
                lambda: any(n["node_id"] == node_id for n in control.list_nodes()),
                timeout_s=self.config.start_timeout_s,
                what=f"registration of {node_id}",
            )
        return node

    def _start(self, name: str, argv: list[str], env: dict[str, str], ready: Path, what: str) -> str:
        """Start child ``name`` (``knittrans ARGV``) and wait until it writes its ``ready`` file; the file's text."""
        ready.unlink(missing_ok=True)
        proc = self.procs.start(name, knittrans_command(*argv), env=env)
        output = functools.partial(self.procs.log_tail, name)
        wait_ready(proc, ready.exists, timeout_s=self.config.start_timeout_s, what=what, output=output)
        return ready.read_text()

    def start(self) -> LocalCluster:
        """Start the control plane and every store node."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.start_control_plane()
        self.stores = [self.start_store(i) for i in range(self.config.num_stores)]
        logger.info(
            "local cluster up: control plane %s, stores %s",
            self.control_url,
            ", ".join(s.endpoint for s in self.stores),
        )
        return self

    def control(self, *, admin: bool = False) -> ControlClient:
        """A client of the control plane with the worker (or admin) token."""
        token = (self.config.admin_token or self.config.worker_token) if admin else self.config.worker_token
        client = ControlClient(self.control_url, token=token)
        self._clients.append(client)
        return client

    def stop(self) -> None:
        """Close the clients :meth:`control` handed out; stop every process (SIGTERM, then SIGKILL)."""
        while self._clients:
            self._clients.pop().close()
        self.procs.stop_all()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
