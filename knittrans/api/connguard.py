"""The HTTP listener's connection guard: unauthenticated connections bounded in time, bytes and number."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, ClassVar, cast

__all__ = ["CONNECTION", "PREAUTH_BYTES", "ConnectionGuard", "GuardedConnection"]

logger = logging.getLogger(__name__)

CONNECTION: contextvars.ContextVar[GuardedConnection | None] = contextvars.ContextVar(
    "knittrans_connection", default=None
)
"""The guarded connection whose request the current task serves (None outside a guarded server).

Set while uvicorn parses the connection's bytes, so the request's task inherits it; uvicorn's opt-in
``reset_contextvars`` would hide it, and every connection would then close at its deadline.
"""

_EVICT_AFTER_S = 1.0
"""Youngest unauthenticated connection the cap closes (seconds open)."""
PREAUTH_BYTES = 64 << 10
"""Bytes of a connection handed to the HTTP parser before it authenticated."""


class ConnectionGuard:
    """The unauthenticated connections of one server, oldest first.

    Args:
        timeout_s: close a connection this long after it opened unless a request on it authenticated by then.
        max_unauthenticated: most connections not yet authenticated; beyond it the oldest of them is closed.
    """

    def __init__(self, *, timeout_s: float, max_unauthenticated: int) -> None:
        self.timeout_s = timeout_s
        self.max_unauthenticated = max_unauthenticated
        self._waiting: dict[GuardedConnection, None] = {}  # insertion order: oldest first
        self._trim_timer: asyncio.TimerHandle | None = None

    def protocol(self, http: str = "auto") -> type[GuardedConnection]:
        """The protocol class to pass as ``uvicorn.Config(http=...)``: uvicorn's ``http`` implementation
        (``auto``, ``h11`` or ``httptools``) under this guard."""
        from uvicorn.config import HTTP_PROTOCOLS
        from uvicorn.importer import import_from_string

        inner = import_from_string(HTTP_PROTOCOLS[http])
        attributes = {"guard": self, "inner_class": inner}
        return cast(type[GuardedConnection], type("Guarded" + inner.__name__, (GuardedConnection,), attributes))

    def _opened(self, conn: GuardedConnection) -> None:
        self._waiting[conn] = None
        self._trim()

    def _trim(self) -> None:
        """Close the oldest unauthenticated connections beyond the cap; those open less than a second wait for
        a timer (a burst of new clients is read before any of them is closed)."""
        while len(self._waiting) > self.max_unauthenticated:
            oldest = next(iter(self._waiting))
            age = time.monotonic() - oldest.opened_at
            if age < _EVICT_AFTER_S:
                if self._trim_timer is None:
                    self._trim_timer = asyncio.get_running_loop().call_later(_EVICT_AFTER_S - age, self._timer_trim)
                return
            oldest.close(abort=True)  # out of _waiting at once

    def _timer_trim(self) -> None:
        self._trim_timer = None
        self._trim()

    def _done(self, conn: GuardedConnection) -> None:
        self._waiting.pop(conn, None)


class GuardedConnection(asyncio.Protocol):
    """One connection: uvicorn's protocol for it (``inner``), under its server's :class:`ConnectionGuard`."""

    guard: ClassVar[ConnectionGuard]
    inner_class: ClassVar[type[asyncio.Protocol]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = self.inner_class(*args, **kwargs)
        self.transport: asyncio.Transport | None = None
        self.opened_at = time.monotonic()
        self.authenticated = False
        self.active = 0
        """Requests of this connection in the app now."""
        self._fed = 0
        self._held: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    # --- asyncio.Protocol: uvicorn's, with the guard around it ---------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if isinstance(getattr(type(transport), "max_size", None), int):  # asyncio's socket transport
            transport.max_size = PREAUTH_BYTES  # type: ignore[attr-defined]  # its read size
        self.inner.connection_made(transport)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.guard.timeout_s, self._expire)
        self.guard._opened(self)

    def data_received(self, data: bytes) -> None:
        if not self.authenticated:
            room = max(0, PREAUTH_BYTES - self._fed)
            if len(data) > room:
                self._held.append(data[room:])
                data = data[:room]
                if sum(len(d) for d in self._held) > PREAUTH_BYTES:
                    logger.info("closing a connection that sent too much before authenticating")
                    self.close(abort=True)
                    return
                self._reading(False)
            self._fed += len(data)
            if not data:
                return
        self._feed(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._settle()
        self._held.clear()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- what the app tells the guard ---------------------------------------------------------------
    def authenticate(self) -> None:
        """A request on this connection presented a valid token: lift the guard's limits."""
        if self.authenticated:
            return
        self.authenticated = True
        self._settle()
        if self.transport is not None and "max_size" in vars(self.transport):
            del self.transport.max_size  # type: ignore[attr-defined]  # back to asyncio's read size
        if self._held:
            asyncio.get_running_loop().call_soon(self._release)

    def begin(self) -> None:
        """A request of this connection entered the app."""
        self.active += 1

    def end(self) -> None:
        """A request of this connection left the app; an expired unauthenticated connection closes now."""
        self.active -= 1
        if self._expired and not self.active and not self.authenticated:
            self.close()

    def close(self, *, abort: bool = False) -> None:
        """Close the connection (``abort``: without flushing what is still to be written)."""
        self._settle()
        if self.transport is not None and not self.transport.is_closing():
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    # --- internals ----------------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        token = CONNECTION.set(self)
        try:
            self.inner.data_received(data)
        finally:
            CONNECTION.reset(token)

    def _release(self) -> None:
        held, self._held = b"".join(self._held), []
        if self.transport is None or self.transport.is_closing():
            return
        self._reading(True)
        self._feed(held)

    def _reading(self, on: bool) -> None:
        """Resume (``on``) or pause reading, through uvicorn's FlowControl when it has one (one pause flag
        shared with it), else on the transport."""
        target = getattr(self.inner, "flow", None) or self.transport
        if target is not None:
            (target.resume_reading if on else target.pause_reading)()

    def _settle(self) -> None:
        """Out of the guard's count and timer (authenticated, closed or lost)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard._done(self)

    def _expire(self) -> None:
        self._timer = None
        if self.authenticated:
            return
        if self.active and not self._expired:  # a request to an open path: one more period to finish
            self._expired = True
            self._timer = asyncio.get_running_loop().call_later(self.guard.timeout_s, self._expire)
            return
        self.close(abort=True)
