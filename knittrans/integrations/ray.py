"""Run KnitTrans on Ray: one store node per Ray node, the control plane as an actor (docs/how-to/deploy.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from knittrans.procs import ProcessGroup, control_plane_args, knittrans_command, token_env, wait_ready, wait_until

__all__ = ["KnitTransCluster", "StoreInfo", "node_affinity", "start_cluster", "start_control_plane", "start_stores"]

logger = logging.getLogger(__name__)


def _ray() -> Any:
    """Import Ray lazily; a clear hint when it is missing."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("knittrans.integrations.ray needs Ray: pip install 'knittrans[ray]'") from exc
    return ray


def node_affinity(node_id: str) -> Any:
    """A hard node-affinity scheduling strategy for ``node_id`` (a Ray node id in hex)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


class _KnitTransProcess:
    """Actor body: one ``knittrans`` child process on this actor's node, stopped with the actor."""

    def __init__(
        self, argv: list[str], log_dir: str, name: str, ready_file: str, env: dict[str, str] | None = None
    ) -> None:
        self._ready = Path(ready_file)
        self._ready.unlink(missing_ok=True)
        self._log = Path(log_dir) / f"{name}.log"  # ProcessGroup's log of child ``name``
        self._group = ProcessGroup(Path(log_dir))
        self._proc = self._group.start(name, knittrans_command(*argv), env=env)

    def node(self) -> str:
        """Ray node id this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        """Block until the child wrote its ready file; return its content (a store's endpoint)."""
        wait_ready(self._proc, self._ready.exists, timeout_s=timeout_s, what=f"knittrans child (log: {self._log})")
        return self._ready.read_text().strip()

    def stop(self) -> None:
        """SIGTERM the child's process group, SIGKILL after 10 s (as :class:`~knittrans.local.LocalCluster`)."""
        self._group.stop_all()


@dataclass(frozen=True, kw_only=True)
class StoreInfo:
    """One store node started on one Ray node."""

    ray_node_id: str
    """Ray node id (hex) the store is pinned to."""
    node_id: str
    """KnitTrans node id (``store-<first 8 hex of the Ray node id>``)."""
    endpoint: str
    """Flight location others dial."""
    store_dir: str
    """Store directory on that node (rollout actors on the same node may write into it directly)."""


@dataclass
class KnitTransCluster:
    """Handle of a running control plane and its stores; :meth:`shutdown` stops them."""

    control_url: str
    """Base URL of the control plane (hand it to trainer and rollout actors)."""
    stores: list[StoreInfo]
    """One per Ray node."""
    worker_token: str | None = None
    """Control-plane worker token."""
    store_token: str | None = None
    """Store token."""
    actors: list[Any] = field(default_factory=list)
    """Ray actor handles owned by this handle."""

    def store_for(self, ray_node_id: str) -> StoreInfo:
        """The store on ``ray_node_id`` (a rollout actor writes to the store of its own node)."""
        for s in self.stores:
            if s.ray_node_id == ray_node_id:
                return s
        raise KeyError(f"no KnitTrans store on Ray node {ray_node_id}; stores: {[s.ray_node_id for s in self.stores]}")

    def rollout_args(self, ray_node_id: str) -> list[str]:
        """``knittrans rollout`` flags pointing a worker on ``ray_node_id`` at its node's store."""
        s = self.store_for(ray_node_id)
        return [
            "--control-url",
            self.control_url,
            "--node-id",
            s.node_id,
            "--store-endpoint",
            s.endpoint,
            "--store-dir",
            s.store_dir,
        ]

    def env(self) -> dict[str, str]:
        """Token environment for ``knittrans`` processes started by actors."""
        return token_env(worker_token=self.worker_token, store_token=self.store_token)

    def shutdown(self) -> None:
        """Stop every store and the control plane (actors killed after their child stopped)."""
        stop_actors(self.actors)
        self.actors.clear()


def stop_actors(actors: Sequence[Any]) -> None:
    """Stop the actors (their ``stop`` ends a child or a store; all at once), then kill each."""
    ray = _ray()
    stops = [(actor, actor.stop.remote()) for actor in actors]
    for actor, stopped in stops:
        try:
            ray.get(stopped, timeout=30)
        except Exception as exc:  # the actor or its node may already be gone
            logger.warning("stopping %s: %s", actor, exc)
        ray.kill(actor)


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def start_control_plane(
    work_dir: str | Path,
    *,
    worker_token: str | None = None,
    admin_token: str | None = None,
    node_timeout_s: float = 30.0,
    ray_node_id: str | None = None,
    detached: bool = False,
    port: int = 8700,
) -> tuple[str, Any]:
    """Start ``knittrans control-plane`` in an actor; returns ``(url, actor)``.

    Args:
        work_dir: directory on that node for the SQLite state and the log.
        ray_node_id: pin it to this node (default: the driver's node).
        detached: outlive the driver (a named, detached actor; stop it with ``ray.kill``).
        port: TCP port on the node's IP address.
    """
    ray = _ray()
    node = ray_node_id or ray.get_runtime_context().get_node_id()
    ip = next(n["NodeManagerAddress"] for n in _alive_nodes(ray) if n["NodeID"] == node)
    ready = Path(work_dir) / "control-plane.ready"
    argv = control_plane_args(
        Path(work_dir) / "control.db", port=port, host=ip, ready_file=ready, node_timeout_s=node_timeout_s
    )
    env = token_env(worker_token=worker_token, admin_token=admin_token)
    actor = (
        ray.remote(_KnitTransProcess)
        .options(
            num_cpus=0,
            scheduling_strategy=node_affinity(node),
            name="knittrans-control-plane",
            lifetime="detached" if detached else None,  # None: the actor shares the driver's fate
        )
        .remote(argv, str(Path(work_dir) / "logs"), "control-plane", str(ready), env)
    )
    ray.get(actor.wait_ready.remote())  # the child writes its ready file once it serves
    url = f"http://{ip}:{port}"
    logger.info("control plane %s on Ray node %s", url, node[:8])
    return url, actor


def start_stores(
    control_url: str,
    *,
    store_root: str | Path = "/dev/shm/knittrans",
    work_dir: str | Path,
    worker_token: str | None = None,
    store_token: str | None = None,
    ray_node_ids: Sequence[str] | None = None,
    heartbeat_s: float | None = None,
) -> tuple[list[StoreInfo], list[Any]]:
    """One ``knittrans store`` per Ray node (all alive nodes by default), pinned there; returns infos and actors.

    Each store binds its node's IP on a free port, registers with the control plane and heartbeats
    (every ``heartbeat_s``; None: as often as the control plane asks).
    """
    ray = _ray()
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in _alive_nodes(ray)}
    chosen = list(ray_node_ids) if ray_node_ids is not None else sorted(nodes)
    missing = [rid for rid in chosen if rid not in nodes]
    if missing:  # checked before any store starts
        raise KeyError(f"Ray node {', '.join(missing)} is not alive; alive: {sorted(nodes)}")
    env = token_env(worker_token=worker_token, store_token=store_token)
    actors: list[Any] = []
    pending = []
    try:
        for rid in chosen:
            node_id = f"store-{rid[:8]}"
            store_dir = str(Path(store_root) / node_id)
            ready = str(Path(work_dir) / f"{node_id}.ready")
            argv = [
                "store",
                "--dir",
                store_dir,
                "--host",
                nodes[rid],
                "--port",
                "0",
                "--node-id",
                node_id,
                "--ready-file",
                ready,
                "--control-url",
                control_url,
                *(["--heartbeat-s", str(heartbeat_s)] if heartbeat_s is not None else []),
            ]
            if not store_token:
                argv.append("--insecure")  # the caller chose an open store on the node's address
            actor = (
                ray.remote(_KnitTransProcess)
                .options(num_cpus=0, scheduling_strategy=node_affinity(rid))
                .remote(argv, str(Path(work_dir) / "logs"), node_id, ready, env)
            )
            actors.append(actor)
            pending.append((rid, node_id, store_dir, actor.wait_ready.remote()))
        infos = [
            StoreInfo(ray_node_id=rid, node_id=nid, endpoint=ray.get(ref), store_dir=d) for rid, nid, d, ref in pending
        ]
        for info, actor in zip(infos, actors, strict=True):
            where = ray.get(actor.node.remote())
            if where != info.ray_node_id:
                raise RuntimeError(f"store {info.node_id} landed on {where}, not {info.ray_node_id}")
        return infos, actors
    except BaseException:  # stop the stores already started: a killed actor's child would outlive it
        stop_actors(actors)
        raise


def start_cluster(
    work_dir: str | Path,
    *,
    worker_token: str | None = None,
    store_token: str | None = None,
    admin_token: str | None = None,
    store_root: str | Path = "/dev/shm/knittrans",
    node_timeout_s: float = 30.0,
    control_port: int = 8700,
) -> KnitTransCluster:
    """Control plane on the driver's node, then one store per alive Ray node; waits until all registered."""
    ray = _ray()
    url, cp = start_control_plane(
        work_dir,
        worker_token=worker_token,
        admin_token=admin_token,
        node_timeout_s=node_timeout_s,
        port=control_port,
    )
    cluster = KnitTransCluster(
        control_url=url,
        stores=[],
        worker_token=worker_token,
        store_token=store_token,
        actors=[cp],
    )
    try:
        stores, actors = start_stores(
            url,
            store_root=store_root,
            work_dir=work_dir,
            worker_token=worker_token,
            store_token=store_token,
        )
        cluster.stores, cluster.actors = stores, [cp, *actors]
        from knittrans.controlclient import ControlClient

        wanted = {s.node_id for s in stores}
        with ControlClient(url, token=worker_token) as control:
            wait_until(
                lambda: wanted <= {n["node_id"] for n in control.list_nodes()},
                timeout_s=60,
                what=f"stores {sorted(wanted)} registering with {url}",
            )
    except BaseException:
        cluster.shutdown()
        raise
    logger.info(
        "KnitTrans on Ray: control plane %s, %d stores (%d Ray nodes)", url, len(cluster.stores), len(_alive_nodes(ray))
    )
    return cluster
