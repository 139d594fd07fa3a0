"""The data lane's front door: accepts connections and reads each one's first header and credentials on one
thread, before the connection gets a thread or a buffer of its own.

Why (decision 0005): otherwise anyone who can connect pins the listener (idle connections filling the
connection cap, declared bodies allocated before the token is checked). The gate holds connections that
have not shown a token yet in one ``selectors`` loop: per connection a socket and at most
``header_size + max_auth`` bytes (the lane: 12 + 4096). Each one must send its header and its
authorization within ``timeout_s`` of being accepted, else it is closed. At most ``max_pending`` wait
at once; a further connection closes the one that has waited longest (a client that sends its request
at once, as every client of the lane does, gets through a flood of idle connections). Once the
header and the authorization are in, ``admit`` checks them and takes the connection (a thread of its
own, with the rest of the request still unread), or refuses it: its error frame is sent and the
connection closed. A connection pushed out by a newer one is answered ``Unavailable`` (its client then
reads through Flight); one that sent part of a request in time is answered ``InvalidRequest``; one
that sent nothing is closed without a word.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from knittrans.errors import InvalidRequest, KnitTransError, Unavailable

__all__ = ["Gate"]

logger = logging.getLogger(__name__)

_ACCEPTS_PER_ROUND = 32

Parse = Callable[[bytes], int]
"""A connection's first header -> the length of its authorization; raises ``KnitTransError`` when malformed."""
Admit = Callable[[socket.socket, Any, bytes, bytes], None]
"""``(conn, peer, header, authorization)``: check and take the connection (blocking mode, nothing more read);
raises ``KnitTransError`` to refuse it."""
Frame = Callable[[KnitTransError], bytes]
"""The error frame that answers a refused connection."""


@dataclass
class _Waiting:
    peer: Any
    deadline: float
    got: bytearray = field(default_factory=bytearray)
    need: int = 0  # bytes expected in all: the header's size, then header + authorization


class Gate:
    """Accepts on ``listener`` and admits connections that send a well-formed header and authorization in time
    (module docstring). ``close()`` stops it and closes the connections still waiting."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        header_size: int,
        parse: Parse,
        admit: Admit,
        frame: Frame,
        timeout_s: float,
        max_pending: int,
    ) -> None:
        if not timeout_s > 0 or max_pending < 1:
            raise ValueError("timeout_s must be > 0 and max_pending >= 1")
        self._listener, self._header_size = listener, header_size
        self._parse, self._admit, self._frame = parse, admit, frame
        self.timeout_s, self.max_pending = timeout_s, max_pending
        self._waiting: dict[socket.socket, _Waiting] = {}  # insertion order: oldest first
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="knittrans-lane-gate", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; close every connection still waiting (the listener is the caller's)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            while not self._closed:
                oldest = next(iter(self._waiting.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        assert isinstance(key.fileobj, socket.socket)
                        self._read(key.fileobj)
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
            if len(self._waiting) >= self.max_pending:  # the one that has waited longest goes
                msg = f"the data lane has {self.max_pending} connections waiting for a token; use DoGet or retry"
                self._refuse(next(iter(self._waiting)), Unavailable(msg))
            conn.setblocking(False)
            self._waiting[conn] = _Waiting(peer, time.monotonic() + self.timeout_s, need=self._header_size)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
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
            if waiting.need == self._header_size:
                waiting.need += self._parse(bytes(waiting.got))
                if len(waiting.got) < waiting.need:
                    return
            header, auth = bytes(waiting.got[: self._header_size]), bytes(waiting.got[self._header_size :])
            self._release(conn)
            conn.setblocking(True)
            self._admit(conn, waiting.peer, header, auth)
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
                "data lane connection from %s closed: no credentials within %.0f s", waiting.peer, self.timeout_s
            )
            if waiting.got:  # a request begun and not finished in time: say so
                what = "header" if len(waiting.got) < self._header_size else "authorization"
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
            conn.send(self._frame(exc))
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if conn in self._waiting:
            self._release(conn)
        conn.close()
