"""``create_app(settings)``: the control-plane FastAPI app (routes, auth, errors, metrics, state)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from knittrans import __version__
from knittrans.api.auth import TokenCheck
from knittrans.api.httperrors import install_error_handlers
from knittrans.api.metrics import make_registry
from knittrans.api.models import UnitsIn
from knittrans.api.observe import Observations
from knittrans.api.routes import health, jobs, nodes, ranks, ui, units
from knittrans.api.routes.deps import PlanBoard
from knittrans.api.service import ControlPlane
from knittrans.api.settings import Settings
from knittrans.api.store import RecordStore

__all__ = ["BodyLimit", "create_app"]

logger = logging.getLogger(__name__)


class BodyLimit:
    """ASGI middleware answering 413 for request bodies above ``max_bytes`` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Send) -> None:
        body = ('{"error":"payload_too_large","detail":"request body is larger than the '
                f'{self.max_bytes} bytes allowed; send smaller batches"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._reject(send)


class _TooLarge(Exception):
    pass


async def _sweep(service: ControlPlane, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            service.sweep()
        except Exception:
            logger.exception("node sweep failed")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app: opens (or creates) the SQLite state at ``settings.db_path`` and loads it.

    Args:
        settings: service settings; None reads them from ``KNITTRANS_*`` environment variables.
    """
    settings = settings or Settings()
    board = PlanBoard()
    store = RecordStore(settings.db_path, synchronous=settings.db_synchronous)
    service = ControlPlane(store, node_timeout_s=settings.node_timeout_s,
                           recent_admissions=settings.recent_admissions, on_plans=board.notify)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep(service, settings.node_sweep_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            store.close()

    app = FastAPI(title="KnitTrans control plane", version=__version__, lifespan=lifespan,
                  description="Jobs, store nodes, unit index, admission, rank plans, versions, staleness.")
    app.state.settings = settings
    app.state.service = service
    app.state.board = board
    app.state.tokens = TokenCheck(settings)
    app.state.observed = Observations()
    app.state.registry = make_registry(service, app.state.observed)
    install_error_handlers(app)
    for module in (health, jobs, nodes, units, ranks, ui):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    _document_raw_bodies(app)
    return app


def _document_raw_bodies(app: FastAPI) -> None:
    """Add the models of bodies that routes parse themselves (``UnitsIn``) to the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            extra = UnitsIn.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(extra.pop("$defs", {}))
            components["UnitsIn"] = extra
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


