"""Rank routes: long-poll for the next plan, acks, policy versions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knittrans.api.auth import WorkerAuth
from knittrans.api.models import AckIn, AckOut, ErrorOut, FetchedOut, RankPlanOut, VersionIn, VersionOut
from knittrans.api.routes.deps import AckBatcher, PlanBoard, Run, Service, StateRunner
from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings
from knittrans.api.stream import DEFAULT_KEEPALIVE_S, MAX_KEEPALIVE_S, MIN_KEEPALIVE_S, PlanStream, first_answer
from knittrans.errors import InvalidRequest, Unauthenticated

__all__ = ["DONE_HEADER", "STATE_HEADER", "router", "serve_next"]

DONE_HEADER = "X-KnitTrans-Done"
"""Set to ``1`` on a 204 when no further plan will ever come for the rank (job drained or completed)."""
STATE_HEADER = "X-KnitTrans-Job-State"
"""Lifecycle state of the job, on every 204 of the long-poll."""

router = APIRouter(
    prefix="/v1/jobs",
    tags=["ranks"],
    responses={401: {"model": ErrorOut}, 404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 410: {"model": ErrorOut}},
)


@router.get(
    "/{job}/ranks/{rank}/next",
    responses={200: {"model": RankPlanOut}, 204: {"description": "no plan within timeout_s (or the job is done)"}},
)
async def next_plan(
    job: str,
    rank: int,
    request: Request,
    _: WorkerAuth,
    timeout_s: float = Query(30.0, ge=0),
    after: str | None = Query(None, max_length=64),
    ack: str | None = Query(
        None,
        max_length=64,
        description="the rank's current plan id: ack it (like POST .../ack, without transfer figures), "
        "then long-poll the next plan, in one request; errors as for the ack (404 unknown plan, 409 out "
        "of order, 410 withdrawn), and then nothing was acked",
    ),
) -> Response:
    """Long-poll: the plan of the rank's next un-acked mini-batch; the same plan again until it is acked.

    With ``ack=<plan_id>``: ack that plan first (idempotent, so a retried request is safe), then
    long-poll for the next one: one request per rank per mini-batch instead of an ack and a ``next``.
    If the ack is refused (404 the plan is not this rank's, 409 an earlier plan is still open, 410
    it was withdrawn) the request answers that error and does not poll.

    With ``after=<plan_id>`` (the rank's current, un-acked plan): the plan of the mini-batch after
    it, so a rank can prefetch while it still trains ``plan_id``; acks stay in order. After
    ``plan_id`` is acked the same as without ``after`` (a poll in flight across the ack goes on).
    409 when ``plan_id`` is neither the rank's current plan nor the one acked just before it, 410
    when it was (or gets) withdrawn. ``ack`` and ``after`` together: 409 ``invalid_request``.
    """
    if ack is not None and after is not None:
        raise InvalidRequest("give either 'ack' (ack this plan, then wait for the next) or 'after', not both")
    if after is None:
        return await serve_next(request.app.state, job, rank, timeout_s, ack)
    state = request.app.state
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(timeout_s, state.settings.long_poll_max_s)
    return await _next_after(job, rank, after, state.service, state.runner, state.board, loop, deadline)


_STREAM_200: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/x-ndjson": {}}, "description": "one JSON object per line, until the client leaves"}
}


@router.get("/{job}/ranks/{rank}/plans", responses=_STREAM_200, operation_id="plan_stream")
@router.post("/{job}/ranks/{rank}/plans", responses=_STREAM_200, operation_id="plan_stream_with_acks")
async def plan_stream(
    job: str,
    rank: int,
    request: Request,
    _: WorkerAuth,
    keepalive_s: float = Query(DEFAULT_KEEPALIVE_S, ge=MIN_KEEPALIVE_S, le=MAX_KEEPALIVE_S),
) -> Response:
    """The rank's plans as a stream (NDJSON over one chunked response; :mod:`knittrans.api.stream`).

    Each line is what ``next`` would answer, pushed when it changes: the plan of the rank's next
    un-acked mini-batch (once per plan; again on a new stream while un-acked), a keep-alive line
    ``{"keepalive": true, "state": ...}`` every ``keepalive_s`` seconds without a plan, and
    ``{"done": true, "state": ...}`` last when no plan will ever come. Acks by ``POST .../ack``
    (or ``next?ack=``), or with ``POST`` as lines ``{"ack": "<plan_id>"}`` of the request's chunked
    body; a refused one is answered by a line ``{"ack_error": plan_id, "error": kind, "detail": ...}``.
    404 for an unknown job or rank, before the stream starts.
    """
    state = request.app.state
    if not state.settings.plan_stream:  # switched off: answered like a path this server does not have
        raise StarletteHTTPException(status_code=404)
    await first_answer(state, job, rank)  # NotFound (404) before the 200 goes out
    stream = PlanStream(state, job, rank, keepalive_s, acks=request.method == "POST")
    return _AsgiResponse(stream)


class _AsgiResponse(Response):
    """A :class:`Response` that runs a raw ASGI callable (the plan stream) when sent."""

    def __init__(self, app: PlanStream) -> None:
        super().__init__()
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._app(scope, receive, send)


async def serve_next(state: Any, job: str, rank: int, timeout_s: float, ack: str | None) -> Response:
    """``next`` without ``after`` (``ack`` optional), for the route and for :class:`FastNext`.

    The app's parts come from its ``state``, not one injected dependency each (FastAPI's
    per-dependency cost was a third of the event loop's time at 1,024 ranks). The plan is read from
    the plan board on the event loop; only a rank's first look goes to the state thread.
    """
    board: PlanBoard = state.board
    settings: Settings = state.settings
    if ack is not None:
        acks: AckBatcher = state.acks
        acked = await acks.ack(job, rank, ack)
        state.observed.record_ack(job, rank, acked, None, time.time())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(timeout_s, settings.long_poll_max_s)

    while True:
        event = board.rank_event(job, rank)  # taken before the read: a later publication wakes us
        board.probed(job, rank)
        raw, job_state, done = await first_answer(state, job, rank)  # the board's, else the state thread's
        plan = None if raw is None else Response(raw, media_type="application/json")
        reply = await _reply_or_wait(plan, done, job_state, event, loop, deadline)
        if reply is not None:
            return reply


async def _next_after(
    job: str,
    rank: int,
    after: str,
    svc: ControlPlane,
    run: StateRunner,
    board: PlanBoard,
    loop: asyncio.AbstractEventLoop,
    deadline: float,
) -> Response:
    """``next?after=``: probed on the state thread at each wake-up (it checks ``after`` each time)."""

    def probe() -> tuple[bytes | None, str, bool]:
        plan = svc.plan_after(job, rank, after)
        if plan is not None:
            return plan, "", False
        return None, svc.job(job).state, svc.done_after(job, rank, after)

    while True:
        event = board.rank_event(job, rank)  # taken before the probe: a change while it runs still wakes us
        board.probed(job, rank)
        raw, state, done = await run(probe)
        plan = None if raw is None else Response(raw, media_type="application/json")
        reply = await _reply_or_wait(plan, done, state, event, loop, deadline)
        if reply is not None:
            return reply


async def _reply_or_wait(
    plan: Response | None,
    done: bool,
    job_state: str,
    event: asyncio.Event,
    loop: asyncio.AbstractEventLoop,
    deadline: float,
) -> Response | None:
    """One look's answer: the plan, a 204 (no plan will come, or the time is up), or None once ``event``
    fired (or the time ran out) while waiting: then the caller looks again."""
    if plan is not None:
        return plan
    if done:
        return Response(status_code=204, headers={DONE_HEADER: "1", STATE_HEADER: job_state})
    remaining = deadline - loop.time()
    if remaining <= 0:
        return Response(status_code=204, headers={STATE_HEADER: job_state})
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), remaining)
    return None


@router.post("/{job}/ranks/{rank}/fetched", response_model=FetchedOut)
async def fetched(job: str, rank: int, body: AckIn, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """The rank holds its whole share of the plan (call before the optimizer step; idempotent).

    Once all ranks reported it, a store-node loss no longer withdraws the mini-batch; 410 when it
    was already withdrawn (then no rank may step on it: ask for the plan again).
    """
    return await run(svc.fetched, job, rank, body.plan_id)


@router.post("/{job}/ranks/{rank}/ack", response_model=AckOut)
async def ack(job: str, rank: int, body: AckIn, request: Request, _: WorkerAuth) -> Response:
    """Ack a plan (idempotent); 410 when the plan was withdrawn because its rows were lost.

    ``transfer`` (optional): the rank's transfer figures of this mini-batch, summed per rank in
    ``/metrics`` and the dashboard (a repeated ack is not counted twice).
    """
    acks: AckBatcher = request.app.state.acks
    result = await acks.ack(job, rank, body.plan_id)  # group commit with the acks arriving together
    transfer = body.transfer.model_dump() if body.transfer is not None else None
    request.app.state.observed.record_ack(job, rank, result, transfer, time.time())
    return JSONResponse(result)  # the service's dict is AckOut already: no second validation


@router.post("/{job}/versions", response_model=VersionOut)
async def report_version(
    job: str, body: VersionIn, svc: Service, run: Run, _: WorkerAuth, request: Request
) -> dict[str, Any]:
    """A rank's policy version after an optimizer step (never decreasing)."""
    scope = request.state.scope
    if scope is not None and scope.rank is not None and scope.rank != body.rank:
        raise Unauthenticated(f"this token is scoped to rank {scope.rank}; it cannot report for rank {body.rank}")
    return await run(svc.report_version, job, body.rank, body.version)


@router.get("/{job}/version", response_model=VersionOut)
async def get_version(job: str, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """Latest policy version, for rollout workers."""
    return await run(svc.get_version, job)
