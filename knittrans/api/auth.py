"""Optional bearer-token auth: worker and admin tokens, and scoped tokens (docs/reference/rest.md#auth)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, Request

from knittrans.api.settings import Settings
from knittrans.errors import InvalidRequest, Unauthenticated

__all__ = ["AdminAuth", "Scope", "TokenCheck", "WorkerAuth", "mint_token", "needs_token"]

_PREFIX = "kts"


@dataclass(frozen=True, kw_only=True)
class Scope:
    """What a scoped token may do."""

    role: Literal["worker", "rank", "store"]
    job: str | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.role != "store" and self.job is None:
            raise InvalidRequest(f"a {self.role} token needs a job")
        if self.rank is not None and (self.role != "rank" or self.rank < 0):
            raise InvalidRequest("a rank (>= 0) is given only for rank tokens")

    def allows(self, path: str, params: dict[str, Any], method: str = "GET") -> bool:
        """Whether a ``method`` request to ``path`` (with path parameters ``params``) is within this scope.

        Every role may list the store nodes (``GET /v1/nodes``: ids and endpoints, which manifests name
        anyway); ranks use it to open their Flight connections before the first manifest.
        """
        if self.role == "store":
            return path.startswith("/v1/nodes")
        if path == "/v1/nodes" and method == "GET":
            return True
        if params.get("job") != self.job or not path.startswith("/v1/jobs/"):
            return False
        trainer = "/minibatches" in path or path.endswith("/versions")
        if self.role == "worker":
            return not trainer
        return trainer or path.endswith(("/version", f"/jobs/{self.job}", "/status"))


def _mac(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def mint_token(secret: bytes, scope: Scope) -> str:
    """A bearer token limited to ``scope``, verifiable with ``secret``."""
    body = json.dumps({"r": scope.role, "j": scope.job, "k": scope.rank}, separators=(",", ":")).encode()
    payload = base64.urlsafe_b64encode(body).decode().rstrip("=")
    return f"{_PREFIX}.{payload}.{_mac(secret, payload.encode())}"


def _parse(secret: bytes, token: bytes) -> Scope | None:
    parts = token.decode(errors="replace").split(".")
    if len(parts) != 3 or parts[0] != _PREFIX:
        return None
    if not hmac.compare_digest(parts[2], _mac(secret, parts[1].encode())):
        return None
    try:
        body = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return Scope(role=body["r"], job=body["j"], rank=body["k"])
    except (ValueError, KeyError, TypeError, InvalidRequest):
        return None


class TokenCheck:
    """Constant-time comparison of the request's bearer token with the configured tokens."""

    def __init__(self, settings: Settings) -> None:
        self.worker = settings.worker_token.get_secret_value().encode() if settings.worker_token else None
        self.admin = settings.admin_token.get_secret_value().encode() if settings.admin_token else None
        """The admin token, also the key of scoped tokens (none without one)."""

    def identify(self, header: bytes | None) -> Literal["admin", "worker"] | Scope | None:
        """Whose token the ``Authorization`` header value ``header`` carries: the admin's or the worker's, the
        :class:`Scope` of a scoped token this server signed, or None (no header, or a token of no one here).

        Raises:
            Unauthenticated: a header that is not ``Bearer <token>``.
        """
        if not header:
            return None
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            raise Unauthenticated("Authorization header must be 'Bearer <token>'")
        # no short-circuit between the two: both compares always run
        admin = self.admin is not None and hmac.compare_digest(token, self.admin)
        worker = self.worker is not None and hmac.compare_digest(token, self.worker)
        if admin or worker:
            return "admin" if admin else "worker"
        return None if self.admin is None else _parse(self.admin, token)

    def _who(self, request: Request) -> Literal["admin", "worker"] | Scope | None:
        """:meth:`identify` of the request's ``Authorization`` header."""
        header = request.headers.get("authorization")
        return self.identify(header.encode() if header else None)

    def authenticates(self, header: bytes | None) -> bool:
        """Whether the ``Authorization`` header value ``header`` carries a token of this server (the worker or
        admin token, or a scoped token it signed), whatever that token may do; a server without a worker
        token takes every request (its worker endpoints are open; routes still check the admin token).

        Raises:
            Unauthenticated: a header that is not ``Bearer <token>``.
        """
        return self.worker is None or self.identify(header) is not None

    def check_worker(self, request: Request) -> None:
        """Worker endpoints: open without a worker token; else the worker or the admin token, or a
        scoped token whose scope covers the request (its scope is left in ``request.state.scope``)."""
        request.state.scope = None
        if self.worker is None:
            return
        who = self._who(request)
        if who is None:
            raise Unauthenticated("this endpoint needs the worker (or admin) bearer token")
        if not isinstance(who, Scope):
            return
        if not who.allows(request.url.path, dict(request.path_params), request.method):
            raise Unauthenticated(
                f"this token is scoped to {who.role} of job {who.job!r}"
                f"{'' if who.rank is None else f' rank {who.rank}'}; "
                f"it does not cover {request.method} {request.url.path}"
            )
        request.state.scope = who

    def is_admin(self, request: Request) -> bool:
        """Whether the request carries the admin token (always False when none is configured)."""
        try:
            return self._who(request) == "admin"
        except Unauthenticated:
            return False

    def check_admin(self, request: Request) -> None:
        """Admin endpoints: the admin token; without one configured, the worker rule applies."""
        if self.admin is None:
            self.check_worker(request)
        elif self._who(request) != "admin":
            raise Unauthenticated("this endpoint needs the admin bearer token")


def needs_token(route: Any) -> bool:
    """Whether a FastAPI route (an ``APIRoute``) checks a token: it depends on :data:`WorkerAuth` or
    :data:`AdminAuth`, directly or through another dependency."""
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        if dependant.call in (_worker, _admin):
            return True
        pending.extend(dependant.dependencies)
    return False


async def _worker(request: Request) -> None:  # async: a plain def would hop to a worker thread
    request.app.state.tokens.check_worker(request)


async def _admin(request: Request) -> None:
    request.app.state.tokens.check_admin(request)


WorkerAuth = Annotated[None, Depends(_worker)]
"""Dependency: the request carries a worker or admin token (when tokens are configured)."""
AdminAuth = Annotated[None, Depends(_admin)]
"""Dependency: the request carries the admin token (when configured)."""
