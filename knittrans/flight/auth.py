"""Bearer-token middleware for the store server (constant-time comparison)."""

from __future__ import annotations

import hmac
from typing import Any

import pyarrow.flight as flight

from knittrans.errors import Unauthenticated
from knittrans.flight.errors import to_flight_error

__all__ = ["BearerTokenFactory", "auth_headers"]


def auth_headers(token: str | None) -> list[tuple[bytes, bytes]]:
    """Call headers carrying ``authorization: Bearer <token>`` (none without a token)."""
    return [] if token is None else [(b"authorization", b"Bearer " + token.encode())]


class BearerTokenFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuse every call whose ``authorization`` header is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        super().__init__()
        if not token:
            raise ValueError("token must be a non-empty string")
        self._expected = b"Bearer " + token.encode()

    def check(self, values: list[Any]) -> None:
        """Raise :class:`Unauthenticated` unless one of the ``authorization`` values is ``Bearer <token>``
        (the store's data lane checks its requests with this too)."""
        for value in values:
            raw = value if isinstance(value, bytes) else str(value).encode()
            if hmac.compare_digest(raw, self._expected):
                return None
        why = "missing" if not values else "wrong"
        raise Unauthenticated(f"{why} bearer token")

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        """Check the header before the call runs; raise FlightUnauthenticatedError otherwise."""
        try:
            self.check(headers.get("authorization", []))
        except Unauthenticated as exc:
            raise to_flight_error(exc) from None
