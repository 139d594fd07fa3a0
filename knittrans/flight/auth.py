"""Bearer-token middleware for the store server (constant-time comparison)."""

from __future__ import annotations

import hmac
from typing import Any

import pyarrow.flight as flight

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

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        """Check the header before the call runs; raise FlightUnauthenticatedError otherwise."""
        values = headers.get("authorization", [])
        for value in values:
            raw = value if isinstance(value, bytes) else str(value).encode()
            if hmac.compare_digest(raw, self._expected):
                return None
        why = "missing" if not values else "wrong"
        raise flight.FlightUnauthenticatedError(f"Unauthenticated: {why} bearer token")
