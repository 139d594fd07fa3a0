"""Map KnitTrans errors to typed Flight errors (server side) and back (client side).

The Flight message always starts with ``<ErrorClass>: <message>`` so a client can rebuild the
same :mod:`knittrans.errors` type; the gRPC status follows the error kind (unauthenticated,
unavailable, everything else a server error).
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.flight as flight

from knittrans import errors

__all__ = ["from_flight_error", "to_flight_error"]

_PREFIX = re.compile(r"^([A-Z][A-Za-z]+): (.*?)(?:\. Detail:.*)?$", re.S)
_TYPES: dict[str, type[errors.KnitTransError]] = {
    name: getattr(errors, name) for name in errors.__all__ if name != "KnitTransError"
}


def to_flight_error(exc: errors.KnitTransError) -> flight.FlightError:
    """Typed Flight error whose message names the KnitTrans error class and the problem."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, errors.Unauthenticated):
        return flight.FlightUnauthenticatedError(message)
    if isinstance(exc, errors.Unavailable):
        return flight.FlightUnavailableError(message)
    return flight.FlightServerError(message)


def from_flight_error(exc: BaseException, endpoint: str) -> errors.KnitTransError:
    """Rebuild the KnitTrans error a store server raised; transport failures become Unavailable."""
    text = str(exc)
    match = _PREFIX.match(text)
    if match and match.group(1) in _TYPES:
        return _TYPES[match.group(1)](match.group(2))
    if isinstance(exc, flight.FlightUnauthenticatedError):
        return errors.Unauthenticated(f"store {endpoint} refused the call: {text.splitlines()[0]}")
    if isinstance(exc, flight.FlightUnavailableError | flight.FlightTimedOutError | pa.ArrowIOError):
        return errors.Unavailable(f"store {endpoint} cannot be reached: {text.splitlines()[0]}")
    return errors.KnitTransError(f"store {endpoint} failed: {text.splitlines()[0]}")
