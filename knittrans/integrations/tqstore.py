"""The KnitTrans TransferQueue backend's storage logic, without TransferQueue's classes (usable and tested alone)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from knittrans.errors import InvalidRequest, KnitTransError, NotFound, Unavailable
from knittrans.flight.client import StoreClient
from knittrans.names import check_name
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.store.unit import LocalReader
from knittrans.tickets import Ticket, UnitRead, node_reads

__all__ = ["NODE_ENV", "Loc", "StoreNodeLost", "TQBackendConfig", "TQStoreCore"]

logger = logging.getLogger(__name__)

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
    spill_dirs: Mapping[str, str] = field(default_factory=dict)
    """Store node name -> its spill directory (filled by the bootstrap when ``spill_dir`` is set)."""
    store_root: str = "/dev/shm/knittrans-tq"
    """Root under which the bootstrap's stores keep ``<run>/<node>/`` directories."""
    budget_bytes: int | None = None
    """Bytes each bootstrap store keeps in ``store_root`` before it spills (or makes puts wait); None: no limit."""
    spill_dir: str | None = None
    """Disk directory the bootstrap's stores spill whole units to once over budget; None: puts wait."""
    media_fields: tuple[str, ...] = ()
    """Fields stored once per content hash: a tensor field, or ``<field>.<key>`` for a key of dict rows."""
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
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise InvalidRequest(f"backend.KnitTrans.budget_bytes must be positive or null, not {self.budget_bytes}")

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
    from omegaconf import DictConfig, OmegaConf  # ships with TransferQueue, whose configuration this is

    if isinstance(conf, DictConfig):
        out = OmegaConf.to_container(conf, resolve=True)
        return dict(out) if isinstance(out, dict) else {}
    return dict(conf)


Loc = tuple[str, str, int, int, str]
"""Where one (row, field) lives: ``(node, unit, row in unit, rows in unit, layout)``; the layout
(``"3fa2c1d0|#shape"``: a digest of the column types, then the column suffixes past ``tq.<field>``)
groups units that one DoGet can read together. Carried as
TransferQueue ``custom_backend_meta`` (a list after a msgpack hop): five scalars, so the controller's
per-request copies and the BatchMeta it ships stay small."""


def _is_loc(meta: Any) -> bool:
    return type(meta) in (tuple, list) and len(meta) == 5


def _loc(meta: Any, field_name: str, gidx: int) -> Loc:
    if not _is_loc(meta):
        raise NotFound(
            f"field {field_name!r} of global index {gidx} has no KnitTrans location; was it put through the "
            "KnitTrans backend?"
        )
    node, unit, row, n, suffixes = meta
    return node, unit, row, n, suffixes


class TQStoreCore:
    """Puts, gets and clears of TransferQueue fields on KnitTrans store nodes."""

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
        """Flight endpoint of ``node`` (StoreNodeLost when the configuration has none)."""
        try:
            return self.config.stores[node]
        except KeyError:
            raise StoreNodeLost(
                f"store node {node!r} is not in backend.KnitTrans.stores {sorted(self.config.stores)}"
            ) from None

    def client(self, node: str) -> StoreClient:
        """The (cached) Flight client of ``node``."""
        if node not in self._clients:
            self._clients[node] = StoreClient(
                self.endpoint(node), token=self.config.token, timeout_s=self.config.timeout_s
            )
        return self._clients[node]

    def local_dir(self, node: str) -> Path | None:
        """The store directory of ``node`` when it is on this host, else None."""
        store_dir = self.config.store_dirs.get(node)
        return Path(store_dir) if store_dir and Path(store_dir).is_dir() else None

    def writer(self, node: str) -> TrajectoryWriter:
        """The (cached) writer of units to ``node``: files in its directory when on this host, else DoPut."""
        if node not in self._writers:
            self._writers[node] = TrajectoryWriter(
                job=self.config.job,
                node_id=node,
                endpoint=self.endpoint(node),
                store_dir=self.local_dir(node),
                token=self.config.token,
                timeout_s=self.config.timeout_s,
            )
        return self._writers[node]

    # ------------------------------------------------------------------ put
    def put(
        self, data: Mapping[str, Any], n: int, global_indexes: Sequence[int], partition: str
    ) -> list[dict[str, Loc]]:
        """Write one put as one unit on this node; per row, ``{field: location}`` (TQ's backend meta)."""
        from knittrans.integrations.tqcodec import encode_put

        node = self.local_node()
        tables, layouts = encode_put(
            data, n, global_indexes=global_indexes, partition=partition, media_fields=self.config.media_fields
        )
        writer = self.writer(node)
        unit_id = writer.new_unit_id()
        try:
            writer.write_tables(unit_id, tables)
        except Unavailable as exc:
            raise StoreNodeLost(f"store node {node!r} ({self.endpoint(node)}) cannot take the put: {exc}") from None
        return [{f: (node, unit_id, i, n, layouts[f]) for f in data} for i in range(n)]

    # ------------------------------------------------------------------ get
    def get(
        self,
        field_names: Sequence[str],
        global_indexes: Sequence[int],
        backend_meta: Sequence[Mapping[str, Any]],
        *,
        packed: bool = True,
    ) -> dict[str, Any]:
        """``{field: rows}`` in ``global_indexes`` order: packed as SimpleStorage packs them, or with
        ``packed=False`` one value per row (tensors, or what was put)."""
        from knittrans.integrations.tqrows import assemble, scatter

        # (node, unit) -> {field: [(position, row)]}
        where: dict[tuple[str, str], dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
        layout: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
        for pos, (gidx, meta) in enumerate(zip(global_indexes, backend_meta, strict=True)):
            for f in field_names:
                node, unit, row, _, suffixes = _loc(meta.get(f), f, gidx)
                where[(node, unit)][f].append((pos, row))
                layout[(node, unit)][f] = suffixes
        # one DoGet per node and column layout: units whose requested fields have the same columns
        groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[str]] = defaultdict(list)
        for key in where:
            groups[(key[0], tuple(sorted(layout[key].items())))].append(key[1])
        jobs = [(node, fields, units) for (node, fields), units in groups.items()]
        if len(jobs) == 1:  # the common case (one node, one layout): no hop to the pool
            results = [self._fetch(*jobs[0], where)]
        else:
            results = list(self._pool.map(lambda j: self._fetch(j[0], j[1], j[2], where), jobs))
        parts: dict[str, list[tuple[list[int], Any]]] = defaultdict(list)  # per field, each DoGet's rows
        for per_field in results:
            for f, part in per_field.items():
                parts[f].append(part)
        combine = assemble if packed else scatter
        return {f: combine(parts[f], len(global_indexes)) for f in field_names}

    def all_local(self, backend_meta: Sequence[Mapping[str, Any]]) -> bool:
        """Whether every row of ``backend_meta`` lives on a node whose units this host memory-maps (no
        network wait: :meth:`get` is then a short CPU-bound call)."""
        nodes = {loc[0] for meta in backend_meta for loc in meta.values() if _is_loc(loc)}
        return all(self._local_reader(str(node)) is not None for node in nodes)

    def local_dirs(self, node: str) -> list[Path]:
        """The directories that may hold ``node``'s units (its store directory, then its spill directory)
        when they are on this host; empty otherwise."""
        local = self.local_dir(node)
        spill = self.config.spill_dirs.get(node)
        return [local, *([Path(spill)] if spill and Path(spill).is_dir() else [])] if local is not None else []

    def _local_reader(self, node: str) -> LocalReader | None:
        """The (cached) reader of ``node``'s memory-mapped units when its directories are on this host."""
        if node not in self._local:
            roots = self.local_dirs(node)
            self._local[node] = LocalReader([str(r) for r in roots]) if roots else None
        return self._local[node]

    def _fetch(
        self,
        node: str,
        layout: tuple[tuple[str, str], ...],
        units: list[str],
        where: Mapping[tuple[str, str], Mapping[str, list[tuple[int, int]]]],
    ) -> dict[str, tuple[list[int], Any]]:
        from knittrans.integrations.tqcodec import NO_MEDIA, column_name, field_meta, layout_columns
        from knittrans.integrations.tqrows import decode_field, decode_media

        fields = tuple(f for f, _ in layout)
        # each unit's requested rows once, in order: the rows of the DoGet's answer, read as merged ranges
        order = [(u, r) for u in units for r in sorted({r for f in fields for _, r in where[(node, u)][f]})]
        reads = node_reads((node, u, r) for u, r in order)[node]
        # memory-mapped units when the node's directory is on this host (as TrainerClient's ``mmap`` mode), else DoGet
        local = self._local_reader(node)
        read = local.read if local is not None else self.client(node).get
        columns = tuple(c for f, suffixes in layout for c in layout_columns(f, suffixes))
        try:
            table = read(Ticket(job=self.config.job, reads=reads, columns=columns))
            hashes: set[bytes] = set()
            for c in columns:
                if field_meta(table.schema.field(c))["kind"] in ("media", "media_key"):
                    hashes.update(table.column(c).to_pylist())
            hashes.discard(NO_MEDIA)
            media = None
            if hashes:
                ticket = Ticket(
                    job=self.config.job,
                    kind="media",
                    reads=tuple(UnitRead(unit_id=u) for u in units),
                    media_hashes=tuple(sorted(h.hex() for h in hashes)),
                )
                media = decode_media(read(ticket))
        except Unavailable as exc:
            gidx = sorted({p for u in units for f in fields for p, _ in where[(node, u)][f]})
            raise StoreNodeLost(
                f"KnitTrans store node {node!r} ({self.endpoint(node)}) is unreachable; it holds fields "
                f"{list(fields)} of {len(gidx)} requested rows (batch positions {gidx[:8]}"
                f"{'...' if len(gidx) > 8 else ''}): {exc}"
            ) from None
        index = {row: i for i, row in enumerate(order)}  # position in the DoGet's answer of every (unit, row)
        out: dict[str, tuple[list[int], Any]] = {}
        for f in fields:
            pairs = sorted((pos, index[(u, r)]) for u in units for pos, r in where[(node, u)][f])
            idx = np.fromiter((i for _, i in pairs), dtype=np.int64, count=len(pairs))
            out[f] = ([p for p, _ in pairs], decode_field(table, column_name(f), idx, media))
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
                    with contextlib.suppress(NotFound):  # already gone
                        self.client(key[0]).delete(self.config.job, key[1])
                    deleted.append(key)
                except KnitTransError as exc:
                    logger.warning("could not delete unit %s on %s: %s", key[1], key[0], exc)
        return deleted

    def close(self) -> None:
        """Close the pool, the writers and the clients."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        # copies: a pool thread still running may add a client while these loops run
        for w in list(self._writers.values()):
            w.close()
        for c in list(self._clients.values()):
            c.close()
