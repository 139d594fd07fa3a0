"""Admin dashboard: the static page at ``/ui`` and the JSON it polls, ``/v1/overview`` (admin token)."""

from __future__ import annotations

import time
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from knittrans.api.auth import AdminAuth
from knittrans.api.routes.deps import Run, Service
from knittrans.api.status import overview

__all__ = ["CSP", "router"]

router = APIRouter(tags=["ui"])

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
"""The page's Content-Security-Policy: its own inline script and style, requests to this origin only."""


@cache
def _page() -> str:
    return resources.files("knittrans.api").joinpath("ui/index.html").read_text(encoding="utf-8")


@router.get("/v1/overview")
async def get_overview(request: Request, svc: Service, run: Run, _: AdminAuth) -> dict[str, Any]:
    """Jobs, store nodes and ranks in one document: what the dashboard and ``knittrans status`` show."""
    # The service's state belongs to the state thread; the rank/store figures to the event loop.
    return await run(overview, svc.jobs, svc.list_nodes, request.app.state.observed.snapshot(), time.time())


@router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
async def ui() -> HTMLResponse:
    """The dashboard page. It holds no data: it asks for the admin token and polls ``/v1/overview``."""
    return HTMLResponse(
        _page(),
        headers={
            "Content-Security-Policy": CSP,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )
