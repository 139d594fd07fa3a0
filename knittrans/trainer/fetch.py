"""Fetch trajectory rows for a trainer rank: one ``DoGet`` per node, nodes in parallel, or mmap.

API::

    reads = [FetchRead(node_id="node-0", endpoint="grpc://...", ticket=Ticket(...)), ...]
    with Fetcher(token=None, local_dirs={"node-0": "/dev/shm/knittrans"}) as f:
        f.warm({"node-1": "grpc://..."})           # connect ahead of the first read (optional)
        table = f.fetch(reads)                     # pa.Table, rows in the order of ``reads``
        batches = f.stream("node-0", "grpc://...", ticket)  # one DoGet, batch by batch

Reads of the same node are merged into one ``DoGet`` when they are ``rows`` tickets of one job
with the same columns and explicit row ranges, or ``media`` tickets of one job with distinct
hashes (so each read's row count is known and the result can be split back without copying);
anything else gets a ``DoGet`` of its own on that node's worker. Nodes listed in ``local_dirs``
(value: the store dir, or a tuple of store dir and spill dir) are read through
:class:`~knittrans.store.LocalReader` instead: memory-mapped, no copy, same result as the Flight path.
With ``data_lane`` (the default) remote reads go over a node's data lane where it has a reachable one
(:mod:`knittrans.flight.lane`; a streamed read then arrives whole before its first batch is handed out).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa

from knittrans.errors import InvalidRequest, KnitTransError, Unavailable
from knittrans.flight.client import StoreClient
from knittrans.names import check_name
from knittrans.store.unit import LocalReader
from knittrans.tickets import Ticket, join_tickets

__all__ = ["FetchRead", "Fetcher", "ticket_rows"]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
LocalDirs = Mapping[str, PathLike | Sequence[PathLike]]


@dataclass(frozen=True, kw_only=True)
class FetchRead:
    """One ticket to serve from one store node."""

    node_id: str
    """Store node that owns the ticket's units."""
    endpoint: str
    """Flight location of that node."""
    ticket: Ticket
    """What to read (issued by the control plane)."""

    def __post_init__(self) -> None:
        check_name(self.node_id, "node_id")


def ticket_rows(ticket: Ticket) -> int | None:
    """Rows a ``DoGet`` of ``ticket`` returns when the ticket alone says (explicit ranges, media hashes), else None."""
    if ticket.kind == "media":
        return len(ticket.media_hashes)
    if ticket.kind != "rows":
        return None
    counts = [r.num_rows for r in ticket.reads]
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def _plan(reads: list[tuple[int, FetchRead]]) -> list[tuple[Ticket, list[tuple[int, int | None]]]]:
    """Group a node's reads into DoGet calls: (ticket, [(read index, rows or None)])."""
    calls: list[tuple[Ticket, list[tuple[int, int | None]]]] = []
    for index, read in reads:
        t, n = read.ticket, ticket_rows(read.ticket)
        if calls and n is not None:
            prev, members = calls[-1]
            rows = (
                prev.kind == t.kind == "rows" and prev.columns == t.columns and all(m is not None for _, m in members)
            )
            media = prev.kind == t.kind == "media" and not set(prev.media_hashes) & set(t.media_hashes)
            if prev.job == t.job and (rows or media):
                calls[-1] = (join_tickets([prev, t]), [*members, (index, n)])
                continue
        calls.append((t, [(index, n)]))
    return calls


class Fetcher:
    """Reusable fetcher: keeps one client per endpoint and one LocalReader per local node."""

    def __init__(
        self,
        *,
        token: str | None = None,
        local_dirs: LocalDirs | None = None,
        timeout_s: float | None = None,
        data_lane: bool = True,
    ) -> None:
        """``data_lane``: read remote nodes over their bulk data lane when they have one and it can be
        reached (:class:`~knittrans.flight.StoreClient`'s ``data_lane``), else through ``DoGet``."""
        self.token, self.timeout_s, self.data_lane = token, timeout_s, data_lane
        self._local = {
            node: LocalReader([d] if isinstance(d, str | os.PathLike) else list(d))
            for node, d in (local_dirs or {}).items()
        }
        self._clients: dict[str, StoreClient] = {}
        self._warm: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="knittrans-fetch")
        """The fetcher's worker threads (nodes of one fetch, and share streams being opened, run here)."""

    def _client(self, endpoint: str) -> StoreClient:
        client = self._clients.get(endpoint)
        if client is None:
            with self._lock:  # one channel per endpoint, also when two threads ask at once
                if self._closed:  # e.g. a warm-up ping still queued when the trainer closed
                    raise Unavailable(f"fetcher is closed; no new connection to {endpoint}")
                client = self._clients.get(endpoint)
                if client is None:
                    client = self._clients[endpoint] = StoreClient(
                        endpoint, token=self.token, timeout_s=self.timeout_s, data_lane=self.data_lane
                    )
        return client

    def warm(self, endpoints: Mapping[str, str]) -> list[Future[None]]:
        """Connect to store nodes ahead of their first read (``{node_id: endpoint}``), in the worker pool.

        A Flight channel connects at its first call; a cheap ``health`` action here moves the TCP and
        HTTP/2 set-up out of the first ``DoGet`` of a plan (with ``data_lane``, the ``data_lane`` action
        finds the node's lane port here too, and one lane connection is opened, pinged and kept for the
        first read). The channel is then kept (one per endpoint)
        for every later read. Local nodes and endpoints already connected are skipped; a node that does
        not answer is left alone (its reads report the error where they happen).
        """
        futures = []
        for node_id, endpoint in endpoints.items():
            if node_id in self._local or endpoint in self._warm:
                continue
            self._warm.add(endpoint)
            futures.append(self.pool.submit(self._ping, endpoint))
        return futures

    def _ping(self, endpoint: str) -> None:
        try:
            client = self._client(endpoint)
            client.health()
            if self.data_lane:
                client.lane_warm()  # the data_lane action and a lane connection too, out of the first read
        except KnitTransError as exc:
            self._warm.discard(endpoint)
            logger.debug("store %s not warmed: %s", endpoint, exc)

    def _node(self, node_id: str, reads: list[tuple[int, FetchRead]]) -> list[tuple[int, pa.Table]]:
        local = self._local.get(node_id)
        out: list[tuple[int, pa.Table]] = []
        for ticket, members in _plan(reads):
            table = local.read(ticket) if local is not None else self._client(reads[0][1].endpoint).get(ticket)
            if len(members) == 1:
                out.append((members[0][0], table))
                continue
            offset = 0
            for index, n in members:
                assert n is not None
                out.append((index, table.slice(offset, n)))
                offset += n
            if offset != table.num_rows:
                raise InvalidRequest(f"node {node_id} returned {table.num_rows} rows for {offset} requested")
        return out

    def stream(self, node_id: str, endpoint: str, ticket: Ticket) -> Iterator[pa.RecordBatch]:
        """What ``ticket`` names, as record batches: a streamed ``DoGet``, or the mmap read of a local node."""
        local = self._local.get(node_id)
        if local is not None:
            return iter(local.read(ticket).to_batches())
        return self._client(endpoint).stream(ticket)

    def fetch(self, reads: Sequence[FetchRead]) -> pa.Table:
        """Rows of every read, in the order of ``reads`` (one table; chunks are zero-copy slices)."""
        if not reads:
            raise InvalidRequest("fetch needs at least one read")
        by_node: dict[str, list[tuple[int, FetchRead]]] = {}
        for i, r in enumerate(reads):
            by_node.setdefault(r.node_id, []).append((i, r))
        if len(by_node) == 1:
            parts = [self._node(*next(iter(by_node.items())))]
        else:
            futures = [self.pool.submit(self._node, node, rs) for node, rs in by_node.items()]
            parts = [f.result() for f in futures]
        tables: list[pa.Table | None] = [None] * len(reads)
        for part in parts:
            for index, table in part:
                tables[index] = table
        done = [t for t in tables if t is not None]
        if len(done) == 1:
            return done[0]
        try:
            return pa.concat_tables(done)
        except pa.ArrowInvalid as exc:
            raise InvalidRequest(f"reads return different columns and cannot be concatenated: {exc}") from None

    def close(self) -> None:
        """Close clients and the worker pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # pool threads may still be connecting: no new client after this point
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
