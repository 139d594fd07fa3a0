"""The store's bulk data lane: ``DoGet``'s answer as one length-prefixed Arrow IPC stream (docs/reference/wire.md)."""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from knittrans.errors import (
    InvalidRequest,
    InvalidTicket,
    KnitTransError,
    Unavailable,
)
from knittrans.flight.auth import BearerTokenFactory
from knittrans.flight.errors import error_message, from_error_message, refusal
from knittrans.flight.recv_pool import ReceivePool, default_pool
from knittrans.tickets import MAX_TICKET_BYTES

__all__ = [
    "MAGIC",
    "MAX_AUTH_BYTES",
    "LaneClosed",
    "LaneServer",
    "NotALane",
    "connect",
    "ipc_parts",
    "ping",
    "read_answer",
    "send_request",
]

logger = logging.getLogger(__name__)

MAGIC = b"KTL1"
"""First four bytes of every lane request and answer (the lane protocol's name and version)."""
MAX_AUTH_BYTES = 4096
"""Longest ``authorization`` value a lane request may carry."""
MAX_ERROR_BYTES = 1 << 16
"""Longest error message an answer may carry (the client refuses longer ones as malformed)."""
OK, ERROR = 0, 1
_REQUEST = struct.Struct("!4sII")
_ANSWER = struct.Struct("!4sBQ")
_IOV = 512  # buffers per sendmsg (Linux allows 1024)
_ACCEPTS_PER_ROUND = 32


class NotALane(Exception):
    """No lane answer: the peer answered something else (e.g. another service on that port), or nothing within
    the socket's timeout."""


class LaneClosed(NotALane):
    """The peer closed the connection before the first byte of an answer (a stale pooled connection)."""


def _socket_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send and receive timeouts of a blocking socket: a call waiting that long without progress fails."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def _sendmsg_all(sock: socket.socket, parts: list[Any]) -> None:
    """Send every buffer of ``parts`` in order with as few ``sendmsg`` calls as the socket allows."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV])
        if sent == 0:
            raise ConnectionError("peer stopped taking data")
        while sent:
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


class _Collect(io.RawIOBase):
    """A write-only file for the IPC writer: keeps each buffer it is handed (body buffers arrive as
    zero-copy :class:`pa.Buffer` views of the mapped unit files), so the total length is known before
    a byte is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[Any] = []
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.parts.append(data)
        self.nbytes += n
        return n


def ipc_parts(table: pa.Table) -> tuple[list[Any], int]:
    """The Arrow IPC stream of ``table``'s record batches as a list of buffers (bodies not copied) and its length."""
    sink = _Collect()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    return sink.parts, sink.nbytes


@dataclass
class _Waiting:
    """A connection in the gate: what of its first request's header and authorization is in."""

    peer: Any
    deadline: float
    got: bytearray = field(default_factory=bytearray)
    need: int = _REQUEST.size  # bytes expected in all: the header's size, then header + authorization


class LaneServer:
    """The data lane of one store server: a listening socket, the gate (one selector thread that admits
    connections once their first request's header and token check out) and one thread per admitted
    connection (docs/reference/wire.md).

    ``read(ticket_bytes) -> pa.Table`` answers a request (the store server's ``read_ticket``); ``auth``
    (its bearer-token check, or None for a store without a token) checks each request's ``authorization``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        read: Callable[[bytes], pa.Table],
        auth: BearerTokenFactory | None,
        auth_timeout_s: float = 5.0,
        request_timeout_s: float = 10.0,
        idle_timeout_s: float = 60.0,
        send_timeout_s: float = 30.0,
        max_connections: int = 128,
        max_unauthenticated: int = 256,
    ) -> None:
        if not auth_timeout_s > 0 or max_unauthenticated < 1:
            raise ValueError("auth_timeout_s must be > 0 and max_unauthenticated >= 1")
        self._read, self._auth = read, auth
        self.auth_timeout_s, self.max_unauthenticated = auth_timeout_s, max_unauthenticated
        self.request_timeout_s, self.idle_timeout_s = request_timeout_s, idle_timeout_s
        self.send_timeout_s, self.max_connections = send_timeout_s, max_connections
        self.served = 0
        """Answers with status OK begun (tests and benchmarks check that the lane, not DoGet, served)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family, backlog=1024)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._waiting: dict[socket.socket, _Waiting] = {}  # the gate's; insertion order: oldest first
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._gate = threading.Thread(target=self._run_gate, name="knittrans-lane-gate", daemon=True)
        self._gate.start()

    @property
    def open_connections(self) -> int:
        """Admitted connections being served now (requests in progress and idle ones kept open)."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop accepting, close the connections waiting in the gate and drop every open connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._gate.join(5)
        self._wake_w.close()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # --- the gate: connections that have not shown a token yet, on one selector thread --------
    def _run_gate(self) -> None:
        try:
            while not self._closed:
                oldest = next(iter(self._waiting.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        assert isinstance(key.fileobj, socket.socket)
                        self._read_waiting(key.fileobj)
                self._expire()
        except Exception:  # never expected: log it, the lane then accepts nothing more
            logger.exception("data lane gate stopped")
        finally:
            for conn in list(self._waiting):
                self._drop(conn)
            self._selector.close()
            self._wake_r.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):  # then the waiting connections' bytes are read, before more accepts
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: free one, or let the backlog wait a moment
                logger.warning("data lane cannot accept a connection now: %s", exc)
                if self._waiting:
                    self._drop(next(iter(self._waiting)))
                else:
                    time.sleep(0.05)
                return
            if len(self._waiting) >= self.max_unauthenticated:  # the one that has waited longest goes
                msg = (
                    f"the data lane has {self.max_unauthenticated} connections waiting for a token; use DoGet or retry"
                )
                self._refuse(next(iter(self._waiting)), Unavailable(msg))
            conn.setblocking(False)
            self._waiting[conn] = _Waiting(peer, time.monotonic() + self.auth_timeout_s)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read_waiting(self, conn: socket.socket) -> None:
        waiting = self._waiting.get(conn)
        if waiting is None:
            return
        try:
            data = conn.recv(waiting.need - len(waiting.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(conn)
            return
        waiting.got += data
        if len(waiting.got) < waiting.need:
            return
        try:
            if waiting.need == _REQUEST.size:
                waiting.need += _auth_length(bytes(waiting.got))
                if len(waiting.got) < waiting.need:
                    return
            self._release(conn)
            conn.setblocking(True)
            self._admit(conn, waiting.peer, bytes(waiting.got[: _REQUEST.size]), bytes(waiting.got[_REQUEST.size :]))
        except KnitTransError as exc:
            logger.info("data lane connection from %s refused: %s: %s", waiting.peer, type(exc).__name__, exc)
            self._refuse(conn, exc)
        except Exception:
            logger.exception("data lane connection from %s dropped", waiting.peer)
            self._drop(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting:
            conn, waiting = next(iter(self._waiting.items()))
            if waiting.deadline > now:
                return
            logger.debug(
                "data lane connection from %s closed: no credentials within %.0f s", waiting.peer, self.auth_timeout_s
            )
            if waiting.got:  # a request begun and not finished in time: say so
                what = "header" if len(waiting.got) < _REQUEST.size else "authorization"
                self._refuse(conn, InvalidRequest(f"data lane request: {what} did not arrive within the time limit"))
            else:
                self._drop(conn)

    def _release(self, conn: socket.socket) -> None:
        """Stop watching ``conn`` (admitted or about to be closed)."""
        if self._waiting.pop(conn, None) is not None:
            self._selector.unregister(conn)

    def _refuse(self, conn: socket.socket, exc: KnitTransError) -> None:
        """Answer ``exc``'s error frame (a small frame on a connection that was sent nothing: the socket's
        buffer takes it without waiting) and close."""
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(_error_frame(exc))
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._release(conn)
        conn.close()

    # --- admitted connections ------------------------------------------------------------------
    def _check(self, authorization: bytes) -> None:
        if self._auth is not None:
            self._auth.check([authorization] if authorization else [])

    def _admit(self, conn: socket.socket, peer: Any, header: bytes, authorization: bytes) -> None:
        """The first request's header and authorization are in and well formed: check the token (refused: the
        gate answers and closes), then serve the connection on a thread of its own."""
        self._check(authorization)
        with self._lock:
            if self._closed:
                raise Unavailable("the data lane is closing; use DoGet")
            if len(self._conns) >= self.max_connections:
                raise Unavailable(
                    f"the data lane serves at most {self.max_connections} connections; use DoGet or retry"
                )
            self._conns.add(conn)
        deadline = time.monotonic() + self.request_timeout_s
        threading.Thread(
            target=self._serve, args=(conn, peer, header, deadline), name="knittrans-lane", daemon=True
        ).start()

    def _serve(self, conn: socket.socket, peer: Any, header: bytes, deadline: float) -> None:
        """Answer the connection's requests one after another, from the first (its ``header`` and token taken in
        by the gate) until the client closes the connection or stays idle too long."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _socket_timeouts(conn, self.send_timeout_s)  # bounds the blocking sends of the answers
            while header:
                _, _, ticket_len = _REQUEST.unpack(header)
                self._answer(conn, self._recv_exact(conn, ticket_len, deadline, "ticket"))
                header, deadline = self._next_header(conn)
        except KnitTransError as exc:  # a request the lane cannot read further: answered, then closed
            logger.info("data lane request from %s refused, closing: %s", peer, exc)
            try:
                conn.settimeout(None)
                conn.sendall(_error_frame(exc))
            except OSError:
                pass
        except OSError as exc:  # the client went away or stopped reading
            logger.debug("data lane connection from %s dropped: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _recv_exact(self, conn: socket.socket, n: int, deadline: float, what: str) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InvalidRequest(f"data lane request: {what} did not arrive within the time limit")
            conn.settimeout(left)
            try:
                k = conn.recv_into(view[got:])
            except TimeoutError:
                continue
            if k == 0:
                raise InvalidRequest(f"data lane request: connection closed within the {what}")
            got += k
        return bytes(buf)

    def _next_header(self, conn: socket.socket) -> tuple[bytes, float]:
        """The header of the connection's next request, its token checked before its ticket is read (a refused
        one closes the connection), and the deadline of the rest; ``b""`` when the client closed the connection
        or stayed idle for ``idle_timeout_s``."""
        conn.settimeout(self.idle_timeout_s)
        try:
            first = conn.recv(1)
        except TimeoutError:
            first = b""
        if not first:
            return b"", 0.0
        deadline = time.monotonic() + self.request_timeout_s
        head = first + self._recv_exact(conn, _REQUEST.size - 1, deadline, "header")
        self._check(self._recv_exact(conn, _auth_length(head), deadline, "authorization"))
        return head, deadline

    def _answer(self, conn: socket.socket, ticket: bytes) -> None:
        """Answer one authenticated request: the read of ``ticket`` (empty: a ping), or its error."""
        conn.settimeout(None)
        try:
            if not ticket:  # a ping: the connection is checked, nothing read
                conn.sendall(_ANSWER.pack(MAGIC, OK, 0))
                return
            parts, nbytes = ipc_parts(self._read(ticket))
        except Exception as exc:
            known = refusal("data lane read", exc) or KnitTransError(f"internal error in the data lane: {exc!r}")
            conn.sendall(_error_frame(known))
            return
        with self._lock:
            self.served += 1
        _sendmsg_all(conn, [_ANSWER.pack(MAGIC, OK, nbytes), *parts])


def _auth_length(header: bytes) -> int:
    """The authorization length a request header declares, its magic and lengths checked (before any of
    the rest is read)."""
    magic, auth_len, ticket_len = _REQUEST.unpack(header)
    if magic != MAGIC:
        raise InvalidRequest(f"data lane request starts with {magic!r}, not {MAGIC!r}")
    if auth_len > MAX_AUTH_BYTES:
        raise InvalidRequest(f"data lane request: authorization of {auth_len} bytes, more than {MAX_AUTH_BYTES}")
    if ticket_len > MAX_TICKET_BYTES:
        raise InvalidTicket(f"ticket is {ticket_len} bytes, more than the {MAX_TICKET_BYTES} allowed")
    return int(auth_len)


def _error_frame(exc: KnitTransError) -> bytes:
    """An answer with status ERROR naming ``exc`` (as over Flight)."""
    body = error_message(exc).encode()[:MAX_ERROR_BYTES]
    return _ANSWER.pack(MAGIC, ERROR, len(body)) + body


# ------------------------------------------------------------------------------------------------ client
def connect(host: str, port: int, *, connect_timeout_s: float, timeout_s: float | None) -> socket.socket:
    """A new connection to a store's lane: blocking, Nagle off, each send and receive bounded by ``timeout_s``
    (the kernel's per-call timeouts; None: unbounded). Raises ``OSError``, also when nothing listens on the
    port and the kernel joined the connection to itself."""
    conn = socket.create_connection((host, port), timeout=connect_timeout_s)
    if conn.getsockname() == conn.getpeername():
        conn.close()
        raise ConnectionRefusedError(f"nothing listens on port {port}")
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if timeout_s is not None:
        _socket_timeouts(conn, timeout_s)
    return conn


def send_request(sock: socket.socket, authorization: bytes, ticket: bytes) -> None:
    """Send one lane request (``authorization``: the header value, ``Bearer <token>``, or empty)."""
    sock.sendall(_REQUEST.pack(MAGIC, len(authorization), len(ticket)) + authorization + ticket)


def ping(sock: socket.socket, authorization: bytes) -> None:
    """Check that a (new) connection reaches a data lane: an empty-ticket request and its answer.

    Raises as :func:`read_answer` for an answer that is none, and the error the lane answered
    (e.g. ``Unauthenticated``).
    """
    send_request(sock, authorization, b"")
    length = _answer_length(sock)
    if length != 0:
        raise NotALane(f"data lane answered the ping with a {length}-byte body, not a lane answer")


def _answer_length(sock: socket.socket) -> int:
    """The body length of an OK answer, once its header is in; raises as :func:`read_answer`."""
    head = bytearray(_ANSWER.size)
    view = memoryview(head)
    try:
        first = sock.recv_into(view, 0, socket.MSG_WAITALL)
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise LaneClosed(str(exc)) from None
    except BlockingIOError:
        raise NotALane("data lane: no answer within the timeout") from None
    if first == 0:
        raise LaneClosed("connection closed before the answer")
    _recv_into(sock, view[first:], "answer header")
    magic, status, length = _ANSWER.unpack(head)
    if magic != MAGIC or status not in (OK, ERROR):
        raise NotALane(f"data lane answered {bytes(head[:5])!r}, not a lane answer")
    if status == ERROR:
        if length > MAX_ERROR_BYTES:
            raise Unavailable(f"data lane error message of {length} bytes, more than {MAX_ERROR_BYTES}")
        body = bytearray(length)
        _recv_into(sock, memoryview(body), "error message")
        text = body.decode(errors="replace")
        raise from_error_message(text) or KnitTransError(f"data lane: {text}")
    return int(length)


def _recv_into(sock: socket.socket, view: memoryview, what: str) -> None:
    got = 0
    while got < view.nbytes:
        try:
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO passed without a byte
            raise Unavailable(f"data lane: no data for the {what} within the timeout") from None
        if n == 0:
            raise Unavailable(f"data lane: connection closed after {got} of {view.nbytes} bytes of the {what}")
        got += n


def read_answer(sock: socket.socket, pool: ReceivePool | None = None) -> pa.Table:
    """Read one answer: the table (its buffers point into one block of ``pool``, default the process's shared
    :func:`~knittrans.flight.recv_pool.default_pool`), or raise its error.

    Raises :class:`LaneClosed` when the connection closed before the answer began, :class:`NotALane` when no
    byte of it came within the socket's timeout or the peer answered something else than a lane answer, the
    error the store named (a :mod:`knittrans.errors` type), or ``Unavailable`` for a broken answer (one whose
    body is no Arrow IPC stream included: the client then reads through ``DoGet``).
    """
    target, buf = (pool or default_pool()).buffer(_answer_length(sock))
    try:
        _recv_into(sock, target, "record batches")
    finally:
        target.release()
        del target
    try:
        return pa.ipc.open_stream(buf).read_all()
    except pa.ArrowException as exc:
        raise Unavailable(f"data lane: the answer is no Arrow IPC stream: {exc}") from None
