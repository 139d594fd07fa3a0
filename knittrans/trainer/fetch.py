"""Store-node reads of a trainer rank: one Flight client per endpoint (or an mmap reader per local node)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa

from knittrans.errors import KnitTransError, NotFound, Unavailable
from knittrans.flight.client import StoreClient
from knittrans.store.unit import LocalReader
from knittrans.tickets import Ticket

__all__ = ["Fetcher"]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
LocalDirs = Mapping[str, PathLike | Sequence[PathLike]]


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
        """The fetcher's worker threads (share streams being opened, and warm-up pings, run here)."""

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
            client.lane_warm()  # with data_lane: the data_lane action and a lane connection, out of the first read
        except KnitTransError as exc:
            self._warm.discard(endpoint)
            logger.debug("store %s not warmed: %s", endpoint, exc)

    def stream(self, node_id: str, endpoint: str, ticket: Ticket) -> Iterator[pa.RecordBatch]:
        """What ``ticket`` names, as record batches: a streamed ``DoGet``, or the mmap read of a local node
        (through the node when a unit is not under its mapped directories)."""
        local = self._local.get(node_id)
        if local is not None:
            try:
                return iter(local.read(ticket).to_batches())
            except NotFound as exc:
                logger.debug("node %s: %s; reading through the node", node_id, exc)
        return self._client(endpoint).stream(ticket)

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
