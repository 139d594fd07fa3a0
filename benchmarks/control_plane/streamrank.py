"""A cheap simulated rank on its plan stream: a raw non-blocking socket, arrival stamped by the kernel.

``scale.py`` runs 1,024 ranks in one asyncio process. With asyncio streams, each plan a rank receives
costs a ``readline``/``readexactly``/``json.loads`` round through the event loop before the rank can
take its timestamp, so after an admission the 1,024 ranks' timestamps are taken one after another,
tens of µs apart: the simulator's own queue ends up inside the measured latency. A real rank is a
process of its own on its own host and has no such queue.

This rank asks the kernel instead: the socket has ``SO_TIMESTAMPNS`` on, so each ``recvmsg`` returns,
as ancillary data, the wall-clock time at which the bytes it reads reached the socket (on loopback:
when the server's write went through the TCP stack), whatever the event loop was doing then. Three
times are kept per plan, each as "after admission, or after the rank was ready if that was later"
(ready = it had sent its ack of the previous plan):

* ``kernel``: the kernel's receive time (the arrival at the rank's socket);
* ``user``: ``time.time()`` when the read callback ran, before any parsing;
* ``parsed``: ``time.time()`` after the line was parsed with ``json.loads`` (what the asyncio-streams
  rank measured, minus the streams' own overhead).

The socket is read with ``loop.add_reader`` (no transport, no StreamReader); acks are written as
chunks of the stream's request body with ``socket.send``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SO_TIMESTAMPNS = 35  # <asm-generic/socket.h>, 64-bit Linux; SCM_TIMESTAMPNS has the same number
_TIMESPEC = struct.Struct("qq")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size)


@dataclass
class Arrivals:
    """Delivery times (seconds after admission, or after the rank was ready) of all ranks' plans."""

    kernel: list[float] = field(default_factory=list)
    """From the kernel's receive timestamp of the bytes that completed the plan's line."""
    user: list[float] = field(default_factory=list)
    """From ``time.time()`` when the rank's read callback ran, before parsing."""
    parsed: list[float] = field(default_factory=list)
    """From ``time.time()`` after ``json.loads`` of the plan line."""
    ages: list[float] = field(default_factory=list)
    """Parsed time minus ``admitted_at`` (how old the plan was when the rank had it)."""
    early: int = 0
    """Plans whose kernel timestamp was before the rank was ready (counted as 0 ms)."""
    untimed: int = 0
    """Plans read without a kernel timestamp (none expected on Linux; the callback time stands in)."""


class StreamRank:
    """One rank holding ``POST .../plans`` on a raw socket; acks are lines of the chunked request body."""

    def __init__(
        self,
        rank: int,
        sock: socket.socket,
        think_s: float,
        arrivals: Arrivals,
        on_ack: Callable[[int], None],
        on_error: Callable[[str], None],
    ) -> None:
        self.rank = rank
        self.sock = sock
        self.think_s = think_s
        self.arrivals = arrivals
        self.on_ack = on_ack
        self.on_error = on_error
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.in_head = True
        self.ready = 0.0
        self.pending = b""  # ack bytes the socket did not take yet
        self.closed = asyncio.Event()

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        path: str,
        token: str,
        rank: int,
        think_s: float,
        arrivals: Arrivals,
        on_ack: Callable[[int], None],
        on_error: Callable[[str], None],
    ) -> StreamRank:
        """Connect, send the stream's request head and start reading."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        await loop.sock_connect(sock, (host, port))
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await loop.sock_sendall(sock, head.encode())
        self = cls(rank, sock, think_s, arrivals, on_ack, on_error)
        self.ready = time.time()
        loop.add_reader(sock.fileno(), self._readable)
        return self

    def close(self) -> None:
        """Stop reading and close the socket."""
        if not self.closed.is_set():
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
            self.sock.close()
            self.closed.set()

    def _fail(self, why: str) -> None:
        self.on_error(f"rank {self.rank} stream: {why}")
        self.close()

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(1 << 16, _ANCILLARY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(f"recv: {e}")
            return
        user = time.time()
        kernel: float | None = None
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = _TIMESPEC.unpack_from(raw)
                kernel = sec + nsec * 1e-9
        if not data:
            self.close()  # the server closed the stream (end of the run)
            return
        self.buf += data
        self._frames(kernel, user)

    def _frames(self, kernel: float | None, user: float) -> None:
        """Consume the response head, then every complete chunk in the buffer."""
        buf = self.buf
        if self.in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if not buf.startswith(b"HTTP/1.1 200"):
                status = bytes(buf[: buf.find(b"\r\n")])
                self._fail(f"refused: {status!r}")
                return
            del buf[: end + 4]
            self.in_head = False
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol], 16)
            start = eol + 2
            if len(buf) < start + size + 2:
                break
            if size == 0:
                self.close()
                return
            for line in bytes(buf[start : start + size]).split(b"\n"):
                if line.strip() and not self._line(line, kernel, user):
                    return
            pos = start + size + 2
        del buf[:pos]

    def _line(self, line: bytes, kernel: float | None, user: float) -> bool:
        msg = json.loads(line)
        if "plan_id" not in msg:
            if "ack_error" in msg or "done" in msg:
                self._fail(str(msg))
                return False
            return True  # keep-alive
        parsed = time.time()
        since = max(msg["admitted_at"], self.ready)
        a = self.arrivals
        if kernel is None:
            a.untimed += 1
            kernel = user
        if kernel < since:
            a.early += 1
        a.kernel.append(max(0.0, kernel - since))
        a.user.append(user - since)
        a.parsed.append(parsed - since)
        a.ages.append(parsed - msg["admitted_at"])
        if self.think_s:
            self.loop.call_later(self.think_s, self._ack, msg["plan_id"])  # the rank trains on its plan
        else:
            self._ack(msg["plan_id"])
        return True

    def _ack(self, plan_id: str) -> None:
        if self.closed.is_set():
            return
        self.ready = time.time()  # from its ack on, the rank waits for its next plan
        line = b'{"ack":"' + plan_id.encode() + b'"}\n'
        self._send(b"%x\r\n%b\r\n" % (len(line), line))
        self.on_ack(self.rank)

    def _send(self, data: bytes) -> None:
        if self.pending:
            self.pending += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self._fail(f"send: {e}")
            return
        if sent < len(data):
            self.pending = data[sent:]
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(f"send: {e}")
            return
        self.pending = self.pending[sent:]
        if not self.pending:
            self.loop.remove_writer(self.sock.fileno())
