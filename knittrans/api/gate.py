"""``RequestGate``: the control plane's outermost ASGI layer: token first, then body size and JSON depth."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from fastapi.routing import APIRoute
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from knittrans.api.auth import TokenCheck, needs_token
from knittrans.api.connguard import CONNECTION
from knittrans.errors import Unauthenticated
from knittrans.jsonlimits import nesting_over

__all__ = ["RequestGate", "open_paths"]


def open_paths(routes: Iterable[BaseRoute]) -> frozenset[str]:
    """Paths of ``routes`` served without a token: those that depend on no token check (health, metrics, the
    dashboard page, FastAPI's OpenAPI documents). Give the routers' own routes (``APIRouter.routes``):
    FastAPI may keep an app's included routers as one opaque route each."""
    paths = set()
    for route in routes:
        path = getattr(route, "path", None)
        if isinstance(path, str) and not (isinstance(route, APIRoute) and needs_token(route)):
            paths.add(path)
    return frozenset(paths)


class _TooLarge(Exception):
    pass


class RequestGate:
    """Pure ASGI middleware (docs/explanation/architecture.md, The control plane)."""

    def __init__(
        self, app: ASGIApp, *, tokens: TokenCheck, open_paths: frozenset[str], max_body_bytes: int, max_json_depth: int
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.open_paths = open_paths
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        conn = CONNECTION.get()
        if conn is not None:
            conn.begin()
        try:
            await self._serve(scope, receive, send)
        finally:
            if conn is not None:
                conn.end()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)
        length = headers.get(b"content-length")
        has_body = b"transfer-encoding" in headers or (length is not None and length.strip(b" 0") != b"")
        try:
            ok, why = self.tokens.authenticates(headers.get(b"authorization")), None
        except Unauthenticated as exc:
            ok, why = False, str(exc)
        if ok:
            conn = CONNECTION.get()
            if conn is not None:
                conn.authenticate()
        elif has_body:  # refused before a byte of it is received (the open paths take no body)
            why = why or "this endpoint needs the worker (or admin) bearer token"
            await _answer(send, 401, "unauthenticated", why, [(b"www-authenticate", b"Bearer")])
            return
        elif scope["path"] not in self.open_paths:
            send = _closing_on_401(send)  # no body: the route answers, naming the token it needs
        if not has_body:
            await self.app(scope, receive, send)
            return
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        try:
            body = await self._body(receive)
        except _TooLarge:
            await self._too_large(send)
            return
        if body is None:  # the client went away while sending it: nobody to answer
            return
        if nesting_over(body, self.max_json_depth):
            detail = f"request JSON nests deeper than the {self.max_json_depth} levels allowed (max_json_depth)"
            await _answer(send, 422, "invalid_request", detail)
            return
        given = False

        async def replay() -> Message:
            nonlocal given
            if given:
                return await receive()  # the disconnect, when the client goes
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _body(self, receive: Receive) -> bytes | None:
        """The whole body (None: the client disconnected first); :class:`_TooLarge` past ``max_body_bytes``."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body_bytes:
                raise _TooLarge
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, send: Send) -> None:
        detail = f"request body is larger than the {self.max_body_bytes} bytes allowed; send smaller batches"
        await _answer(send, 413, "payload_too_large", detail)


def _closing_on_401(send: Send) -> Send:
    """``send`` that closes the connection after a 401 (a refused token does not keep its connection)."""

    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 401:
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing


async def _answer(send: Send, status: int, error: str, detail: str, extra: list[Any] | None = None) -> None:
    """A JSON error answer (``{"error", "detail"}``, as the app's handlers write) that closes the connection:
    the request's body, if any, is left unread."""
    body = json.dumps({"error": error, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
