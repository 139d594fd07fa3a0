"""A rank's plan stream: ``GET|POST /v1/jobs/{job}/ranks/{rank}/plans``, NDJSON over one chunked response.

At 1,024 ranks a long-poll per rank per mini-batch costs a whole HTTP request and response on the
server's one event loop (~500 µs each). On the stream the server writes each of the rank's plans
as one line of an open response instead: one chunk per rank per mini-batch.

What the stream sends is what ``next`` would answer, pushed whenever it changes: the plan of the
rank's next un-acked mini-batch (the same JSON body as ``next``), once per plan; after the rank
acks it, the next plan once it is admitted; a withdrawn plan's re-plan (its new attempt) as soon as
it is made. A plan that was sent but not acked is sent again on a new stream (reconnect), like
``next`` answers it again. Other lines (JSON objects without ``plan_id``):

* ``{"keepalive": true, "state": ...}`` after ``keepalive_s`` seconds (at most twice that) without a line (a dead
  client is noticed by the failed write; a client that reads nothing for a few periods knows the
  server or the path to it is gone);
* ``{"done": true, "state": ...}``: no plan will ever come for this rank (drained or completed);
  the response ends after it;
* ``{"ack_error": plan_id, "error": kind, "detail": ...}``: an ack sent on the stream was refused
  (as ``POST .../ack`` would answer it: not_found, conflict, data_lost).

Acks: by the usual calls (``POST .../ack``, or ``next?ack=``), or, with ``POST``, as lines of the
request's chunked body (``{"ack": "<plan_id>"}`` each, sent while the response streams): one
chunk each way per mini-batch on the one connection. Such acks join the same group commit
(:class:`~knittrans.api.routes.deps.AckBatcher`) as the others.

A stream ends (without ``done``) after ``plan_stream_max_s`` (setting, default an hour) and at server
shutdown; the client opens a new one. Errors before the stream starts (bad token, unknown job or
rank, bad ``keepalive_s``) are answered like ``next``'s: 401, 404, 422 with the usual error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from knittrans.api.delivery import Answer
from knittrans.api.gatewaywire import MAX_ACK_LINE, ack_of_line
from knittrans.api.httperrors import error_kind
from knittrans.errors import KnitTransError

__all__ = ["DEFAULT_KEEPALIVE_S", "MAX_KEEPALIVE_S", "MIN_KEEPALIVE_S", "PlanStream", "close_streams", "first_answer"]

logger = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_S = 10.0
MIN_KEEPALIVE_S = 0.05
MAX_KEEPALIVE_S = 300.0


async def first_answer(state: Any, job: str, rank: int) -> Answer:
    """The rank's answer now: the plan board's, else the state thread's (which publishes it to the board).
    Raises NotFound for an unknown job or rank: the stream's route checks its input with it before the 200,
    and ``next`` (``serve_next``) reads every answer through it."""
    found: Answer | None = state.board.answer(job, rank)
    if found is not None:
        return found
    svc, board = state.service, state.board

    def look() -> Answer:
        got: Answer = svc.rank_answer(job, rank)  # 404 for an unknown job or rank
        board.store(job, rank, got)
        return got

    result: Answer = await state.runner(look)
    return result


def close_streams(state: Any) -> int:
    """End every open plan stream of the app (its server is shutting down: uvicorn waits for open
    responses to finish, and a stream never does by itself); on the event loop. Returns how many."""
    streams: set[PlanStream] = state.plan_streams
    for stream in list(streams):
        stream.close()
    return len(streams)


class PlanStream:
    """ASGI response of one rank's plan stream (module docstring); ``acks``: read acks from the request body."""

    def __init__(self, state: Any, job: str, rank: int, keepalive_s: float, *, acks: bool) -> None:
        self.state, self.job, self.rank, self.keepalive_s, self.acks = state, job, rank, keepalive_s, acks
        self._closed = False  # the client went away (our reader saw the disconnect)
        self._pusher: asyncio.Task[Any] | None = None
        self._in_wait = False  # the pusher waits for a board event (close() and _tick cancel that wait)
        self._timer: asyncio.TimerHandle | None = None
        self._sent = False  # a line went out since the last tick
        self._keepalive_due = False
        self._ends_at = float("inf")
        self._writing: set[asyncio.Task[None]] = set()  # ack_error lines being written

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/x-ndjson"),
                    (b"cache-control", b"no-store"),
                    (b"x-knittrans-keepalive-s", f"{self.keepalive_s:g}".encode()),
                ],
            }
        )
        streams: set[PlanStream] = self.state.plan_streams
        streams.add(self)
        self._pusher = asyncio.current_task()
        reader = asyncio.create_task(self._read(receive, send))
        try:
            await self._push(send)
        finally:
            streams.discard(self)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def close(self) -> None:
        """End the stream now (on the event loop): the response ends after the line being written."""
        self._closed = True
        if self._in_wait and self._pusher is not None:
            self._pusher.cancel()  # only its wait (never a write): the pusher sees _closed and ends

    async def _push(self, send: Send) -> None:
        """Send the rank's plan whenever it changes; keep-alive lines in between; the done line last.

        Waits on the board's event of the rank with no task or timer of its own per wait (at 1,024
        ranks a ``wait_for`` per rank and mini-batch was a tenth of the loop's time): one repeating
        timer per stream (:meth:`_tick`) asks for a keep-alive line after a period without any line.
        """
        state, job, rank = self.state, self.job, self.rank
        board = state.board
        loop = asyncio.get_running_loop()
        last: bytes | None = None
        self._timer = loop.call_later(self.keepalive_s, self._tick, loop)
        self._ends_at = loop.time() + state.settings.plan_stream_max_s
        try:
            while not self._closed:
                found = board.answer(job, rank)
                event = board.rank_event(job, rank)  # taken with the read: a later publication wakes us
                if found is None:
                    found = await first_answer(state, job, rank)
                raw, job_state, done = found
                if raw is not None and raw != last:
                    await send({"type": "http.response.body", "body": raw + b"\n", "more_body": True})
                    last, self._sent = raw, True
                    continue
                if raw is None and done:
                    line = json.dumps({"done": True, "state": job_state}).encode() + b"\n"
                    await send({"type": "http.response.body", "body": line, "more_body": True})
                    return
                if self._keepalive_due:
                    self._keepalive_due = False
                    line = json.dumps({"keepalive": True, "state": job_state}).encode() + b"\n"
                    await send({"type": "http.response.body", "body": line, "more_body": True})
                    continue
                self._in_wait = True
                try:
                    await event.wait()
                except asyncio.CancelledError:
                    if not (self._closed or self._keepalive_due):
                        raise  # not ours (close() or the keep-alive timer): the server cancels the request
                    uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python >= 3.11
                    if uncancel is not None:
                        uncancel()
                finally:
                    self._in_wait = False
        finally:
            if self._timer is not None:
                self._timer.cancel()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every ``keepalive_s``: after a period in which nothing was sent, have the pusher send a keep-alive
        line (so a line goes out at least every two periods)."""
        if self._closed:
            return
        if loop.time() >= self._ends_at:  # plan_stream_max_s: end it; the client reconnects
            self.close()
            return
        self._timer = loop.call_later(min(self.keepalive_s, max(0.0, self._ends_at - loop.time())), self._tick, loop)
        if self._sent:
            self._sent = False
            return
        self._keepalive_due = True
        if self._in_wait and self._pusher is not None:
            self._pusher.cancel()  # only its wait: it sends the keep-alive line and waits again

    async def _read(self, receive: Receive, send: Send) -> None:
        """Watch the request: acks from its body (``POST``); cancel the sender when the client goes away.

        Each ack line is parsed here and queued to the group commit (:meth:`AckBatcher.submit`) with a
        callback for its outcome: no task per ack line (1,024 of them per mini-batch at 1,024 ranks); only
        a refused ack makes one, to write its ``ack_error`` line."""
        buffer = b""
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
                if not self.acks:
                    continue
                buffer += message.get("body", b"")
                *lines, buffer = buffer.split(b"\n")
                if len(buffer) > MAX_ACK_LINE:
                    lines.append(buffer)
                    buffer = b""
                for line in lines:
                    if line.strip():
                        self._ack(line, send)
        finally:
            self.close()

    def _ack(self, line: bytes, send: Send) -> None:
        """Queue the ack of one body line; a line that is not an ack is answered with ``ack_error`` at once."""
        plan_id = ack_of_line(line)
        if isinstance(plan_id, dict):
            self._write_error(plan_id, send)
            return
        future = self.state.acks.submit(self.job, self.rank, plan_id)
        future.add_done_callback(functools.partial(self._acked, plan_id, send))

    def _acked(self, plan_id: str, send: Send, future: asyncio.Future[dict[str, Any]]) -> None:
        """The outcome of an ack line (a callback on the loop): recorded, or its ``ack_error`` line written."""
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self.state.observed.record_ack(self.job, self.rank, future.result(), None, time.time())
        elif isinstance(exc, KnitTransError):
            self._write_error({"ack_error": plan_id, "error": error_kind(exc), "detail": str(exc)}, send)
        else:
            logger.error("plan stream of rank %d of job %s: ack %r failed", self.rank, self.job, plan_id, exc_info=exc)

    def _write_error(self, body: dict[str, Any], send: Send) -> None:
        async def write() -> None:
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": json.dumps(body).encode() + b"\n", "more_body": True})

        task = asyncio.create_task(write())
        self._writing.add(task)  # held until done (the loop keeps only weak references to tasks)
        task.add_done_callback(self._writing.discard)
