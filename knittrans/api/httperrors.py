"""Map :mod:`knittrans.errors` and request-validation failures to JSON ``{"error", "detail"}`` responses."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knittrans.errors import KnitTransError, error_kind, http_status

__all__ = ["install_error_handlers", "validation_detail"]

logger = logging.getLogger(__name__)


def _json(status: int, kind: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=status, headers=headers)


def _allowed(spec: dict[str, Any], path: str) -> set[str]:
    """Methods the OpenAPI spec documents for ``path`` (templates like ``{job}`` match one segment)."""
    methods: set[str] = set()
    for template, ops in spec.get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            methods |= {m.upper() for m in ops}
    return methods


def validation_detail(exc: RequestValidationError) -> str:
    """What a 422 answer says of a body that failed validation: ``loc: msg`` of its first 10 errors."""
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    async def knittrans_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KnitTransError)
        status = http_status(exc)
        headers = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": "1"}}.get(status)
        return _json(status, error_kind(type(exc)), str(exc), headers)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        # a job spec (create, quota update) that breaks the schema is an invalid job spec, like one
        # that breaks a rule across its fields (409): clients map both to InvalidJobSpec
        spec = request.method in ("POST", "PUT") and re.fullmatch(r"/v1/jobs(/[^/]+/quotas)?", request.url.path)
        return _json(422, "invalid_job_spec" if spec else "invalid_request", validation_detail(exc))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:  # Allow: every method of every route on this path, not just the first
            methods = _allowed(request.app.openapi(), request.url.path)
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return _json(exc.status_code, kind, str(exc.detail), headers or None)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _json(500, "internal", f"{type(exc).__name__}: {exc}")

    app.add_exception_handler(KnitTransError, knittrans_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
