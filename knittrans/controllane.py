"""Client side of the control plane's registration lane (:mod:`knittrans.api.lane`).

:class:`~knittrans.controlclient.ControlClient` sends ``register_units`` here first. One kept
connection per client, found with ``GET /v1/lane``; a call that finds it busy in another thread, a
control plane without a lane (404), one whose lane port cannot be reached (a firewall, a container
that publishes only its HTTP port), a body over the lane's limit, or a connection that breaks
before its answer, is answered ``None``: the caller registers over HTTP, with its retries, and a
registration repeated that way after a lost answer is a no-op. An unreachable lane is tried again
after 60 s, then less and less often (up to every 16 min); a control plane restarted on a new lane
port is found again at the next connect. Errors the control plane answered (an unknown job, a
refused token, a bad body) are raised as :mod:`knittrans.errors` types, as over HTTP.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from knittrans.errors import KnitTransError, Unavailable
from knittrans.flight import lane

__all__ = ["REGISTER", "LaneRegistrar"]

logger = logging.getLogger(__name__)

REGISTER = "register_units"
"""The one action type the control plane's lane serves (:mod:`knittrans.api.lane`)."""
CONNECT_TIMEOUT_S = 2.0
"""Longest wait for a connection to the lane before the registration goes over HTTP."""
RETRY_S, RETRY_MAX_S = 60.0, 960.0
"""Pause before trying an unreachable lane again, doubled after each failed try up to the second value."""

Finder = Callable[[], tuple[int, int] | None]
"""``GET /v1/lane``: ``(port, max_bytes)``, None when the control plane has no lane; raises ``OSError``
(or any ``Exception``) when it cannot be asked now."""


class LaneRegistrar:
    """Registrations over the lane of the control plane at ``base_url`` (plain ``http://`` only)."""

    def __init__(self, base_url: str, authorization: bytes, *, timeout_s: float, find: Finder) -> None:
        split = urlsplit(base_url)
        self._host = split.hostname if split.scheme == "http" else None
        self._auth, self._timeout_s, self._find = authorization, timeout_s, find
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._port: int | None = None
        self._max_bytes = 0
        self._retry_at, self._pause = 0.0, RETRY_S
        self._closed = False
        self.served = 0
        """Registrations this client sent over the lane and got an answer to."""

    def register(self, job: str, data: bytes) -> dict[str, Any] | None:
        """The control plane's answer to registering ``data`` (``UnitsIn`` as JSON) for ``job`` over the lane,
        or None: not sent, or sent without an answer (register over HTTP)."""
        if self._host is None or self._closed or time.monotonic() < self._retry_at:
            return None
        if not self._lock.acquire(blocking=False):  # another thread's registration holds the connection
            return None
        try:
            return self._register(job, data)
        finally:
            if self._closed:
                self._drop()
            self._lock.release()

    def close(self) -> None:
        """Close the connection (a registration in flight in another thread closes it when it returns)."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()

    def _register(self, job: str, data: bytes) -> dict[str, Any] | None:
        if self._port is None and not self._discover():
            return None
        payload = job.encode() + b"\0" + data
        if len(REGISTER) + 1 + len(payload) > self._max_bytes:
            return None
        for _ in range(2):  # a kept connection the lane closed as idle: once more on a fresh one
            fresh = self._sock is None
            if fresh and not self._connect():
                return None
            assert self._sock is not None
            try:
                lane.send_action(self._sock, self._auth, REGISTER, payload)
                answer = lane.read_action_answer(self._sock)
            except Unavailable as exc:  # the lane cannot serve it now (connection cap, stopping): over HTTP
                logger.debug("control plane lane: %s; registering over HTTP", exc)
                self._drop()
                return None
            except KnitTransError:
                raise  # the registration's own error, as the route answers it; the connection stays usable
            except (lane.LaneClosed, BrokenPipeError, ConnectionResetError) as exc:
                self._drop()
                if fresh:
                    self._down(f"it closed a new connection: {exc}")
                    return None
                continue
            except (lane.NoLaneActions, lane.NotALane, lane.LaneSilent, OSError) as exc:
                self._drop()
                self._down(str(exc) or type(exc).__name__)
                return None
            self.served += 1
            self._pause = RETRY_S
            result: dict[str, Any] = json.loads(answer)
            return result
        return None

    def _discover(self) -> bool:
        """Ask the control plane for its lane; False (and not again for a while) when it has none."""
        try:
            found = self._find()
        except Exception as exc:  # the HTTP path finds out what is wrong, with its retries
            logger.debug("control plane lane: GET /v1/lane failed: %s", exc)
            self._retry_at = time.monotonic() + 1.0
            return False
        if found is None:
            self._down("the control plane has none")
            return False
        self._port, self._max_bytes = found
        return True

    def _connect(self) -> bool:
        """A fresh connection to the lane, found again once when its port refuses (a restarted control plane)."""
        for attempt in range(2):
            assert self._host is not None and self._port is not None
            try:
                self._sock = lane.connect(
                    self._host, self._port, connect_timeout_s=CONNECT_TIMEOUT_S, timeout_s=self._timeout_s
                )
            except OSError as exc:
                if attempt == 0 and self._discover():
                    continue
                self._down(f"port {self._port} cannot be reached: {exc}")
                return False
            return True
        return False  # pragma: no cover - the loop returns

    def _down(self, reason: str) -> None:
        """Register over HTTP for a while (logged once per pause)."""
        self._port = None  # asked for again when the pause is over
        self._retry_at = time.monotonic() + self._pause
        logger.info(
            "control plane lane of %s: %s; registering over HTTP, trying the lane again in %.0f s",
            self._host,
            reason,
            self._pause,
        )
        self._pause = min(self._pause * 2, RETRY_MAX_S)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
