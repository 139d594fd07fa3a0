"""Job routes: create, get, quotas, pause / resume / drain, status."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from knittrans.api.auth import AdminAuth, WorkerAuth
from knittrans.api.models import JobCreate, JobPublic, QuotasUpdate
from knittrans.api.routes.deps import Run, Service
from knittrans.api.spec import JobSpec

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post(
    "",
    response_model=JobPublic,
    status_code=201,
    responses={200: {"model": JobPublic, "description": "the identical job exists already"}},
)
async def create_job(body: JobCreate, svc: Service, run: Run, _: AdminAuth, response: Response) -> dict[str, Any]:
    """Create a job (201); the identical spec again answers 200; another spec under the same name is a 409."""
    spec = JobSpec.from_dict(body.model_dump())
    job, created = await run(svc.create_job, spec)
    if not created:
        response.status_code = 200
    return job


@router.get("/{job}", response_model=JobPublic)
async def get_job(job: str, svc: Service, run: Run, _: WorkerAuth) -> dict[str, Any]:
    """Spec, state, quotas in force and latest policy version of a job."""
    return await run(svc.get_job, job)


@router.put("/{job}/quotas", response_model=JobPublic)
async def update_quotas(job: str, body: QuotasUpdate, svc: Service, run: Run, _: AdminAuth) -> dict[str, Any]:
    """Replace the quotas from the next train step on (validated like a new spec)."""
    return await run(svc.update_quotas, job, body.quotas)


@router.post("/{job}/pause", response_model=JobPublic)
async def pause(job: str, svc: Service, run: Run, _: AdminAuth) -> dict[str, Any]:
    """Stop admitting; planned mini-batches are still delivered."""
    return await run(svc.set_state, job, "pause")


@router.post("/{job}/resume", response_model=JobPublic)
async def resume(job: str, svc: Service, run: Run, _: AdminAuth) -> dict[str, Any]:
    """Resume a paused job (a draining or drained job cannot be resumed: 409)."""
    return await run(svc.set_state, job, "resume")


@router.post("/{job}/drain", response_model=JobPublic)
async def drain(job: str, svc: Service, run: Run, _: AdminAuth) -> dict[str, Any]:
    """Finish the current train step, then admit nothing more."""
    return await run(svc.set_state, job, "drain")


@router.get("/{job}/status")
async def status(job: str, svc: Service, run: Run, request: Request, _: WorkerAuth) -> dict[str, Any]:
    """Step, quota fill, group counts, deficits, groups to regenerate, staleness, admission times, and the
    rollout workers' weights (``rollout_weights``: version, loads, late versions, as they reported them)."""
    result: dict[str, Any] = await run(svc.status, job)
    result["rollout_weights"] = request.app.state.observed.job_rollout(job)
    return result
