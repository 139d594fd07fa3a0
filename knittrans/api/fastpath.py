"""``FastNext``: a rank's long-poll for its next plan answered before FastAPI's routing.

At 1,024 ranks ``GET /v1/jobs/{job}/ranks/{rank}/next`` is most of the control plane's requests (one
per rank per mini-batch, with ``ack=``). The event loop was the bottleneck and FastAPI's routing,
dependency resolution and exception middleware took about half of its time per request. This ASGI
middleware recognises the plain form of that request (only ``timeout_s`` and ``ack`` in the query,
well-formed) and answers it with the route's own code (:func:`~knittrans.api.routes.ranks.serve_next`)
after the same auth check. Everything else, and any request the fast path cannot answer (bad
token, unknown job or rank, a refused ack, an unexpected error), goes to the FastAPI app unchanged,
which answers it (and its errors) as documented; nothing was changed by then, so asking the app is
safe (a refused ack changes nothing; a repeated ack is a no-op).

The same for a rank's plan stream (``.../plans``, :mod:`knittrans.api.stream`), set up here so that its
body of acks is not counted by the app's body limit, and for a plain ``POST .../ack`` (a JSON body of
at most 64 KiB, no query): what the trainer client sends once per rank and mini-batch next to its
plan stream.

And for a plain ``POST /v1/jobs/{job}/units`` (a JSON body no larger than the app's body limit, no
query): the registration every rollout writer sends once per ``write_units`` call. The route's own
steps (:func:`~knittrans.api.routes.units.register_body`) run after the same auth check; FastAPI's
routing and middleware took about as much of the control plane's CPU per request as the
registration itself. A refused registration changed nothing (all or none, refused before any
change), so the app answers it again from the replayed body, with its documented errors.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any
from urllib.parse import parse_qsl

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from knittrans.api.models import AckIn
from knittrans.api.routes.ranks import serve_next
from knittrans.api.routes.units import register_body
from knittrans.api.stream import DEFAULT_KEEPALIVE_S, MAX_KEEPALIVE_S, MIN_KEEPALIVE_S, PlanStream, first_answer
from knittrans.errors import KnitTransError

__all__ = ["FastNext", "keepalive_query"]

logger = logging.getLogger(__name__)

_NEXT = re.compile(r"/v1/jobs/([^/]+)/ranks/([0-9]{1,9})/next")
_PLANS = re.compile(r"/v1/jobs/([^/]+)/ranks/([0-9]{1,9})/plans")
_ACK = re.compile(r"/v1/jobs/([^/]+)/ranks/([0-9]{1,9})/ack")
_UNITS = re.compile(r"/v1/jobs/([^/]+)/units")
_ACK_IN = TypeAdapter(AckIn)
_MAX_ACK_BODY = 64 << 10
_MAX_PLAN_ID = 64  # the route's max_length of ``ack``


def _query(raw: bytes) -> tuple[float, str | None] | None:
    """``(timeout_s, ack)`` of a plain ``next`` query, or None (anything else: the route decides)."""
    timeout_s, ack, seen = 30.0, None, set()
    for key, value in parse_qsl(raw.decode("latin-1"), keep_blank_values=True):
        if key in seen:
            return None
        seen.add(key)
        if key == "timeout_s":
            try:
                timeout_s = float(value)
            except ValueError:
                return None
            if not (math.isfinite(timeout_s) and timeout_s >= 0):
                return None
        elif key == "ack":
            if not value or len(value) > _MAX_PLAN_ID:
                return None
            ack = value
        else:
            return None
    return timeout_s, ack


def keepalive_query(raw: bytes) -> float | None:
    """``keepalive_s`` of a plain plan-stream query, or None (anything else: the route decides)."""
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    if not pairs:
        return DEFAULT_KEEPALIVE_S
    if len(pairs) != 1 or pairs[0][0] != "keepalive_s":
        return None
    try:
        value = float(pairs[0][1])
    except ValueError:
        return None
    return value if MIN_KEEPALIVE_S <= value <= MAX_KEEPALIVE_S else None


class FastNext:
    """ASGI middleware: plain ``next`` requests answered without FastAPI's routing (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "POST"):
            if scope["path"].endswith("/plans"):
                await self._maybe_stream(scope, receive, send)
                return
            if scope["method"] == "POST" and scope["path"].endswith("/ack"):
                await self._maybe_ack(scope, receive, send)
                return
            if scope["method"] == "POST" and scope["path"].endswith("/units"):
                await self._maybe_register(scope, receive, send)
                return
            match = _NEXT.fullmatch(scope["path"]) if scope["method"] == "GET" else None
            parsed = _query(scope.get("query_string", b"")) if match is not None else None
            if match is not None and parsed is not None:
                response = await self._serve(scope, match, *parsed)
                if response is not None:
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _maybe_register(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A plain ``POST .../units`` answered with the route's own steps; anything else, and every error, by the
        app (its body replayed: a refused registration changed nothing)."""
        match = _UNITS.fullmatch(scope["path"])
        state: Any = scope["app"].state
        if match is None:
            await self.app(scope, receive, send)
            return
        try:  # the token before the body: an unauthenticated upload is not read here
            state.tokens.check_worker(Request({**scope, "path_params": {"job": match.group(1)}}))
        except KnitTransError:
            state.fast_next["to_app"] += 1
            await self.app(scope, receive, send)  # the app answers the 401
            return
        try:
            raw = await _plain_json_body(scope, receive, state.settings.max_body_bytes)
        except _ClientGone:
            return
        if raw is None:
            await self.app(scope, receive, send)
            return
        try:
            result = await state.runner(register_body, state.service, match.group(1), raw)
        except (KnitTransError, RequestValidationError):
            state.fast_next["to_app"] += 1
            await self.app(scope, _replay(raw, receive), send)  # the app answers it (401, 404, 409, 422, 503)
            return
        state.fast_next["served"] += 1
        await JSONResponse(result)(scope, receive, send)

    async def _maybe_ack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A plain ``POST .../ack`` answered with the route's own steps; anything else, and every error, by the app
        (its body replayed: a refused ack changed nothing, a repeated one is a no-op)."""
        match = _ACK.fullmatch(scope["path"])
        try:
            raw = await _plain_json_body(scope, receive, _MAX_ACK_BODY) if match else None
        except _ClientGone:
            return
        if raw is None or match is None:
            await self.app(scope, receive, send)
            return
        state: Any = scope["app"].state
        job, rank = match.group(1), int(match.group(2))
        request = Request({**scope, "path_params": {"job": job, "rank": match.group(2)}})
        try:
            state.tokens.check_worker(request)
            body = _ACK_IN.validate_json(raw)
            result = await state.acks.ack(job, rank, body.plan_id)
        except (KnitTransError, ValidationError):
            state.fast_next["to_app"] += 1
            await self.app(scope, _replay(raw, receive), send)  # the app answers it (401, 404, 409, 410, 422)
            return
        transfer = body.transfer.model_dump() if body.transfer is not None else None
        state.observed.record_ack(job, rank, result, transfer, time.time())
        state.fast_next["served"] += 1
        await JSONResponse(result)(scope, receive, send)

    async def _maybe_stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A plan stream (``.../plans``) set up here, outside the app (so its body of acks is not counted by
        the app's body limit); anything else, or any error before the stream starts, goes to the app."""
        match = _PLANS.fullmatch(scope["path"])
        keepalive_s = keepalive_query(scope.get("query_string", b"")) if match is not None else None
        state: Any = scope["app"].state
        if match is None or keepalive_s is None or not state.settings.plan_stream:
            await self.app(scope, receive, send)
            return
        job, rank = match.group(1), int(match.group(2))
        request = Request({**scope, "path_params": {"job": job, "rank": match.group(2)}})
        try:
            state.tokens.check_worker(request)
            await first_answer(state, job, rank)
        except KnitTransError:
            await self.app(scope, receive, send)  # the app answers it (401, 404) the documented way
            return
        await PlanStream(state, job, rank, keepalive_s, acks=scope["method"] == "POST")(scope, receive, send)

    async def _serve(self, scope: Scope, match: re.Match[str], timeout_s: float, ack: str | None) -> Response | None:
        state: Any = scope["app"].state
        counts: dict[str, int] = state.fast_next
        job, rank = match.group(1), match.group(2)
        request = Request({**scope, "path_params": {"job": job, "rank": rank}})
        try:
            state.tokens.check_worker(request)
            response = await serve_next(state, job, int(rank), timeout_s, ack)
        except KnitTransError:
            counts["to_app"] += 1
            return None  # the app answers it (401, 404, 409, 410, 503) the documented way
        except Exception:
            logger.exception("fast path of %s failed; the app answers it", scope["path"])
            counts["to_app"] += 1
            return None
        counts["served"] += 1
        return response


class _ClientGone(Exception):
    """The client went away before sending its whole body: nothing to answer."""


async def _plain_json_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes | None:
    """The body of a request with no query, a JSON content type and a declared length of at most
    ``max_bytes``; None (nothing read) for any other request. Raises :class:`_ClientGone`."""
    headers = dict(scope.get("headers", ()))
    length = headers.get(b"content-length", b"")
    if (
        scope.get("query_string")
        or headers.get(b"content-type", b"").split(b";")[0].strip() != b"application/json"
        or not length.isdigit()
        or int(length) > max_bytes
    ):
        return None
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that first gives back the request body already read."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Any:
        if pending:
            return pending.pop()
        return await receive()

    return replay
