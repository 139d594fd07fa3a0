"""Health and Prometheus metrics (both open: no token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from knittrans import __version__
from knittrans.api.models import LaneOut
from knittrans.api.routes.deps import Service
from knittrans.errors import NotFound
from knittrans.flight.lane import MAX_ACTION_BYTES

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/v1/health")
async def health(svc: Service) -> dict[str, Any]:
    """Liveness: always open."""
    return {"status": "ok", "version": __version__, "jobs": len(svc.jobs), "nodes": len(svc.nodes)}


@router.get("/v1/lane", response_model=LaneOut)
async def registration_lane(request: Request) -> Any:
    """Where the control plane serves unit registrations as plain TCP actions (open: it names a port; the
    lane checks tokens as the route does). 404 when it runs without one (``--no-lane``, TLS)."""
    lane = request.app.state.lane
    if lane is None:
        raise NotFound("this control plane runs without a registration lane; register units over HTTP")
    return {"port": lane.port, "max_bytes": MAX_ACTION_BYTES, "served": lane.served}


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this instance's registry (collected on the state thread)."""
    body = await request.app.state.runner(generate_latest, request.app.state.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
