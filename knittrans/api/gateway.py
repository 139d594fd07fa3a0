"""The plan gateway: a process that serves the ranks' plan streams off the control plane's core.

At 1,024 ranks the plan stream's socket work (a line out and an ack line in per rank and mini-batch)
is about half of the control plane's one core, and it shares the GIL with the state thread. The
gateway (``knittrans control-plane --plan-gateway-port P``; started and stopped by the control
plane) serves the same stream, ``GET|POST /v1/jobs/{job}/ranks/{rank}/plans``, byte for byte the
same lines (:mod:`knittrans.api.stream`), on its own port and in its own process:

* the control plane's plan board forwards each rendered chunk of answers (the plan bytes ``next``
  answers) over a socket pair, one frame per chunk of ranks (:mod:`knittrans.api.gatewaywire`);
  the gateway keeps the latest answer per rank and writes a pre-framed chunk to each stream with
  raw asyncio transports (no ASGI);
* ack lines are parsed here and sent on in batches (one frame per batch, while the previous batch
  is applied) to the control plane, which applies them through its group commit; the refused ones
  come back and are answered with ``ack_error`` lines;
* a stream is set up by the control plane: the gateway sends the request's method, path, query and
  ``Authorization`` header and gets the status (the same token check, 404 for an unknown job or rank,
  422 for a bad ``keepalive_s``) and, with 200, the rank's first answer before it.

The gateway exits when the control plane closes the socket pair (or dies); its streams end, and
their clients reconnect (``GET /v1/plan-gateway`` says where, or 503 when the gateway is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import socket
import struct
import sys
from typing import Any

import httptools

from knittrans.api.gatewaywire import MAX_ACK_LINE, FrameReader, ack_of_line, frame, unpack_index

__all__ = ["main"]

logger = logging.getLogger(__name__)

_PLANS = re.compile(r"/v1/jobs/([^/]+)/ranks/([^/]+)/plans")
_RANK = re.compile(r"[0-9]{1,9}")
_MAX_HEAD = 16 << 10  # request line and headers
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    422: "Unprocessable Entity",
    503: "Service Unavailable",
}
Answer = tuple[bytes | None, str, bool]

MAX_UNREAD = 4 << 20
"""Bytes a stream may have waiting in the gateway for a client that does not read them (plans, keep-alives,
``ack_error`` lines for the ack lines it keeps sending); past this the stream is dropped: its client
reconnects and gets its un-acked plan again, and the gateway's memory stays bounded."""


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Gateway:
    """The gateway's state: latest answers per rank, open streams, the link to the control plane."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.link: asyncio.Transport | None = None
        self.answers: dict[str, dict[int, Answer]] = {}
        self.streams: dict[tuple[str, int], set[StreamConn]] = {}
        self.conns: set[StreamConn] = set()
        self.opening: dict[int, StreamConn] = {}
        self._next_id = 0
        self._acks: list[tuple[StreamConn, str, str, int]] = []  # (conn, plan id, job, rank) not sent yet
        self._in_flight: dict[int, list[tuple[StreamConn, str, str, int]]] = {}
        self._flush_queued = False
        self.closed: asyncio.Future[None] = loop.create_future()

    def send(self, head: dict[str, Any], blob: bytes = b"") -> None:
        if self.link is not None and not self.link.is_closing():
            self.link.write(frame(head, blob))

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # ---------------------------------------------------------------- from the control plane
    def on_frame(self, head: dict[str, Any], blob: bytes) -> None:
        kind = head["t"]
        if kind == "answers":
            self._answers(head, blob)
        elif kind == "opened":
            conn = self.opening.pop(head["id"], None)
            if conn is not None:
                conn.opened(head)
        elif kind == "acked":
            self._acked(head)
        elif kind == "close":
            self.shutdown()
        else:
            raise ValueError(f"unknown gateway message {kind!r}")

    def _answers(self, head: dict[str, Any], blob: bytes) -> None:
        job = head["job"]
        if head.get("forget"):
            self.answers.pop(job, None)
            return
        table = self.answers.setdefault(job, {})
        index, plans = unpack_index(blob, head["n"])
        job_state, streams, at = head["state"], self.streams, 0
        for i in range(0, len(index), 3):
            rank, length, done = index[i], index[i + 1], bool(index[i + 2])
            raw = None if length < 0 else plans[at : at + length]
            at += max(length, 0)
            answer = (raw, job_state, done)
            table[rank] = answer
            conns = streams.get((job, rank))
            if conns:
                for conn in list(conns):
                    conn.update(answer)

    # ---------------------------------------------------------------- acks
    def ack(self, conn: StreamConn, plan_id: str) -> None:
        """Queue one ack line's plan id; sent with the others of this loop turn, or after the batch in flight."""
        assert conn.job is not None and conn.rank is not None
        self._acks.append((conn, plan_id, conn.job, conn.rank))
        if not self._in_flight and not self._flush_queued:
            self._flush_queued = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_queued = False
        if not self._acks or self._in_flight:
            return
        batch, self._acks = self._acks, []
        batch_id = self.new_id()
        self._in_flight[batch_id] = batch
        self.send({"t": "acks", "id": batch_id, "acks": [[job, rank, plan_id] for _, plan_id, job, rank in batch]})

    def _acked(self, head: dict[str, Any]) -> None:
        batch = self._in_flight.pop(head["id"], [])
        for index, kind, detail in head["errors"]:
            conn, plan_id, _, _ = batch[index]
            conn.line(json.dumps({"ack_error": plan_id, "error": kind, "detail": detail}).encode())
        self._flush()

    def shutdown(self) -> None:
        """End every stream (their clients reconnect) and let the process exit."""
        for conn in list(self.conns):
            conn.end()
        if not self.closed.done():
            self.closed.set_result(None)


class LinkProtocol(asyncio.Protocol):
    """The socket pair to the control plane."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.reader = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.gateway.link = transport

    def data_received(self, data: bytes) -> None:
        for head, blob in self.reader.feed(data):
            self.gateway.on_frame(head, blob)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gateway.link = None
        self.gateway.shutdown()


class StreamConn(asyncio.Protocol):
    """One client connection: an HTTP/1.1 request for a plan stream, then the stream (NDJSON, chunked)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.auth: bytes | None = None
        self.head_bytes = 0
        self.job: str | None = None
        self.rank: int | None = None
        self.streaming = False
        self.ended = False
        self.body = b""  # ack lines not yet complete (or read before the stream was set up)
        self.last: bytes | None = None
        self.sent = False
        self.keepalive_due = False
        self.timer: asyncio.TimerHandle | None = None
        self.keepalive_s = 10.0
        self.ends_at = float("inf")
        self.acks = False

    # ---------------------------------------------------------------- HTTP request
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.gateway.conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        if not self.streaming and self.job is None:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.refuse(400, "invalid_request", f"bad HTTP request: {exc}")
        except httptools.HttpParserUpgrade:
            self.refuse(400, "invalid_request", "protocol upgrades are not served here")
        else:
            if self.job is None and self.head_bytes > _MAX_HEAD:
                self.refuse(400, "invalid_request", f"request head above {_MAX_HEAD} bytes")

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.auth = value

    def on_headers_complete(self) -> None:
        parsed = httptools.parse_url(self.url)
        path = parsed.path.decode("latin-1")
        query = (parsed.query or b"").decode("latin-1")
        method = self.parser.get_method().decode("latin-1")
        match = _PLANS.fullmatch(path)
        if match is None:
            detail = f"the plan gateway serves only /v1/jobs/{{job}}/ranks/{{rank}}/plans, not {path}"
            self.refuse(404, "not_found", detail)
            return
        if method not in ("GET", "POST"):
            self.refuse(405, "method_not_allowed", f"{method} {path}: the plan stream is GET or POST")
            return
        if not _RANK.fullmatch(match.group(2)):
            self.refuse(422, "invalid_request", f"path.rank: {match.group(2)!r} is not a rank (an integer >= 0)")
            return
        self.job, self.rank, self.acks = match.group(1), int(match.group(2)), method == "POST"
        request_id = self.gateway.new_id()
        self.gateway.opening[request_id] = self
        auth = None if self.auth is None else self.auth.decode("latin-1")
        self.gateway.send({"t": "open", "id": request_id, "method": method, "path": path, "query": query, "auth": auth})

    def on_body(self, body: bytes) -> None:
        if not self.acks:
            return
        self.body += body
        if self.streaming:
            self._lines()
        elif len(self.body) > MAX_UNREAD:  # ack lines before the stream even started: not a rank's client
            self.refuse(400, "invalid_request", f"more than {MAX_UNREAD} bytes of body before the stream started")

    def on_message_complete(self) -> None:
        pass  # a POST stream's body ended: the response goes on until the client closes

    def opened(self, head: dict[str, Any]) -> None:
        """The control plane's answer to the stream's setup: 200 (stream from now on) or an error."""
        if self.ended:
            return
        status = head["status"]
        if status != 200:
            body = json.dumps(head["body"]).encode()
            extra = b"www-authenticate: Bearer\r\n" if status == 401 else b""
            self._close_with(status, body, extra)
            return
        assert self.transport is not None and self.job is not None and self.rank is not None
        self.keepalive_s = float(head["keepalive_s"])
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ncache-control: no-store\r\n"
            b"x-knittrans-keepalive-s: %s\r\ntransfer-encoding: chunked\r\n\r\n" % f"{self.keepalive_s:g}".encode()
        )
        self.streaming = True
        self.gateway.streams.setdefault((self.job, self.rank), set()).add(self)
        loop = self.gateway.loop
        self.ends_at = loop.time() + float(head["max_s"])
        self.timer = loop.call_later(self.keepalive_s, self._tick)
        found = self.gateway.answers.get(self.job, {}).get(self.rank)
        if found is not None:
            self.update(found)
        self._lines()

    # ---------------------------------------------------------------- the stream
    def update(self, answer: Answer) -> None:
        """The rank's answer changed: write its plan (once per plan), or the done line and end."""
        raw, job_state, done = answer
        if not self.streaming or self.ended:
            return
        if raw is not None and raw != self.last:
            self.last = raw
            self.line(raw)
        elif raw is None and done:
            self.line(json.dumps({"done": True, "state": job_state}).encode())
            self.end()

    def line(self, data: bytes) -> None:
        if self.transport is not None and not self.ended and self.streaming:
            self.transport.write(_chunk(data + b"\n"))
            self.sent = True
            if self.transport.get_write_buffer_size() > MAX_UNREAD:
                unread = self.transport.get_write_buffer_size()
                logger.warning("plan stream of %s rank %s dropped: %d bytes unread", self.job, self.rank, unread)
                self.ended = True
                self._forget()
                sock = self.transport.get_extra_info("socket")
                if sock is not None:  # a reset: the kernel drops the unsent bytes too (no FIN queued behind them)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.transport.abort()

    def _tick(self) -> None:
        """Every ``keepalive_s``: a keep-alive line after a period without any line; the end after ``max_s``."""
        if self.ended:
            return
        loop = self.gateway.loop
        if loop.time() >= self.ends_at:
            self.end()
            return
        self.timer = loop.call_later(min(self.keepalive_s, max(0.0, self.ends_at - loop.time())), self._tick)
        if self.sent:
            self.sent = False
            return
        assert self.job is not None and self.rank is not None
        found = self.gateway.answers.get(self.job, {}).get(self.rank)
        job_state = found[1] if found is not None else "running"
        self.line(json.dumps({"keepalive": True, "state": job_state}).encode())
        self.sent = False  # as the control plane's stream: a keep-alive does not count as a line sent

    def _lines(self) -> None:
        *lines, self.body = self.body.split(b"\n")
        if len(self.body) > MAX_ACK_LINE:
            lines.append(self.body)
            self.body = b""
        for line in lines:
            if line.strip():
                self._ack_line(line)

    def _ack_line(self, line: bytes) -> None:
        plan_id = ack_of_line(line)
        if isinstance(plan_id, dict):
            self.line(json.dumps(plan_id).encode())
            return
        self.gateway.ack(self, plan_id)

    # ---------------------------------------------------------------- ending
    def refuse(self, status: int, kind: str, detail: str) -> None:
        self._close_with(status, json.dumps({"error": kind, "detail": detail}).encode(), b"")

    def _close_with(self, status: int, body: bytes, extra: bytes) -> None:
        if self.transport is not None and not self.ended:
            reason = _REASONS.get(status, "Error").encode()
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"%sconnection: close\r\n\r\n%s" % (status, reason, len(body), extra, body)
            )
        self.end()

    def end(self) -> None:
        """End the response (the last chunk) and the connection."""
        if self.ended:
            return
        if self.streaming and self.transport is not None:
            self.transport.write(b"0\r\n\r\n")
        self.ended = True
        self._forget()
        if self.transport is not None:
            self.transport.close()

    def _forget(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.job is not None and self.rank is not None:
            self.gateway.streams.get((self.job, self.rank), set()).discard(self)
        self.gateway.conns.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._forget()


async def _serve(fd: int, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    gateway = Gateway(loop)
    link = socket.socket(fileno=fd)
    await loop.connect_accepted_socket(lambda: LinkProtocol(gateway), link)
    try:
        server = await loop.create_server(lambda: StreamConn(gateway), host, port)
    except OSError as exc:  # the port is taken, the address not ours: the control plane says so and stops
        gateway.send({"t": "failed", "detail": f"cannot listen on {host}:{port}: {exc.strerror or exc}"})
        await asyncio.sleep(0.1)  # let the frame leave before the process ends
        return
    bound = server.sockets[0].getsockname()[1]
    gateway.send({"t": "ready", "port": bound})
    try:
        await gateway.closed
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m knittrans.api.gateway --fd N --host H --port P`` (started by the control plane)."""
    parser = argparse.ArgumentParser(prog="knittrans-plan-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the control plane's end of the socket pair")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(args.fd, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
