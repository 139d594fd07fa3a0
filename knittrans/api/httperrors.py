"""Map :mod:`knittrans.errors` and request-validation failures to JSON ``{"error", "detail"}`` responses."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knittrans.errors import (
    Conflict,
    DataLost,
    InvalidJobSpec,
    InvalidRequest,
    KnitTransError,
    NotFound,
    OverBudget,
    PayloadTooLarge,
    Unauthenticated,
    Unavailable,
)

__all__ = ["error_kind", "install_error_handlers", "status_of"]

logger = logging.getLogger(__name__)

_STATUS: tuple[tuple[type[KnitTransError], int], ...] = (
    (InvalidJobSpec, 422),
    (InvalidRequest, 400),
    (NotFound, 404),
    (Conflict, 409),
    (PayloadTooLarge, 413),
    (OverBudget, 507),
    (Unauthenticated, 401),
    (DataLost, 410),
    (Unavailable, 503),
)


def status_of(exc: KnitTransError) -> int:
    """HTTP status of a KnitTrans error (500 for anything unmapped)."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def error_kind(exc: BaseException) -> str:
    """``InvalidJobSpec`` -> ``invalid_job_spec``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()


def _json(status: int, kind: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    async def knittrans_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KnitTransError)
        status = status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return _json(status, error_kind(exc), str(exc), headers)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        parts = []
        for err in exc.errors()[:10]:
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return _json(422, "invalid_request", "; ".join(parts) or "invalid request")

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _json(exc.status_code, kind, str(exc.detail))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _json(500, "internal", f"{type(exc).__name__}: {exc}")

    app.add_exception_handler(KnitTransError, knittrans_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
