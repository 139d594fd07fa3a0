"""Unit routes: batch registration of sealed units, started-group supply, rollout headroom."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from knittrans.api.auth import AdminAuth, WorkerAuth
from knittrans.api.models import (
    ErrorOut,
    GroupIn,
    HeadroomOut,
    RolloutWeightsIn,
    RolloutWeightsOut,
    SupplyIn,
    SupplyOut,
    UnitIn,
    UnitRemovedOut,
    UnitsOut,
    parse_units,
    unit_dict,
)
from knittrans.api.routes.deps import Board, Run, Service, SettingsDep, StateRunner
from knittrans.api.service import ControlPlane
from knittrans.descriptors import GROUP_FIELDS, UNIT_FIELDS, UnitDescriptor, checked_group, checked_unit
from knittrans.errors import InvalidRequest, NotFound
from knittrans.lifecycle import ADMITTING, TERMINAL
from knittrans.names import check_name

__all__ = ["descriptor_of", "register_body", "router", "to_descriptor"]

router = APIRouter(
    prefix="/v1/jobs",
    tags=["units"],
    responses={400: {"model": ErrorOut}, 401: {"model": ErrorOut}, 404: {"model": ErrorOut}, 409: {"model": ErrorOut}},
)


# descriptor_of uses the validated dicts as the descriptors' attribute dicts: same fields, same order
if tuple(GroupIn.model_fields) != GROUP_FIELDS or tuple(UnitIn.model_fields) != UNIT_FIELDS:
    raise ImportError("knittrans.api.models: GroupIn/UnitIn fields must be GroupRecord/UnitDescriptor's, in order")


def to_descriptor(u: UnitIn) -> UnitDescriptor:
    """Plain descriptor of a validated unit body (raises InvalidRequest for a bad row layout or inconsistent
    fields): :func:`descriptor_of` of its fields."""
    return descriptor_of(unit_dict(u))


def descriptor_of(u: dict[str, Any]) -> UnitDescriptor:
    """Descriptor of a unit's validated fields, as :func:`~knittrans.api.models.parse_units` gives them
    (raises InvalidRequest for a bad row layout or inconsistent fields). Takes ``u`` and its group dicts
    over: they become the descriptors' attribute dicts.

    ``u`` passed :class:`UnitIn`'s validation (the same per-field rules as :class:`UnitDescriptor`'s), so
    only the checks across fields run here.
    """
    groups = []
    row = 0
    for values in u["groups"]:
        gid = values["group_id"]
        n, tokens = values["num_trajectories"], values["trajectory_tokens"]
        if len(tokens) != n:
            raise InvalidRequest(f"group {gid!r}: num_trajectories={n} but {len(tokens)} token counts")
        start, end = values["version_start"], values["version_end"]
        if end < start:
            raise InvalidRequest(f"group {gid!r}: version_end < version_start")
        vw = values["version_weighted"]
        if not (math.isfinite(vw) and start - 1e-3 <= vw <= end + 1e-3):
            raise InvalidRequest(
                f"group {gid!r}: version_weighted {vw!r} must be a finite number in "
                f"[version_start, version_end] = [{start}, {end}]"
            )
        finished_at = values["finished_at"]
        if not math.isfinite(finished_at):
            raise InvalidRequest(f"group {gid!r}: finished_at {finished_at!r} must be a finite non-negative Unix time")
        if values["row_start"] != row:
            raise InvalidRequest(
                f"unit {u['unit_id']!r}: group {gid!r} starts at row {values['row_start']}, expected {row}"
            )
        row += n
        if type(tokens) is not tuple:
            values["trajectory_tokens"] = tuple(tokens)
        values["media_hashes"] = tuple(values.get("media_hashes", ()))
        groups.append(checked_group(values))
    if row != u["num_rows"]:
        raise InvalidRequest(f"unit {u['unit_id']!r}: groups cover {row} rows, unit has {u['num_rows']}")
    u["groups"] = tuple(groups)
    return checked_unit(u)


@router.post(
    "/{job}/units",
    response_model=UnitsOut,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/UnitsIn"}}},
        }
    },
)
async def register_units(job: str, request: Request, _: WorkerAuth) -> dict[str, Any]:
    """Register sealed units (all or none); identical repeats are no-ops, a changed repeat is a 409."""
    # the body (UnitsIn) is parsed and validated in one pass by pydantic's JSON parser (parse_units)
    raw = await request.body()
    state = request.app.state
    run: StateRunner = state.runner
    # parsing a large batch stays off the event loop too
    result: dict[str, Any] = await run(register_body, state.service, job, raw)
    return result


def register_body(svc: ControlPlane, job: str, raw: bytes) -> dict[str, Any]:
    """Parse and register a registration body (``UnitsIn`` as JSON) on the state thread: what the route
    answers (``UnitsOut``'s fields). Raises ``RequestValidationError`` for a bad body, ``KnitTransError``
    for a refused registration (nothing changed)."""
    try:
        units = parse_units(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    return svc.register_units(job, [descriptor_of(u) for u in units])


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
    return await run(
        svc.report_supply,
        job,
        started=body.started,
        group_ids=body.group_ids,
        dropped=body.dropped,
        request_id=body.request_id,
        regenerates=body.regenerates,
    )


@router.post("/{job}/rollout/{worker}/weights", response_model=RolloutWeightsOut)
async def report_rollout_weights(
    job: str, worker: str, body: RolloutWeightsIn, svc: Service, request: Request, _: WorkerAuth
) -> dict[str, Any]:
    """A rollout worker's weights: the version it generates with, loads, and versions whose file came late.

    Kept in memory (``/metrics`` and job status ``rollout_weights``), like store usage."""
    check_name(worker, "worker")
    if job not in svc.jobs:
        raise NotFound(f"job {job!r} does not exist")
    entry = request.app.state.observed.record_rollout(job, worker, body.model_dump(), time.time())
    return entry.to_dict()  # type: ignore[no-any-return]


@router.get("/{job}/headroom", response_model=HeadroomOut)
async def headroom(
    job: str,
    svc: Service,
    run: Run,
    board: Board,
    settings: SettingsDep,
    _: WorkerAuth,
    wait_s: float = Query(0.0, ge=0),
    sources: str | None = Query(None, max_length=4096, description="comma-separated sources the caller generates"),
) -> dict[str, Any]:
    """Room rollout has under the off-policy window, and which sources may launch now.

    With ``wait_s``: long-poll until one of ``sources`` (default: any) has headroom (trainer
    progress frees room; other sources' launches make a source the one furthest behind), the job
    can no longer use groups, or ``wait_s`` passed; the answer is the same either way.
    """
    wanted = None if sources is None else {s for s in sources.split(",") if s}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, settings.long_poll_max_s)
    while True:
        event = board.event(job)  # taken before the probe: a change while it runs still wakes us
        view = await run(svc.headroom, job)
        remaining = deadline - loop.time()
        open_now = any(n > 0 for s, n in view["headroom"].items() if wanted is None or s in wanted)
        if (open_now and view["state"] in ADMITTING) or view["state"] in TERMINAL or remaining <= 0:
            return view
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), remaining)
