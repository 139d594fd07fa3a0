"""``tq.init``'s bootstrap for the KnitTrans backend: one store actor per Ray node, and their end at ``tq.close()``."""

from __future__ import annotations

import contextlib
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from knittrans.errors import KnitTransError, NotFound
from knittrans.flight.client import StoreClient
from knittrans.integrations.tqstore import TQBackendConfig

__all__ = ["BACKEND_NAME", "KnitTransStoreActor", "bootstrap", "release_owned"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "KnitTrans"
"""Value of TransferQueue's ``backend.storage_backend`` that selects this backend."""

_OWNED: dict[str, Any] = {}
"""Store node -> actor handle, for the stores this process's bootstrap started."""
_EXTERNAL: list[TQBackendConfig] = []
"""Configurations whose ``stores`` this process's bootstrap checked (not ours to stop)."""


class KnitTransStoreActor:
    """One store node inside a Ray actor on the node it serves."""

    def __init__(
        self, node: str, root: str, host: str | None, token: str | None, budget: int | None, spill: str | None
    ) -> None:
        import ray

        from knittrans.flight.server import StoreServer, StoreServerConfig
        from knittrans.store.store import StoreConfig

        bind = host or ray.util.get_node_ip_address()
        self.dirs = [Path(root), *([Path(spill)] if spill else [])]  # the store creates them
        store = StoreConfig(root=Path(root), budget_bytes=budget, spill_dir=Path(spill) if spill else None)
        self.server = StoreServer(StoreServerConfig(store=store, host=bind, port=0, node_id=node, token=token))

    def endpoint(self) -> str:
        """The store's Flight endpoint."""
        return str(self.server.endpoint)

    def stop(self) -> None:
        """Stop serving and delete the store's directories (and their run directories once empty)."""
        self.server.shutdown()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(OSError):
                d.parent.rmdir()  # <root>/<run>: gone with its last node


def bootstrap(conf: Any) -> dict[str, Any]:
    """TransferQueue bootstrap provider: start a store per alive Ray node unless ``stores`` are given.

    Writes ``stores``, ``ray_nodes``, ``store_dirs`` and ``spill_dirs`` back into ``conf.backend.KnitTrans`` so every
    client (created from the controller's stored config) sees them. Returns the actor handles.
    """
    import ray

    from knittrans.integrations.ray import node_affinity, stop_actors

    section = conf.backend.get(BACKEND_NAME)
    config = TQBackendConfig.from_conf(section)
    if config.stores:
        for node, endpoint in config.stores.items():
            StoreClient(endpoint, token=config.token, timeout_s=config.timeout_s).health()
            logger.info("KnitTrans store %s at %s is up", node, endpoint)
        _EXTERNAL.append(config)
        return {}
    actor_cls = ray.remote(num_cpus=0)(KnitTransStoreActor)
    run = uuid.uuid4().hex[:8]
    handles, ray_nodes, dirs, spills = {}, {}, {}, {}
    try:
        for i, node_info in enumerate(n for n in ray.nodes() if n.get("Alive")):
            node = f"tq-node-{i}"
            dirs[node] = str(Path(config.store_root) / run / node)
            spill = str(Path(config.spill_dir) / run / node) if config.spill_dir else None
            if spill:
                spills[node] = spill
            ray_nodes[node_info["NodeID"]] = node
            handles[node] = actor_cls.options(  # type: ignore[attr-defined,unused-ignore]  # typed only with ray
                name=f"KnitTransStore#{run}-{i}",
                scheduling_strategy=node_affinity(node_info["NodeID"]),
            ).remote(node, dirs[node], config.host, config.token, config.budget_bytes, spill)
        stores = dict(zip(handles, ray.get([h.endpoint.remote() for h in handles.values()]), strict=True))
    except BaseException:  # stop the stores already started (a later node's failed): nothing else would
        stop_actors(list(handles.values()))
        raise
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(
        section if section is not None else {},
        {"stores": stores, "ray_nodes": ray_nodes, "store_dirs": dirs, "spill_dirs": spills},
    )
    conf.backend[BACKEND_NAME] = merged
    _OWNED.update(handles)
    logger.info("started KnitTrans stores %s", stores)
    return handles


def release_owned() -> None:
    """Stop the stores this process started and delete their directories; delete the job's units on stores
    it was given. Idempotent; nothing to do in a process whose bootstrap did not run."""
    handles = list(_OWNED.values())
    _OWNED.clear()
    if handles:
        from knittrans.integrations.ray import stop_actors

        stop_actors(handles)
    while _EXTERNAL:
        config = _EXTERNAL.pop()
        for node, endpoint in config.stores.items():
            client = StoreClient(endpoint, token=config.token, timeout_s=config.timeout_s)
            try:
                for info in client.list_units(config.job):
                    with contextlib.suppress(NotFound):
                        client.delete(config.job, str(info["unit_id"]))
            except KnitTransError as exc:
                logger.warning("could not delete job %s's units on %s: %s", config.job, node, exc)
            finally:
                client.close()
