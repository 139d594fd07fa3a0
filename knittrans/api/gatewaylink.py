"""The control plane's end of its plan gateway (:mod:`knittrans.api.gateway`): start, feed, answer, stop.

Runs on the app's event loop. Starts the gateway process with one end of a socket pair; forwards the
plan board's published answers of the jobs the gateway streams (one frame per published chunk of
ranks); sets up each stream the gateway asks for with the app's own checks (bearer token,
:func:`~knittrans.api.stream.first_answer`: 404 for an unknown job or rank) and applies the gateway's
ack batches through the app's group commit (:class:`~knittrans.api.routes.deps.AckBatcher`), sending
back the refused ones. When the gateway dies its clients lose their streams; ``GET /v1/plan-gateway``
then answers 503 and the control plane's own stream still serves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import time
from typing import Any

from knittrans.api.auth import request_for
from knittrans.api.delivery import Answer
from knittrans.api.fastpath import keepalive_query
from knittrans.api.gatewaywire import FrameReader, frame, pack_index
from knittrans.api.httperrors import error_kind
from knittrans.api.stream import MAX_KEEPALIVE_S, MIN_KEEPALIVE_S, first_answer
from knittrans.errors import KnitTransError, Unavailable, http_status

__all__ = ["GatewayLink"]

logger = logging.getLogger(__name__)

_READY_S = 60.0
_STOP_S = 5.0


class GatewayLink(asyncio.Protocol):
    """The running gateway process and the socket pair to it (module docstring)."""

    def __init__(self, state: Any, host: str) -> None:
        self.state, self.host = state, host
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.transport: asyncio.Transport | None = None
        self.jobs: set[str] = set()  # jobs with a stream on the gateway: their answers are forwarded
        self._reader = FrameReader()
        self._ready: asyncio.Future[int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.lost: str | None = None
        """Why the gateway is gone (None while it runs)."""

    @property
    def url(self) -> str | None:
        """``http://host:port`` of the running gateway, None once it is gone."""
        if self.port is None or self.lost is not None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, port: int) -> None:
        """Start the gateway on ``host:port`` (0: a free port) and wait until it listens. Raises
        :class:`~knittrans.errors.Unavailable` when it does not come up."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "knittrans.api.gateway", "--fd", str(theirs.fileno()), "--host", self.host]
        self.proc = subprocess.Popen([*cmd, "--port", str(port)], pass_fds=[theirs.fileno()])
        theirs.close()
        self._ready = loop.create_future()
        await loop.connect_accepted_socket(lambda: self, ours)
        try:
            self.port = await asyncio.wait_for(self._ready, _READY_S)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            self.stop_now()
            why = str(exc) or f"no answer within {_READY_S:g} s"
            raise Unavailable(f"the plan gateway did not start on {self.host}:{port}: {why}") from exc
        logger.info("plan gateway (pid %d) on %s", self.proc.pid, self.url)

    def publish(self, job: str, answers: dict[int, Answer] | None) -> None:
        """The plan board published ``answers`` of ``job`` (None: forget the job); on the event loop."""
        if job not in self.jobs or self.transport is None or self.lost is not None:
            return
        if answers is None:
            self.transport.write(frame({"t": "answers", "job": job, "forget": True}))
            return
        by_state: dict[str, tuple[list[int], list[bytes]]] = {}  # one job state per chunk, nearly always
        for rank, (raw, job_state, done) in answers.items():
            index, plans = by_state.setdefault(job_state, ([], []))
            index += (rank, -1 if raw is None else len(raw), done)
            if raw is not None:
                plans.append(raw)
        for job_state, (index, plans) in by_state.items():
            head = {"t": "answers", "job": job, "state": job_state, "n": len(index) // 3}
            self.transport.write(frame(head, pack_index(index) + b"".join(plans)))

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except ValueError:
            logger.exception("plan gateway: unreadable frame; stopping it")
            self.stop_now()
            return
        for head, _ in frames:
            kind = head["t"]
            if kind == "ready" and self._ready is not None and not self._ready.done():
                self._ready.set_result(int(head["port"]))
            elif kind == "failed" and self._ready is not None and not self._ready.done():
                self._ready.set_exception(ConnectionError(head["detail"]))
            elif kind == "open":
                self._spawn(self._open(head))
            elif kind == "acks":
                self._spawn(self._acks(head))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        code = None if self.proc is None else self.proc.poll()
        if self._ready is not None and not self._ready.done():  # during start: start() reports it
            self._ready.set_exception(ConnectionError(f"it exited (code {code})"))
            return
        if self.lost is None:
            self.lost = f"the plan gateway exited (code {code})"
            logger.error("%s; ranks fall back to the control plane's own plan stream", self.lost)

    # ---------------------------------------------------------------- requests from the gateway
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, head: dict[str, Any]) -> None:
        if self.transport is not None:
            self.transport.write(frame(head))

    async def _open(self, head: dict[str, Any]) -> None:
        """Set up one stream: the app's token check and first answer, then ``opened``."""
        state, path = self.state, head["path"]
        parts = path.split("/")  # /v1/jobs/{job}/ranks/{rank}/plans (the gateway matched it)
        job, rank = parts[3], int(parts[5])
        reply: dict[str, Any] = {"t": "opened", "id": head["id"]}
        keepalive_s = keepalive_query(head["query"].encode("latin-1"))
        auth = None if head["auth"] is None else head["auth"].encode("latin-1")
        params = {"job": job, "rank": parts[5]}
        try:
            state.tokens.check_worker(request_for(head["method"], path, auth, params, head["query"].encode("latin-1")))
            if keepalive_s is None:
                low, high = MIN_KEEPALIVE_S, MAX_KEEPALIVE_S
                detail = f"query {head['query']!r}: keepalive_s must be a number in [{low}, {high}]"
                reply.update(status=422, body={"error": "invalid_request", "detail": detail})
                self._send(reply)
                return
            if not state.settings.plan_stream:
                reply.update(status=404, body={"error": "not_found", "detail": "plan streams are off on this server"})
                self._send(reply)
                return
            answer = await first_answer(state, job, rank)
        except KnitTransError as exc:
            reply.update(status=http_status(exc), body={"error": error_kind(exc), "detail": str(exc)})
            self._send(reply)
            return
        self.jobs.add(job)  # later publications of the job go to the gateway
        self.publish(job, {rank: state.board.answer(job, rank) or answer})  # the board's is never older
        reply.update(status=200, keepalive_s=keepalive_s, max_s=state.settings.plan_stream_max_s)
        self._send(reply)

    async def _acks(self, head: dict[str, Any]) -> None:
        """Apply one batch of ack lines: one state-thread call and one SQLite transaction per job (the gateway
        already batched them; ``ControlPlane.ack_many``); send back the refused ones."""
        acks: list[list[Any]] = head["acks"]
        by_job: dict[str, list[int]] = {}
        for index, (job, _, _) in enumerate(acks):
            by_job.setdefault(job, []).append(index)
        outcomes: list[Any] = [None] * len(acks)
        for job, indices in by_job.items():
            try:
                got = await self.state.runner(self.state.service.ack_many, job, [acks[i][1:] for i in indices])
            except Exception as exc:  # a job-level error (unknown job) or a failed commit: each of its acks fails
                got = [exc] * len(indices)
            for i, result in zip(indices, got, strict=True):
                outcomes[i] = result
        errors, now, observed = [], time.time(), self.state.observed
        for index, ((job, rank, plan_id), got) in enumerate(zip(acks, outcomes, strict=True)):
            if isinstance(got, KnitTransError):
                errors.append([index, error_kind(got), str(got)])
            elif isinstance(got, BaseException):
                logger.error("plan gateway: ack %r of rank %d of job %s failed", plan_id, rank, job, exc_info=got)
                errors.append([index, "internal", f"{type(got).__name__}: {got}"])
            else:
                observed.record_ack(job, rank, got, None, now)
        self._send({"t": "acked", "id": head["id"], "errors": errors})

    # ---------------------------------------------------------------- stopping
    async def stop(self) -> None:
        """Ask the gateway to end its streams and exit; kill it after a few seconds."""
        self._send({"t": "close"})
        proc = self.proc
        if proc is not None:
            deadline = time.monotonic() + _STOP_S
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.stop_now()

    def stop_now(self) -> None:
        """Kill the gateway (if it still runs) and close the socket pair."""
        if self.lost is None:
            self.lost = "the plan gateway was stopped"
        if self.transport is not None:
            self.transport.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_STOP_S)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid
