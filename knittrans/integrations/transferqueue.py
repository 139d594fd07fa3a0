"""A TransferQueue storage backend that keeps data in node-local KnitTrans stores (docs/how-to/frameworks.md, 1)."""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from knittrans.integrations.tqbootstrap import BACKEND_NAME, bootstrap, release_owned
from knittrans.integrations.tqstore import NODE_ENV, StoreNodeLost, TQBackendConfig, TQStoreCore

# torch (and the codec, which needs it) is imported on first use, not with this module: importing
# torch fixes its intra-op thread count, and Ray sets OMP_NUM_THREADS for an actor only after the
# worker's setup hook ran (see register()).

__all__ = [
    "BACKEND_NAME",
    "NODE_ENV",
    "KnitTransStorageManager",
    "StoreNodeLost",
    "TQBackendConfig",
    "bootstrap",
    "register",
]


def _make_manager_class() -> type[Any]:
    """Build the StorageManager subclass (TransferQueue is imported only here)."""
    from tensordict import TensorDict
    from transfer_queue.metadata import extract_field_schema
    from transfer_queue.storage.managers.base import StorageManager

    class KnitTransStorageManagerImpl(StorageManager):  # type: ignore[misc]
        """TransferQueue ``StorageManager`` over node-local KnitTrans stores (docs/how-to/frameworks.md)."""

        def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
            self.core = TQStoreCore(TQBackendConfig.from_conf(config))
            super().__init__(controller_info, config)  # its own ZMQ context: only the notify path uses ZMQ

        async def put_data(
            self, data: TensorDict, metadata: Any, data_parser: Callable[[Any], Any] | None = None
        ) -> None:
            if data_parser is not None:
                raise NotImplementedError(f"data_parser is not supported by the {BACKEND_NAME} backend")
            n = len(metadata.global_indexes)
            if data.batch_size[0] != n:
                raise ValueError(f"put of {data.batch_size[0]} rows for {n} global indexes")
            if n == 0:
                return
            partition = metadata.partition_ids[0]
            columns = {k: data.get(k) for k in data.keys()}  # noqa: SIM118 - iterating a TensorDict yields rows
            locs = await asyncio.to_thread(self.core.put, columns, n, list(metadata.global_indexes), partition)
            for pos, loc in enumerate(locs):
                metadata._custom_backend_meta[pos].update(loc)
            per_index = dict(zip(metadata.global_indexes, locs, strict=True))
            await self.notify_data_update(
                partition, list(metadata.global_indexes), extract_field_schema(data), per_index
            )

        async def get_data(self, metadata: Any) -> TensorDict:
            if metadata.size == 0 or not metadata.field_names:
                return TensorDict({}, batch_size=metadata.size)
            args = _rows(metadata)
            if self.core.all_local(args[2]):
                # memory-mapped units of this host: a short CPU-bound read, done here as SimpleStorage
                # packs its answer on the loop too (a hop to a thread costs more than the read)
                fields = self.core.get(*args)
            else:  # DoGets wait on the network: keep the client's loop free meanwhile
                fields = await asyncio.to_thread(self.core.get, *args)
            return TensorDict(fields, batch_size=metadata.size)

        async def clear_data(self, metadata: Any) -> None:
            await asyncio.to_thread(self.core.clear, *_rows(metadata))

        async def save_checkpoint(self, checkpoint_dir: str) -> None:
            from knittrans.integrations.tqcheckpoint import save_units

            await asyncio.to_thread(save_units, self.core, checkpoint_dir)

        async def load_checkpoint(self, checkpoint_dir: str) -> None:
            from knittrans.integrations.tqcheckpoint import load_units

            await asyncio.to_thread(load_units, self.core, checkpoint_dir)

        def close(self) -> None:
            if hasattr(self, "core"):
                self.core.close()
                if _closing_global_client(self):
                    release_owned()
            super().close()

    return KnitTransStorageManagerImpl


def _rows(metadata: Any) -> tuple[list[str], list[int], Any]:
    """Field names, global indexes and backend meta of a ``BatchMeta`` (what ``TQStoreCore`` reads and clears)."""
    return list(metadata.field_names), list(metadata.global_indexes), metadata._custom_backend_meta


def _closing_global_client(manager: Any) -> bool:
    """Whether ``manager`` is being closed by ``tq.close()`` (then the stores this process's ``tq.init`` started
    go with it): TransferQueue 0.1.11's ``close()`` drops its storage handles, then closes its global client."""
    interface = sys.modules.get("transfer_queue.interface")
    client = getattr(interface, "_TQ_CLIENT", None)
    return getattr(interface, "_TQ_STORAGE", ()) is None and getattr(client, "storage_manager", None) is manager


KnitTransStorageManager: type[Any] | None = None
"""The registered StorageManager class (set by :func:`register`)."""


def register() -> None:
    """Register the ``KnitTrans`` backend (manager + bootstrap) with TransferQueue; idempotent.

    Usable as Ray's ``worker_process_setup_hook`` so every worker process knows the backend. Ray runs
    that hook when the worker process starts, *before* it sets ``OMP_NUM_THREADS`` for the actor or
    task the process will run; importing TransferQueue (hence torch) there would fix torch's
    intra-op thread count at the number of cores in every worker, TransferQueue's controller
    included, whose per-request torch ops then wait on an OpenMP team on a loaded host. So in a Ray
    worker whose thread count is not set yet, and that has not imported TransferQueue, this only
    arranges for the registration to happen right after the process imports ``transfer_queue``.
    """
    if KnitTransStorageManager is not None:
        return
    if "transfer_queue" not in sys.modules and _ray_worker_before_task():
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
        return
    _register_now()


def _ray_worker_before_task() -> bool:
    """Whether this is a Ray worker process that has not been given its thread count yet."""
    if "OMP_NUM_THREADS" in os.environ:
        return False
    ray = sys.modules.get("ray")
    worker = getattr(getattr(getattr(ray, "_private", None), "worker", None), "global_worker", None)
    return worker is not None and getattr(worker, "mode", None) == getattr(ray, "WORKER_MODE", object())


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register` once the ``transfer_queue`` package has been imported in this process."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "transfer_queue":
            return None
        sys.meta_path.remove(self)  # one shot; the real finders locate the package
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register_now()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _register_now() -> None:
    global KnitTransStorageManager
    if KnitTransStorageManager is not None:
        return
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManagerFactory

    cls = _make_manager_class()
    StorageManagerFactory.register(BACKEND_NAME)(cls)
    StorageBootstrapProvider.register_provider(BACKEND_NAME)(bootstrap)
    KnitTransStorageManager = cls
