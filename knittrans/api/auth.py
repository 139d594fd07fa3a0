"""Optional bearer-token auth: a worker token (writers, ranks, stores) and an admin token."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from knittrans.api.settings import Settings
from knittrans.errors import Unauthenticated

__all__ = ["AdminAuth", "TokenCheck", "WorkerAuth"]


class TokenCheck:
    """Constant-time comparison of the request's bearer token with the configured tokens."""

    def __init__(self, settings: Settings) -> None:
        self.worker = settings.worker_token.get_secret_value().encode() if settings.worker_token else None
        self.admin = settings.admin_token.get_secret_value().encode() if settings.admin_token else None

    @staticmethod
    def _presented(request: Request) -> bytes | None:
        header = request.headers.get("authorization")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("Authorization header must be 'Bearer <token>'")
        return token.strip().encode()

    @staticmethod
    def _matches(token: bytes | None, *expected: bytes | None) -> bool:
        ok = False
        for want in expected:
            if want is not None and token is not None:
                ok |= hmac.compare_digest(token, want)  # no short-circuit: both compares always run
        return ok

    def check_worker(self, request: Request) -> None:
        """Worker endpoints: open without a worker token; else the worker or the admin token."""
        if self.worker is None:
            return
        if not self._matches(self._presented(request), self.worker, self.admin):
            raise Unauthenticated("this endpoint needs the worker (or admin) bearer token")

    def check_admin(self, request: Request) -> None:
        """Admin endpoints: the admin token; without one configured, the worker rule applies."""
        if self.admin is None:
            self.check_worker(request)
            return
        if not self._matches(self._presented(request), self.admin):
            raise Unauthenticated("this endpoint needs the admin bearer token")


def _worker(request: Request) -> None:
    request.app.state.tokens.check_worker(request)


def _admin(request: Request) -> None:
    request.app.state.tokens.check_admin(request)


WorkerAuth = Annotated[None, Depends(_worker)]
"""Dependency: the request carries a worker or admin token (when tokens are configured)."""
AdminAuth = Annotated[None, Depends(_admin)]
"""Dependency: the request carries the admin token (when configured)."""
