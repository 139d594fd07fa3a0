"""``create_app(settings)``: the control-plane FastAPI app (routes, auth, errors, metrics, state)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from knittrans import __version__
from knittrans.api.auth import TokenCheck
from knittrans.api.board import ManifestBoard
from knittrans.api.gate import RequestGate, open_paths
from knittrans.api.httperrors import install_error_handlers
from knittrans.api.metrics import make_registry
from knittrans.api.models import ErrorOut
from knittrans.api.observe import Observations
from knittrans.api.routes import health, jobs, minibatches, nodes, tokens, ui, units
from knittrans.api.routes.deps import StateRunner
from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings
from knittrans.api.store import RecordStore

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


async def _sweep(service: ControlPlane, runner: StateRunner, interval: float) -> None:
    """Declare late nodes lost; a sweep that itself ran late (the process was paused) first gives
    every node a fresh grace period, so a pause of ours never counts as a node's silence."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        await asyncio.sleep(interval)
        now = loop.time()
        paused = now - last - interval
        last = now
        try:
            await runner(service.sweep, paused_s=paused if paused > max(1.0, interval) else 0.0)
        except Exception:
            logger.exception("node sweep failed")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app: opens (or creates) the SQLite state at ``settings.db_path`` and loads it.

    Args:
        settings: service settings; None reads them from ``KNITTRANS_*`` environment variables.
    """
    settings = settings or Settings()
    board = ManifestBoard()
    runner = StateRunner()  # the one thread that touches the service's state (its docstring: why no locks)
    store = RecordStore(settings.db_path, synchronous=settings.db_synchronous, init=settings.db_init)
    service = ControlPlane(store, settings, on_change=board.notify, state_thread=runner.check)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store.reopen()  # an app served again after a shutdown (test clients) reconnects to its state
        runner.start()
        board.bind(asyncio.get_running_loop(), service.published)  # manifests published to this loop
        sweeper = asyncio.create_task(_sweep(service, runner, settings.node_sweep_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            runner.close()
            board.unbind()
            store.close()

    app = FastAPI(
        title="KnitTrans control plane",
        version=__version__,
        lifespan=lifespan,
        description="Jobs, store nodes, unit index, admission, mini-batch manifests, versions, staleness.",
    )
    app.state.settings = settings
    app.state.service = service
    app.state.board = board
    app.state.runner = runner
    app.state.tokens = TokenCheck(settings)
    app.state.observed = Observations()
    app.state.registry = make_registry(service, app.state.observed)
    install_error_handlers(app)
    routers = [module.router for module in (health, jobs, nodes, units, minibatches, tokens, ui)]
    for router in routers:  # the error body every route really returns, for each error status it may answer
        statuses = ["405", "413", "422", "503"] if router is health.router else list(_ERRORS)
        app.include_router(router, responses={s: {"model": ErrorOut, "description": _ERRORS[s]} for s in statuses})
    _close_maps_in_openapi(app)
    app.add_middleware(  # outermost: the token before any byte of the body, then the body's size and depth
        RequestGate,
        tokens=app.state.tokens,
        open_paths=open_paths([*app.routes, *(route for router in routers for route in router.routes)]),
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
    )
    return app


_ERRORS = {
    "400": "bad input the models cannot express (names, row layout, job-level rules)",
    "401": "missing or wrong bearer token",
    "404": "unknown job, node, rank or mini-batch",
    "405": "method not allowed on this path",
    "409": "contradicts the current state",
    "413": "request body above the configured limit",
    "422": "request does not match the documented schema (or an invalid job spec)",
    "503": "the state database refused the write; retry after Retry-After seconds",
}


def _close_maps_in_openapi(app: FastAPI) -> None:
    """Apply :func:`_close_maps` to the app's OpenAPI document when it is first built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build()
            _close_maps(app.openapi_schema["components"]["schemas"])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


def _close_maps(node: Any) -> None:
    """Maps keyed by names: pydantic states the key pattern as ``patternProperties`` only, which leaves
    other keys unconstrained; say that keys must match it (``propertyNames``) and nothing else is allowed."""
    if isinstance(node, dict):
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and len(patterns) == 1:
            (pattern,) = patterns
            node.setdefault("propertyNames", {})["pattern"] = pattern
            node["additionalProperties"] = False
        for value in node.values():
            _close_maps(value)
    elif isinstance(node, list):
        for value in node:
            _close_maps(value)
