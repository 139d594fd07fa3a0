"""Mini-batch routes: the manifest long-poll, fetched and ack per mini-batch, progress, policy versions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import APIRouter, Header, Path, Query, Request, Response

from knittrans.api.auth import WorkerAuth
from knittrans.api.delivery import Published
from knittrans.api.models import (
    AckIn,
    AckOut,
    ErrorOut,
    FetchedIn,
    FetchedOut,
    ManifestOut,
    ProgressOut,
    VersionIn,
    VersionOut,
)
from knittrans.api.routes.deps import KnownJob, Run, Service
from knittrans.errors import Conflict, Unauthenticated

__all__ = ["DONE_HEADER", "STATE_HEADER", "router"]

DONE_HEADER = "X-KnitTrans-Done"
"""Set to ``1`` on a 204 when the mini-batch asked for will never be admitted (job drained or completed)."""
STATE_HEADER = "X-KnitTrans-Job-State"
"""Lifecycle state of the job, on every 204 and 304 of the long-poll."""

router = APIRouter(prefix="/v1/jobs", tags=["mini-batches"], responses={410: {"model": ErrorOut}})

Index = Path(ge=0, le=(1 << 53) - 1, description="global index of the mini-batch (step * K + k)")


@router.get(
    "/{job}/minibatches/{n}",
    responses={
        200: {"model": ManifestOut, "description": "the manifest; `ETag` names the mini-batch, attempt and bytes"},
        204: {"description": "not admitted within timeout_s, or never will be (`X-KnitTrans-Done: 1`)"},
        304: {"description": "If-None-Match: the manifest did not change within timeout_s"},
    },
)
async def get_manifest(
    request: Request,
    _: WorkerAuth,
    job: KnownJob,
    n: int = Index,
    timeout_s: float = Query(30.0, ge=0, le=3600),
    if_none_match: str | None = Header(None, max_length=256),
) -> Response:
    """Long-poll: the manifest of mini-batch ``n`` once it is admitted (the same bytes for every rank).

    A manifest never changes once served, except that a node loss may withdraw the mini-batch and
    publish it again with the next attempt (and a node that moved gets its new endpoint): with
    ``If-None-Match: <ETag>`` the request waits until the manifest differs from that one (a re-plan
    after a failed fetch), answering 304 if it did not within ``timeout_s``. 409 when ``n`` is
    already consumed (below the trainer's position).
    """
    state = request.app.state
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(timeout_s, state.settings.long_poll_max_s)
    while True:
        event = state.board.event(job, "delivery")  # taken before the look: a later publication wakes us
        view = await _view(state, job)
        found = view.manifests.get(n)
        if found is not None and found[0] != if_none_match:
            return Response(found[1], media_type="application/json", headers={"ETag": found[0]})
        if found is None:
            if n < view.position:
                raise Conflict(
                    f"mini-batch {n} of job {job!r} was consumed (the trainer is at mini-batch {view.position})"
                )
            if view.final is not None and n >= view.final:
                return Response(status_code=204, headers={DONE_HEADER: "1", STATE_HEADER: view.state})
        remaining = deadline - loop.time()
        if remaining <= 0:
            return Response(status_code=304 if found is not None else 204, headers={STATE_HEADER: view.state})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), remaining)


async def _view(state: Any, job: str) -> Published:
    """The job's published view: the board's, else computed on the state thread (and stored there)."""
    view: Published | None = state.board.view(job)
    if view is not None:
        return view

    def compute() -> Published:
        found: Published = state.service.job(job).published()  # NotFound for a job that does not exist
        state.board.store(job, found)
        return found

    result: Published = await state.runner(compute)
    return result


@router.get("/{job}/minibatches", response_model=ProgressOut)
async def progress(job: str, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """Where the trainer is: its position, the next index, and each in-flight mini-batch's fetched and acked
    ranks (``[start, stop)`` runs). A restarted rank starts at the first one it has not acked."""
    return await run(svc.progress, job)


def _check_ranks(request: Request, ranks: list[int] | None) -> None:
    scope = request.state.scope
    if scope is not None and scope.rank is not None and ranks != [scope.rank]:
        who = "every rank" if ranks is None else f"ranks {ranks}"
        raise Unauthenticated(f"this token is scoped to rank {scope.rank}; it reports for that rank only, not {who}")


@router.post("/{job}/minibatches/{n}/fetched", response_model=FetchedOut)
async def fetched(
    job: str, body: FetchedIn, request: Request, svc: Service, run: Run, _: WorkerAuth, n: int = Index
) -> dict[str, Any]:
    """``ranks`` (null: every rank) hold their whole share (call before the optimizer step; idempotent).

    Once every rank is reported, a store-node loss no longer withdraws the mini-batch; 410 when that
    attempt was already withdrawn (then no rank may step on it: read the manifest again).
    """
    _check_ranks(request, body.ranks)
    return await run(svc.fetched, job, n, body.attempt, body.ranks)


@router.post("/{job}/minibatches/{n}/ack", response_model=AckOut)
async def ack(
    job: str, body: AckIn, request: Request, svc: Service, run: Run, _: WorkerAuth, n: int = Index
) -> dict[str, Any]:
    """``ranks`` (null: every rank) finished mini-batch ``n`` after their optimizer step (idempotent).

    At every rank acked the mini-batch is consumed: the trainer's position moves, rollout's window
    opens and the next admission may run. ``version``: the policy version the step produced, recorded
    in the same change, so a launch the freed window allows already sees it (save the weights first).
    ``transfer``: the ranks' transfer figures of the mini-batch, one column entry per rank the ack reports
    for (every rank when ``ranks`` is null), summed in ``/metrics`` and the dashboard (a repeated ack is not
    counted twice); figures not of exactly the ranks the ack reports for are refused (409, nothing recorded).
    410 when that attempt was withdrawn.
    """
    _check_ranks(request, body.ranks)
    ranks: list[int] = []
    columns: dict[str, list[Any]] = {}
    if (transfer := body.transfer) is not None:  # checked before the ack: a refused body changes nothing
        ranks = body.ranks if body.ranks is not None else list(range(len(transfer.exposed_s)))
        columns = transfer.columns(len(ranks))
    result: dict[str, Any] = await run(svc.ack, job, n, body.attempt, body.ranks, body.version, figures=ranks)
    if ranks:
        request.app.state.observed.record_ack(job, result, ranks, columns, time.time())
    return result


@router.post("/{job}/versions", response_model=VersionOut)
async def report_version(
    job: str, body: VersionIn, svc: Service, run: Run, _: WorkerAuth, request: Request
) -> dict[str, Any]:
    """A rank's policy version after an optimizer step (never decreasing); an ack may carry it instead."""
    _check_ranks(request, [body.rank])
    return await run(svc.report_version, job, body.rank, body.version)


@router.get("/{job}/version", response_model=VersionOut)
async def get_version(job: str, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """Latest policy version, for rollout workers."""
    return await run(svc.get_version, job)
