"""A TransferQueue storage backend that keeps data in node-local KnitTrans stores.

Select it through TransferQueue's own configuration (``backend.storage_backend``) after this
module is imported in every process that creates a TransferQueue client (for Ray workers, pass
``runtime_env={"worker_process_setup_hook": "knittrans.integrations.transferqueue.register"}``)::

    import knittrans.integrations.transferqueue  # registers "KnitTrans" with TransferQueue
    tq.init(OmegaConf.create({"backend": {"storage_backend": "KnitTrans",
                                          "KnitTrans": {"media_fields": ["image"]}}}))

What it does: TransferQueue's controller, samplers, ``BatchMeta`` and client API are kept; only
its storage seam (``StorageManager.put_data / get_data / clear_data``) is replaced.

* ``put_data`` (runs in the producer): one put becomes one storage unit (Arrow IPC, see
  :mod:`knittrans.integrations.tqcodec`) written to the KnitTrans store *of the producer's node*.
  Media fields (``media_fields``) are stored once per content hash. Each (row, field) gets
  ``(node, unit, row, n, jagged)`` as TransferQueue ``custom_backend_meta``: the controller keeps
  it and hands it back in every ``BatchMeta``, so any process can find the row.
* ``get_data`` (runs in the consumer): rows are grouped by node; one ``DoGet`` per node carries
  exactly the requested rows (row ranges) and the requested fields' columns, plus one ``media``
  ``DoGet`` per node for the unique media hashes of those rows (a node whose store directory is on
  this host is served from memory-mapped units instead, same tickets, directly on the client's event
  loop: no thread hand-off). Fields written by different puts with different column layouts split
  into one ``DoGet`` per layout; several nodes or layouts are read in parallel. Decoding copies each
  column once (media rows straight from the media buffers into the batch tensor; 1-D jagged fields
  into one jagged nested tensor). A store that cannot be reached raises :class:`StoreNodeLost`
  naming the node, its endpoint and the rows that lived there.
* ``clear_data`` deletes a unit once one clear covers all its rows (``clear_partition`` always
  does); a partial clear keeps the unit until its remaining rows are cleared together.

Stores: with ``stores`` empty, ``tq.init`` (the bootstrap provider) starts one store actor per
alive Ray node, pinned to it, serving a tmpfs directory. Or give ``stores: {node: endpoint}`` of
stores started elsewhere (``knittrans store``). A producer's node is the entry of ``ray_nodes``
for its Ray node id, or the ``KNITTRANS_TQ_NODE`` environment variable when set.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa

from knittrans.errors import InvalidRequest, KnitTransError, NotFound, Unavailable
from knittrans.flight.client import StoreClient
from knittrans.names import check_name
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.store.unit import LocalReader
from knittrans.tickets import Ticket, UnitRead

# torch (and the codec, which needs it) is imported on first use, not with this module: importing
# torch fixes its intra-op thread count, and Ray sets OMP_NUM_THREADS for an actor only after the
# worker's setup hook ran (see register()).

__all__ = ["BACKEND_NAME", "KnitTransStorageManager", "StoreNodeLost", "TQBackendConfig", "register"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "KnitTrans"
"""Value of TransferQueue's ``backend.storage_backend`` that selects this backend."""
NODE_ENV = "KNITTRANS_TQ_NODE"
"""Environment variable naming the producer's store node (overrides the Ray node lookup)."""


class StoreNodeLost(Unavailable):
    """A store node holding requested rows cannot be reached."""


@dataclass(frozen=True, kw_only=True)
class TQBackendConfig:
    """``backend.KnitTrans`` of a TransferQueue configuration."""

    job: str = "transferqueue"
    """Job directory the units are stored under on every node."""
    stores: Mapping[str, str] = field(default_factory=dict)
    """Store node name -> Flight endpoint; empty means the bootstrap starts one per Ray node."""
    ray_nodes: Mapping[str, str] = field(default_factory=dict)
    """Ray node id -> store node name (filled by the bootstrap)."""
    store_dirs: Mapping[str, str] = field(default_factory=dict)
    """Store node name -> its directory; a producer on that host writes files there (no DoPut)."""
    store_root: str = "/dev/shm/knittrans-tq"
    """Root under which the bootstrap's stores keep ``<node>/`` directories."""
    media_fields: tuple[str, ...] = ()
    """Fields stored once per content hash (images, audio, video frames)."""
    token: str | None = None
    """Bearer token of the stores; None for none (loopback)."""
    host: str | None = None
    """Interface the bootstrap's stores bind; None means the Ray node's IP address."""
    timeout_s: float = 60.0
    """Deadline of one store call."""

    def __post_init__(self) -> None:
        check_name(self.job, "backend.KnitTrans.job", error=InvalidRequest)
        for node in self.stores:
            check_name(node, "backend.KnitTrans.stores node", error=InvalidRequest)
        if self.timeout_s <= 0:
            raise InvalidRequest(f"backend.KnitTrans.timeout_s must be positive, not {self.timeout_s}")

    @classmethod
    def from_conf(cls, conf: Any) -> TQBackendConfig:
        """From TransferQueue's (OmegaConf or dict) backend section; unknown keys are named."""
        raw = _plain(conf) or {}
        known = set(cls.__dataclass_fields__)
        extra = sorted(k for k in raw if k not in known and k != "zmq_info")
        if extra:
            raise InvalidRequest(f"backend.KnitTrans: unknown keys {extra}; known keys are {sorted(known)}")
        body = {k: v for k, v in raw.items() if k in known and v is not None}
        if "media_fields" in body:
            body["media_fields"] = tuple(body["media_fields"])
        return cls(**body)


def _plain(conf: Any) -> dict[str, Any]:
    if conf is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(conf, DictConfig):
            out = OmegaConf.to_container(conf, resolve=True)
            return dict(out) if isinstance(out, dict) else {}
    except ImportError:  # pragma: no cover - omegaconf ships with transferqueue
        pass
    return dict(conf)


Loc = tuple[str, str, int, int, bool]
"""Where one (row, field) lives: ``(node, unit, row in unit, rows in unit, jagged column)``. Carried
as TransferQueue ``custom_backend_meta`` (a tuple, or a list after a msgpack hop): five scalars
rather than a keyed dict, so the controller's per-request copies and the BatchMeta it ships stay small."""


def _is_loc(meta: Any) -> bool:
    return type(meta) in (tuple, list) and len(meta) == 5


def _loc(meta: Any, field_name: str, gidx: int) -> Loc:
    if not _is_loc(meta):
        raise NotFound(
            f"field {field_name!r} of global index {gidx} has no KnitTrans location; was it put through the "
            f"{BACKEND_NAME} backend?"
        )
    node, unit, row, n, jagged = meta
    return node, unit, row, n, jagged


def _ranges(rows: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for r in sorted(set(rows)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return tuple((a, b) for a, b in out)


class _Core:
    """The storage logic without TransferQueue's base class (so it is usable and testable alone)."""

    def __init__(self, config: TQBackendConfig) -> None:
        self.config = config
        self._clients: dict[str, StoreClient] = {}
        self._writers: dict[str, TrajectoryWriter] = {}
        self._local: dict[str, LocalReader | None] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="knittrans-tq")

    # ------------------------------------------------------------------ placement
    def local_node(self) -> str:
        """The store node of this process: ``KNITTRANS_TQ_NODE``, else this Ray node's store."""
        node = os.environ.get(NODE_ENV)
        if node is None:
            try:
                import ray

                ray_node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
            except ImportError:  # pragma: no cover
                ray_node = None
            node = self.config.ray_nodes.get(ray_node or "")
            if node is None and len(self.config.stores) == 1:
                node = next(iter(self.config.stores))
        if node is None or node not in self.config.stores:
            raise InvalidRequest(
                f"no KnitTrans store for this process (node {node!r}); stores are {sorted(self.config.stores)}. "
                f"Set {NODE_ENV} or start a store on this Ray node"
            )
        return node

    def endpoint(self, node: str) -> str:
        try:
            return self.config.stores[node]
        except KeyError:
            raise StoreNodeLost(
                f"store node {node!r} is not in backend.KnitTrans.stores {sorted(self.config.stores)}"
            ) from None

    def client(self, node: str) -> StoreClient:
        if node not in self._clients:
            self._clients[node] = StoreClient(
                self.endpoint(node), token=self.config.token, timeout_s=self.config.timeout_s
            )
        return self._clients[node]

    def _reader(self, node: str) -> Callable[[Ticket], pa.Table]:
        """How to serve a ticket of ``node``: memory-map its units when its directory is on this host
        (the same short-circuit as ``TrainerClient``'s ``mmap`` mode), else one ``DoGet``."""
        local = self._local[node] if self._is_local(node) else None
        return local.read if local is not None else self.client(node).get

    def _writer(self, node: str) -> TrajectoryWriter:
        if node not in self._writers:
            store_dir = self.config.store_dirs.get(node)
            local = store_dir if store_dir and Path(store_dir).is_dir() else None
            self._writers[node] = TrajectoryWriter(
                job=self.config.job,
                node_id=node,
                endpoint=self.endpoint(node),
                store_dir=local,
                token=self.config.token,
                timeout_s=self.config.timeout_s,
            )
        return self._writers[node]

    # ------------------------------------------------------------------ put
    def put(
        self, data: Mapping[str, Any], n: int, global_indexes: Sequence[int], partition: str
    ) -> list[dict[str, Loc]]:
        """Write one put as one unit on this node; per row, ``{field: location}`` (TQ's backend meta)."""
        from knittrans.integrations.tqcodec import encode_put, field_columns

        node = self.local_node()
        tables = encode_put(
            data, n, global_indexes=global_indexes, partition=partition, media_fields=self.config.media_fields
        )
        writer = self._writer(node)
        unit_id = writer.new_unit_id()
        try:
            writer.write_tables(unit_id, tables)
        except Unavailable as exc:
            raise StoreNodeLost(f"store node {node!r} ({self.endpoint(node)}) cannot take the put: {exc}") from None
        names = set(tables.traj.schema.names)
        jagged = {f: field_columns(names, f)[-1].endswith("#shape") for f in data}
        return [{f: (node, unit_id, i, n, jagged[f]) for f in data} for i in range(n)]

    # ------------------------------------------------------------------ get
    def get(
        self, field_names: Sequence[str], global_indexes: Sequence[int], backend_meta: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """``{field: batched tensor | list of row values}`` for the rows, in ``global_indexes`` order."""
        n = len(global_indexes)
        # (node, unit) -> {field: [(position, row)]}
        where: dict[tuple[str, str], dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
        layout: dict[tuple[str, str], dict[str, bool]] = defaultdict(dict)
        for pos, (gidx, meta) in enumerate(zip(global_indexes, backend_meta, strict=True)):
            for f in field_names:
                node, unit, row, _, jagged = _loc(meta.get(f), f, gidx)
                where[(node, unit)][f].append((pos, row))
                layout[(node, unit)][f] = jagged
        # one DoGet per node and column layout: units whose requested fields have the same columns
        groups: dict[tuple[str, tuple[tuple[str, bool], ...]], list[str]] = defaultdict(list)
        for key in where:
            groups[(key[0], tuple(sorted(layout[key].items())))].append(key[1])
        jobs = [(node, fields, units) for (node, fields), units in groups.items()]
        if len(jobs) == 1:  # the common case (one node, one layout): no hop to the pool
            results = [self._fetch(*jobs[0], where)]
        else:
            results = list(self._pool.map(lambda j: self._fetch(j[0], j[1], j[2], where), jobs))
        parts: dict[str, list[tuple[list[int], Any]]] = defaultdict(list)
        for per_field in results:
            for f, (positions, value) in per_field.items():
                parts[f].append((positions, value))
        return {f: _assemble(parts[f], n) for f in field_names}

    def all_local(self, backend_meta: Sequence[Mapping[str, Any]]) -> bool:
        """Whether every row of ``backend_meta`` lives on a node whose units this host memory-maps (no
        network wait: :meth:`get` is then a short CPU-bound call)."""
        nodes = {loc[0] for meta in backend_meta for loc in meta.values() if _is_loc(loc)}
        return all(self._is_local(str(node)) for node in nodes)

    def _is_local(self, node: str) -> bool:
        if node not in self._local:
            store_dir = self.config.store_dirs.get(node)
            self._local[node] = LocalReader([store_dir]) if store_dir and Path(store_dir).is_dir() else None
        return self._local[node] is not None

    def _fetch(
        self,
        node: str,
        layout: tuple[tuple[str, bool], ...],
        units: list[str],
        where: Mapping[tuple[str, str], Mapping[str, list[tuple[int, int]]]],
    ) -> dict[str, tuple[list[int], Any]]:
        from knittrans.integrations.tqcodec import column_name, decode_column, decode_media

        fields = tuple(f for f, _ in layout)
        reads = []
        for unit in units:
            rows = [r for f in fields for _, r in where[(node, unit)][f]]
            reads.append(UnitRead(unit_id=unit, row_ranges=_ranges(rows)))
        read = self._reader(node)
        columns = tuple(
            c
            for f, jagged in layout
            for c in ([column_name(f), column_name(f) + "#shape"] if jagged else [column_name(f)])
        )
        try:
            table = read(Ticket(job=self.config.job, reads=tuple(reads), columns=columns))
            media = None
            media_cols = [column_name(f) for f in fields if f in self.config.media_fields]
            if media_cols:
                hashes = sorted({h.hex() for c in media_cols for h in table.column(c).to_pylist()})
                if hashes:
                    media = decode_media(
                        read(
                            Ticket(
                                job=self.config.job,
                                kind="media",
                                reads=tuple(UnitRead(unit_id=u) for u in units),
                                media_hashes=tuple(hashes),
                            )
                        )
                    )
        except Unavailable as exc:
            gidx = sorted({p for u in units for f in fields for p, _ in where[(node, u)][f]})
            raise StoreNodeLost(
                f"KnitTrans store node {node!r} ({self.endpoint(node)}) is unreachable; it holds fields "
                f"{list(fields)} of {len(gidx)} requested rows (batch positions {gidx[:8]}"
                f"{'...' if len(gidx) > 8 else ''}): {exc}"
            ) from None
        # position in the DoGet result of every (unit, row): reads in order, ranges sorted
        offset, index = 0, {}
        for unit_read in reads:
            for a, b in unit_read.row_ranges:
                for r in range(a, b):
                    index[(unit_read.unit_id, r)] = offset
                    offset += 1
        out: dict[str, tuple[list[int], Any]] = {}
        for f in fields:
            # in batch order, so that one DoGet's answer needs no reordering after decoding
            pairs = sorted((pos, index[(u, r)]) for u in units for pos, r in where[(node, u)][f])
            positions = [p for p, _ in pairs]
            rows = [i for _, i in pairs]
            # rows already in DoGet order (a batch of whole puts, or its ranges in order): no take
            part = table if rows == list(range(table.num_rows)) else table.take(pa.array(rows, type=pa.int64()))
            out[f] = (positions, decode_column(part, f, media))
        return out

    # ------------------------------------------------------------------ clear
    def clear(
        self, field_names: Sequence[str], global_indexes: Sequence[int], backend_meta: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, str]]:
        """Delete units whose every row is cleared by this call; returns the deleted (node, unit)."""
        rows: dict[tuple[str, str], set[int]] = defaultdict(set)
        sizes: dict[tuple[str, str], int] = {}
        for gidx, meta in zip(global_indexes, backend_meta, strict=True):
            for f in field_names:
                if not _is_loc(meta.get(f)):
                    continue
                node, unit, row, n, _ = _loc(meta[f], f, gidx)
                rows[(node, unit)].add(row)
                sizes[(node, unit)] = n
        deleted = []
        for key, cleared in rows.items():
            if len(cleared) >= sizes[key]:
                try:
                    self.client(key[0]).delete(self.config.job, key[1])
                    deleted.append(key)
                except NotFound:
                    deleted.append(key)
                except KnitTransError as exc:
                    logger.warning("could not delete unit %s on %s: %s", key[1], key[0], exc)
        return deleted

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        # copies: a pool thread still running may add a client while these loops run
        for w in list(self._writers.values()):
            w.close()
        for c in list(self._clients.values()):
            c.close()


def _assemble(parts: list[tuple[list[int], Any]], n: int) -> Any:
    """Rows of one field from several DoGets, in batch order: a batched tensor when possible."""
    import torch

    order = [p for positions, _ in parts for p in positions]
    identity = order == list(range(n))
    if len(parts) == 1 and identity and isinstance(parts[0][1], torch.Tensor):
        return parts[0][1]  # one DoGet in batch order: dense or jagged nested, as decoded
    tensors = [v for _, v in parts if isinstance(v, torch.Tensor) and not v.is_nested]
    if len(tensors) == len(parts) and len({(t.shape[1:], t.dtype) for t in tensors}) == 1:
        cat = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        if identity:
            return cat
        inv = torch.empty(n, dtype=torch.long)
        inv[torch.tensor(order, dtype=torch.long)] = torch.arange(n)
        return cat[inv]
    rows: list[Any] = [None] * n
    for positions, value in parts:
        values = list(value.unbind(0)) if isinstance(value, torch.Tensor) else value
        for p, v in zip(positions, values, strict=True):
            rows[p] = v
    return rows


def _pack(value: Any) -> Any:
    """A field for a TensorDict: batched tensors as they are; row lists as TransferQueue packs them."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    from tensordict import NonTensorStack

    if value and all(isinstance(v, torch.Tensor) for v in value):
        if all(v.dim() == 0 for v in value):
            return torch.stack(value)
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(value, layout=layout)
            except (RuntimeError, TypeError):
                continue
    return NonTensorStack(*value)


def _make_manager_class() -> type[Any]:
    """Build the StorageManager subclass (TransferQueue is imported only here)."""
    from tensordict import TensorDict
    from transfer_queue.metadata import extract_field_schema
    from transfer_queue.storage.managers.base import StorageManager

    class KnitTransStorageManagerImpl(StorageManager):  # type: ignore[misc]
        """TransferQueue ``StorageManager`` over node-local KnitTrans stores (see the module docstring)."""

        def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
            self.core = _Core(TQBackendConfig.from_conf(config))
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
            loop = asyncio.get_running_loop()
            locs = await loop.run_in_executor(None, self.core.put, columns, n, list(metadata.global_indexes), partition)
            per_index: dict[int, dict[str, Any]] = {}
            for pos, gidx in enumerate(metadata.global_indexes):
                per_index[gidx] = locs[pos]
                metadata._custom_backend_meta[pos].update(per_index[gidx])
            await self.notify_data_update(
                partition, list(metadata.global_indexes), extract_field_schema(data), per_index
            )

        async def get_data(self, metadata: Any) -> TensorDict:
            if metadata.size == 0 or not metadata.field_names:
                return TensorDict({}, batch_size=metadata.size)
            args = (list(metadata.field_names), list(metadata.global_indexes), metadata._custom_backend_meta)
            if self.core.all_local(args[2]):
                # memory-mapped units of this host: a short CPU-bound read, done here as SimpleStorage
                # packs its answer on the loop too (a hop to a thread costs more than the read)
                fields = self.core.get(*args)
            else:  # DoGets wait on the network: keep the client's loop free meanwhile
                fields = await asyncio.get_running_loop().run_in_executor(None, self.core.get, *args)
            return TensorDict({f: _pack(v) for f, v in fields.items()}, batch_size=metadata.size)

        async def clear_data(self, metadata: Any) -> None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(
                None,
                self.core.clear,
                list(metadata.field_names),
                list(metadata.global_indexes),
                metadata._custom_backend_meta,
            )

        def close(self) -> None:
            if hasattr(self, "core"):
                self.core.close()
            super().close()

    return KnitTransStorageManagerImpl


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


# ---------------------------------------------------------------------- bootstrap (tq.init)
class KnitTransStoreActor:
    """One store node inside a Ray actor on the node it serves."""

    def __init__(self, node: str, root: str, host: str | None, token: str | None) -> None:
        import ray

        from knittrans.flight.server import StoreServer, StoreServerConfig
        from knittrans.store.store import StoreConfig

        bind = host or ray.util.get_node_ip_address()
        Path(root).mkdir(parents=True, exist_ok=True)
        self.server = StoreServer(
            StoreServerConfig(store=StoreConfig(root=Path(root)), host=bind, port=0, node_id=node, token=token)
        )

    def endpoint(self) -> str:
        return str(self.server.endpoint)

    def stop(self) -> None:
        self.server.shutdown()


def bootstrap(conf: Any) -> dict[str, Any]:
    """TransferQueue bootstrap provider: start a store per alive Ray node unless ``stores`` are given.

    Writes ``stores``, ``ray_nodes`` and ``store_dirs`` back into ``conf.backend.KnitTrans`` so every
    client (created from the controller's stored config) sees them. Returns the actor handles.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    section = conf.backend.get(BACKEND_NAME)
    config = TQBackendConfig.from_conf(section)
    if config.stores:
        for node, endpoint in config.stores.items():
            StoreClient(endpoint, token=config.token, timeout_s=config.timeout_s).health()
            logger.info("KnitTrans store %s at %s is up", node, endpoint)
        return {}
    actor_cls = ray.remote(num_cpus=0)(KnitTransStoreActor)
    run = uuid.uuid4().hex[:8]
    handles, stores, ray_nodes, dirs = {}, {}, {}, {}
    for i, node_info in enumerate(n for n in ray.nodes() if n.get("Alive")):
        node = f"tq-node-{i}"
        root = str(Path(config.store_root) / run / node)
        actor = actor_cls.options(  # type: ignore[attr-defined,unused-ignore]  # typed only where ray is installed
            name=f"KnitTransStore#{run}-{i}",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_info["NodeID"], soft=False),
        ).remote(node, root, config.host, config.token)
        stores[node] = ray.get(actor.endpoint.remote())
        ray_nodes[node_info["NodeID"]] = node
        dirs[node] = root
        handles[node] = actor
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(
        section if section is not None else {}, {"stores": stores, "ray_nodes": ray_nodes, "store_dirs": dirs}
    )
    conf.backend[BACKEND_NAME] = merged
    logger.info("started KnitTrans stores %s", stores)
    return handles
