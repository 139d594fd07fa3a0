"""Health and Prometheus metrics (both open: no token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from knittrans import __version__
from knittrans.api.routes.deps import Service

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/v1/health")
async def health(svc: Service) -> dict[str, Any]:
    """Liveness: always open."""
    return {"status": "ok", "version": __version__, "jobs": len(svc.jobs), "nodes": len(svc.nodes)}


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
