"""Health and Prometheus metrics (both open: no token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from knittrans import __version__
from knittrans.api.models import PlanGatewayOut
from knittrans.api.routes.deps import Service
from knittrans.errors import NotFound, Unavailable

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/v1/health")
async def health(svc: Service) -> dict[str, Any]:
    """Liveness: always open."""
    return {"status": "ok", "version": __version__, "jobs": len(svc.jobs), "nodes": len(svc.nodes)}


@router.get("/v1/plan-gateway", response_model=PlanGatewayOut)
async def plan_gateway(request: Request) -> Any:
    """Where the plan gateway serves the ranks' plan streams (open: it names a port; the gateway checks
    tokens). 404 when the server runs without one, 503 once it exited (use the server's own stream)."""
    gateway = request.app.state.gateway
    if gateway is None:
        raise NotFound("this control plane runs without a plan gateway; use its own plan stream")
    url = gateway.url
    if url is None:  # answered 503 with Retry-After by the app's error handler, as every Unavailable
        raise Unavailable(f"{gateway.lost}; use the control plane's own plan stream")
    return {"url": url, "pid": gateway.pid}


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
