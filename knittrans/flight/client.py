"""``StoreClient``: a typed client of one store node; reads over its data lane or ``DoGet`` (docs/reference/wire.md)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.flight as flight

from knittrans.errors import KnitTransError, Unavailable
from knittrans.flight import lane
from knittrans.flight.auth import auth_headers
from knittrans.flight.errors import from_flight_error
from knittrans.flight.recv_pool import ReceivePool, default_pool
from knittrans.names import check_name
from knittrans.tickets import Ticket

__all__ = ["LANE_CONNECT_TIMEOUT_S", "LANE_RETRY_MAX_S", "LANE_RETRY_S", "StoreClient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_UNKNOWN = -1  # lane port not asked yet
LANE_CONNECT_TIMEOUT_S = 2.0
"""Longest wait for a connection to a store's data lane before its reads go through ``DoGet``."""
LANE_RETRY_S = 60.0
"""How long a client reads a store through ``DoGet`` after its lane could not be reached (doubled after
each further failure in a row, up to :data:`LANE_RETRY_MAX_S`)."""
LANE_RETRY_MAX_S = 960.0
"""Longest wait before a lane that keeps failing is tried again."""


class _LaneUnreachable(Unavailable):
    """The lane's port did not take a connection, or something else than a lane answered there."""


class StoreClient:
    """Client of one store node; thread-safe for concurrent calls (gRPC channel shared).

    :meth:`close` is safe while other threads are in calls: the channel closes when the last call in
    flight (an open :meth:`stream` counts until it ends) returns; calls begun after ``close`` raise
    ``Unavailable``, and an open stream raises it at its next batch. (Closing a Flight client under a
    call in flight aborted the process: seen with a warm-up ``health`` ping of a fetcher closed meanwhile.)
    """

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        timeout_s: float | None = None,
        batch_bytes: int = 4 << 20,
        tls_ca: str | os.PathLike[str] | None = None,
        data_lane: bool = True,
        recv_pool: ReceivePool | None = None,
    ) -> None:
        """Connect to ``endpoint`` (``grpc://`` or ``grpc+tls://``).

        ``tls_ca``: PEM file of the CA that signed the node's certificate (default
        ``$KNITTRANS_TLS_CA``; without either, the system roots verify a ``grpc+tls`` node).
        ``data_lane``: read :meth:`get` and :meth:`stream` over the store's data lane when it has one
        and it can be reached (docs/reference/wire.md; never for ``grpc+tls``: a TLS store opens no lane);
        ``timeout_s`` then bounds each wait for data. False: always ``DoGet``.
        ``recv_pool``: where lane answers are received (default: the process's shared
        :func:`~knittrans.flight.recv_pool.default_pool`).
        """
        self.endpoint = endpoint
        self.data_lane = data_lane
        self._recv_pool = recv_pool if recv_pool is not None else default_pool()
        self._lane_down_until = 0.0  # monotonic time before which reads skip an unreachable lane
        self._lane_failures = 0  # lane connects failed in a row
        self._lane_refusals = 0  # reads the lane could not serve that went through DoGet instead
        self._timeout_s = timeout_s
        self._authorization = b"" if token is None else auth_headers(token)[0][1]
        self._lane_port = None if endpoint.startswith("grpc+tls://") else _UNKNOWN
        self._lane_host = urlsplit(endpoint).hostname or "127.0.0.1"
        self._lane_idle: list[socket.socket] = []  # connections to the lane between reads
        self.batch_bytes = batch_bytes
        ca = tls_ca if tls_ca is not None else os.environ.get("KNITTRANS_TLS_CA")
        if endpoint.startswith("grpc+tls://") and ca:
            self._client = flight.FlightClient(endpoint, tls_root_certs=Path(ca).read_bytes())
        else:
            self._client = flight.FlightClient(endpoint)
        self._options = flight.FlightCallOptions(headers=auth_headers(token), timeout=timeout_s)
        self._lock = threading.Lock()
        self._active = 0  # calls (and open streams) in flight
        self._closing = False  # close() was called
        self._closed = False  # the Flight client is closed

    def _enter(self) -> None:
        with self._lock:
            if self._closing:
                raise Unavailable(f"store client of {self.endpoint} is closed")
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            last = self._closing and self._active == 0 and not self._closed
            self._closed = self._closed or last
        if last:
            self._client.close()

    def _call(self, fn: Callable[[], T]) -> T:
        self._enter()
        try:
            return self._mapped(fn)
        finally:
            self._leave()

    def _mapped(self, fn: Callable[[], T]) -> T:
        """``fn()`` with Flight's errors raised as the server's :mod:`knittrans.errors` types."""
        try:
            return fn()
        except (flight.FlightError, pa.ArrowException) as exc:  # a KnitTransError is neither: it passes as it is
            raise from_flight_error(exc, self.endpoint) from None

    def get(self, ticket: Ticket) -> pa.Table:
        """The rows × columns (or media rows) the ticket names: over the store's data lane when the client
        has ``data_lane`` and the store a reachable lane, else one ``DoGet``."""
        table = self._lane_or_none(ticket)
        if table is not None:
            return table
        raw = flight.Ticket(ticket.encode())
        return self._call(lambda: self._client.do_get(raw, self._options).read_all())

    def lane_port(self) -> int | None:
        """The store's data-lane port (asked once with the ``data_lane`` action, then cached); None: no lane."""
        if self._lane_port == _UNKNOWN:
            answer = self._action("data_lane")
            port = answer.get("port") if isinstance(answer, dict) else None
            self._lane_port = port if isinstance(port, int) and not isinstance(port, bool) else None
        return self._lane_port

    def lane_reachable(self) -> bool:
        """Whether reads would go over the data lane now (it exists and did not fail to connect lately)."""
        return self.lane_port() is not None and time.monotonic() >= self._lane_down_until

    def _lane_or_none(self, ticket: Ticket) -> pa.Table | None:
        """The lane's answer, or None: the client does not use the lane, the store has none, it cannot be reached
        (then remembered), or it could not serve this request (full, closed meanwhile, a broken answer: this
        request goes through ``DoGet``, the next one tries the lane again)."""
        if not self.data_lane or not self.lane_reachable():
            return None
        for attempt in range(2):
            try:
                table = self.lane_get(ticket)
            except _LaneUnreachable as exc:
                failure = exc
                if attempt or not self._lane_moved():  # a store back with its lane on another port: try it now
                    break
            except Unavailable as exc:
                self._lane_refusals += 1
                log = logger.warning if self._lane_refusals == 1 else logger.debug
                log("%s; this read goes through DoGet", exc)
                return None
            else:
                self._lane_failures = 0
                return table
        self._lane_failures += 1  # reads skip the lane for a while, doubling while it keeps failing
        wait = min(LANE_RETRY_MAX_S, LANE_RETRY_S * 2 ** (self._lane_failures - 1))
        self._lane_down_until = time.monotonic() + wait
        log = logger.warning if self._lane_failures == 1 else logger.debug
        log("%s; reading it through DoGet (lane tried again after %.0f s)", failure, wait)
        return None

    def _lane_moved(self) -> bool:
        """Ask the store for its lane's port again (a restarted store opens its lane on a new port);
        True when it answers another port than the one that just failed."""
        old = self._lane_port
        self._lane_port = _UNKNOWN
        try:
            port = self.lane_port()
        except KnitTransError:  # the store itself is not answering: keep the old port, reads say why
            self._lane_port = old
            return False
        return port is not None and port != old

    def lane_warm(self) -> bool:
        """Open one connection to the store's data lane ahead of the first read, checked with a ping
        and kept for that read (the TCP handshake and the store's connection thread out of the first
        read). False when the store has no lane, it failed lately or cannot be reached (reads then go
        through ``DoGet`` as usual) or the client does not use the lane."""
        if not self.data_lane or not self.lane_reachable():
            return False
        try:
            self._on_lane(lambda conn: lane.ping(conn, self._authorization))
        except KnitTransError as exc:  # no lane answer, or no connection (_LaneUnreachable)
            logger.debug("data lane of store %s not warmed: %s", self.endpoint, exc)
            return False
        return True

    def lane_get(self, ticket: Ticket) -> pa.Table:
        """What a ``DoGet`` of ``ticket`` returns, read over the store's data lane into one buffer (zero-copy
        record batches). No fallback: raises ``Unavailable`` when the store has no lane."""
        raw = ticket.encode()

        def request(conn: socket.socket) -> pa.Table:
            lane.send_request(conn, self._authorization, raw)
            return lane.read_answer(conn, self._recv_pool)

        return self._on_lane(request)

    def _on_lane(self, call: Callable[[socket.socket], T]) -> T:
        """``call(conn)`` on a pooled lane connection (kept again when it succeeds) or a new one."""
        port = self.lane_port()
        if port is None:
            raise Unavailable(f"store {self.endpoint} has no data lane")
        self._enter()
        try:
            for _ in range(2):  # a pooled connection the store closed meanwhile is retried once on a fresh one
                conn, pooled = self._lane_connection(port)
                ok = False
                try:
                    result = call(conn)
                    ok = True
                    return result
                except (lane.LaneClosed, BrokenPipeError, ConnectionResetError) as exc:
                    if not pooled:
                        msg = f"data lane of store {self.endpoint} closed a new connection: {exc}"
                        raise _LaneUnreachable(msg) from None
                    with self._lock:  # the others idled as long or longer: drop them, retry on a fresh one
                        stale, self._lane_idle = self._lane_idle, []
                    for old in stale:
                        old.close()
                except lane.NotALane as exc:  # on a new connection: maybe not the lane at all
                    cls = Unavailable if pooled else _LaneUnreachable
                    raise cls(f"port {port} of store {self.endpoint}: {exc}") from None
                except OSError as exc:
                    raise Unavailable(f"data lane of store {self.endpoint} failed: {exc}") from None
                finally:
                    self._lane_release(conn, ok)
            raise Unavailable(f"data lane of store {self.endpoint} closed a fresh connection")  # pragma: no cover
        finally:
            self._leave()

    def _lane_connection(self, port: int) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._lane_idle:
                return self._lane_idle.pop(), True
        try:
            timeout = min(LANE_CONNECT_TIMEOUT_S, self._timeout_s or LANE_CONNECT_TIMEOUT_S)
            conn = lane.connect(self._lane_host, port, connect_timeout_s=timeout, timeout_s=self._timeout_s)
        except OSError as exc:
            msg = f"data lane of store {self.endpoint} (port {port}) cannot be reached: {exc}"
            raise _LaneUnreachable(msg) from None
        return conn, False

    def _lane_release(self, conn: socket.socket, ok: bool) -> None:
        if ok:
            with self._lock:
                if not self._closing:
                    self._lane_idle.append(conn)
                    return
        conn.close()

    def stream(self, ticket: Ticket) -> Iterator[pa.RecordBatch]:
        """One ``DoGet`` read batch by batch: the call is opened here, the data flows in the background.

        Closing the iterator early (``close()`` or garbage collection) cancels the call. With
        ``data_lane`` (and a store with a reachable lane) the whole answer is read here, over the lane,
        and its batches returned (the fetcher calls this in its worker pool).
        """
        table = self._lane_or_none(ticket)
        if table is not None:
            return iter(table.to_batches())
        raw = flight.Ticket(ticket.encode())
        self._enter()  # the open stream counts as a call in flight until it ends
        try:
            reader = self._call(lambda: self._client.do_get(raw, self._options))
        except BaseException:
            self._leave()
            raise
        batches = self._batches(reader)
        next(batches)  # started: closing it (or garbage collection) now runs its finally, even before a batch
        return batches

    def _batches(self, reader: flight.FlightStreamReader) -> Iterator[pa.RecordBatch]:
        done = False
        try:
            yield None  # taken by stream()
            while True:
                if self._closing:  # the open stream holds the channel; close() ends it at its next batch
                    raise Unavailable(f"store client of {self.endpoint} is closed")
                try:
                    chunk = self._mapped(reader.read_chunk)  # no lock per batch: the stream is counted once
                except StopIteration:
                    done = True
                    return
                yield chunk.data
        finally:
            try:
                if not done:
                    reader.cancel()
            finally:
                self._leave()

    def _action(self, kind: str, body: dict[str, Any] | None = None) -> Any:
        def run() -> Any:
            payload = json.dumps(body or {}).encode()
            results = list(self._client.do_action(flight.Action(kind, payload), self._options))
            return json.loads(results[0].body.to_pybytes()) if results else None

        return self._call(run)

    def put_part(self, job: str, unit_id: str, part: str, table: pa.Table) -> int:
        """Upload one part (``traj`` or ``media``) of a pending unit; returns acknowledged batches (names
        checked first, as in :meth:`unit_info`)."""
        check_name(job, "job")
        check_name(unit_id, "unit_id")
        rows = max(1, table.num_rows * self.batch_bytes // max(1, table.nbytes))
        batches = table.to_batches(max_chunksize=rows)
        descriptor = flight.FlightDescriptor.for_path(job, unit_id, part)

        def run() -> int:
            writer, reader = self._client.do_put(descriptor, table.schema, self._options)
            for batch in batches:
                writer.write_batch(batch)
            writer.done_writing()
            acks = 0
            while reader.read() is not None:
                acks += 1
            writer.close()
            return acks

        acked = self._call(run)
        if acked != len(batches):
            raise KnitTransError(f"store {self.endpoint} acknowledged {acked} of {len(batches)} batches")
        return acked

    def put_unit(
        self, job: str, unit_id: str, traj: pa.Table, media: pa.Table | None = None, *, seal: bool = True
    ) -> dict[str, Any]:
        """Upload a whole unit through ``DoPut`` and (``seal``) seal it; returns the sealed unit's info."""
        self.put_part(job, unit_id, "traj", traj)
        media_rows = media.num_rows if media is not None else 0
        if media is not None and media.num_rows:
            self.put_part(job, unit_id, "media", media)
        if not seal:
            return {}
        return self.seal_units(job, [{"unit": unit_id, "rows": traj.num_rows, "media_rows": media_rows}])[0]

    def seal_units(self, job: str, units: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Publish units uploaded with :meth:`put_part` in one round trip, all or none: each entry is
        ``{"unit"}`` plus the optional ``rows``, ``media_rows`` and ``num_bytes`` the node checks (a
        mismatch drops the unit: ``Conflict``); the sealed units' infos, in order. When one fails, the
        node deletes those of this call it sealed and aborts the rest."""
        return list(self._action("seal_units", {"job": job, "units": [dict(u) for u in units]})["units"])

    def publish_units(
        self, job: str, units: Sequence[Mapping[str, Any]], timeout_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Same-host writers: publish units written into their own temporaries in one round trip, all
        or none. Each entry is ``{"unit", "dir"}`` (``dir``: ``<root>/<job>/.tmp-<unit>-w<hex>``, see
        :func:`knittrans.store.writer_temp_name`) plus the optional counts of :meth:`seal_units`; the
        sealed units' infos, in order (``timeout_s`` bounds the wait for budget). On failure the node
        removes every temporary of the call and the units it sealed."""
        body: dict[str, Any] = {"job": job, "units": [dict(u) for u in units]}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return list(self._action("publish_units", body)["units"])

    def delete(self, job: str, unit_id: str) -> None:
        """Delete a sealed unit or abort a pending one."""
        self._action("delete", {"job": job, "unit": unit_id})

    def stats(self) -> dict[str, Any]:
        """The node's counts and bytes."""
        return dict(self._action("stats"))

    def health(self) -> dict[str, Any]:
        """Liveness: ``{"ok": True, "node_id": ..., "endpoint": ...}``."""
        return dict(self._action("health"))

    def list_units(self, job: str | None = None, *, grant: str | None = None) -> list[dict[str, Any]]:
        """Sealed units (of one job or all): job, unit_id, num_rows, num_bytes.

        ``grant``: on a store with a ticket key, a grant of ``job`` (from a rank plan's tickets);
        such a store lists that job's units only.
        """
        criteria = (job or "") + (f"\n{grant}" if grant else "")
        infos = self._call(lambda: list(self._client.list_flights(criteria.encode(), self._options)))
        return [self._describe(i) for i in infos]

    def unit_info(self, job: str, unit_id: str, *, grant: str | None = None) -> dict[str, Any]:
        """One sealed unit's job, unit_id, num_rows and num_bytes (``grant``: as in :meth:`list_units`).

        Raises:
            InvalidName: ``job`` or ``unit_id`` is not a valid name (checked here: gRPC would refuse a path
                that is not UTF-8 with an untyped error before the store could name the problem).
        """
        check_name(job, "job")
        check_name(unit_id, "unit_id")
        d = flight.FlightDescriptor.for_path(job, unit_id, *([grant] if grant else []))
        return self._describe(self._call(lambda: self._client.get_flight_info(d, self._options)))

    @staticmethod
    def _describe(info: flight.FlightInfo) -> dict[str, Any]:
        job, unit = (p.decode() for p in info.descriptor.path)
        return {"job": job, "unit_id": unit, "num_rows": info.total_records, "num_bytes": info.total_bytes}

    def close(self) -> None:
        """Close the channel: now, or when the last call in flight returns (class docstring)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = self._active == 0
            self._closed = now
            idle, self._lane_idle = self._lane_idle, []
        for conn in idle:
            conn.close()
        if now:
            self._client.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
