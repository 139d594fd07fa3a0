"""Unit routes: batch registration of sealed units, started-group supply, rollout headroom."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import APIRouter, Query, Request

from knittrans.api.auth import AdminAuth, WorkerAuth
from knittrans.api.models import (
    HeadroomOut,
    RolloutWeightsIn,
    RolloutWeightsOut,
    SupplyIn,
    SupplyOut,
    UnitRemovedOut,
    UnitsIn,
    UnitsOut,
)
from knittrans.api.routes.deps import KnownJob, Run, Service
from knittrans.descriptors import UnitDescriptor
from knittrans.lifecycle import TERMINAL
from knittrans.names import check_name

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["units"])


@router.post("/{job}/units", response_model=UnitsOut)
async def register_units(job: str, body: UnitsIn, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """Register sealed units (all or none); identical repeats are no-ops, a changed repeat is a 409."""
    return await run(svc.register_units, job, [UnitDescriptor.from_dict(u.model_dump()) for u in body.units])


@router.delete("/{job}/units/{unit}", response_model=UnitRemovedOut)
async def remove_unit(
    job: str,
    unit: str,
    svc: Service,
    run: Run,
    _: AdminAuth,
    reason: str = Query("removed by an admin", max_length=1024),
) -> dict[str, Any]:
    """Admin repair: take a bad unit out of scheduling; its groups that are not admitted yet become lost
    and are offered for regeneration. 409 once any of its groups is in a mini-batch."""
    return await run(svc.remove_unit, job, unit, reason)


@router.post("/{job}/supply", response_model=SupplyOut)
async def report_supply(job: str, body: SupplyIn, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """Groups started (counts or ids) and dropped per source: the pending supply ``P[s]``."""
    return await run(svc.report_supply, job, **body.model_dump())


@router.post("/{job}/rollout/{worker}/weights", response_model=RolloutWeightsOut)
async def report_rollout_weights(
    worker: str, body: RolloutWeightsIn, request: Request, _: WorkerAuth, job: KnownJob
) -> dict[str, Any]:
    """A rollout worker's weights: the version it generates with, loads, and versions whose file came late.

    Kept in memory (``/metrics`` and job status ``rollout_weights``), like store usage."""
    check_name(worker, "worker")
    return request.app.state.observed.record_rollout(job, worker, body.model_dump(), time.time())  # type: ignore[no-any-return]


@router.get("/{job}/headroom", response_model=HeadroomOut)
async def headroom(
    svc: Service,
    run: Run,
    request: Request,
    _: WorkerAuth,
    job: KnownJob,
    wait_s: float = Query(0.0, ge=0),
    sources: str | None = Query(None, max_length=4096, description="comma-separated sources the caller generates"),
) -> dict[str, Any]:
    """Room rollout has under the off-policy window (a paused job keeps it), and which sources may launch now.

    With ``wait_s``: long-poll until one of ``sources`` (default: any) has headroom (trainer
    progress frees room; other sources' launches make a source the one furthest behind), the job
    can no longer use groups, or ``wait_s`` passed; the answer is the same either way.
    """
    wanted = None if sources is None else {s for s in sources.split(",") if s}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, request.app.state.settings.long_poll_max_s)
    while True:
        event = request.app.state.board.event(job)  # taken before the probe: a change while it runs still wakes us
        view = await run(svc.headroom, job)
        remaining = deadline - loop.time()
        open_now = any(n > 0 for s, n in view["headroom"].items() if wanted is None or s in wanted)
        if open_now or view["state"] in TERMINAL or remaining <= 0:
            return view
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), remaining)
