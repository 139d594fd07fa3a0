"""Map KnitTrans errors to typed Flight errors (server side) and back (client side)."""

from __future__ import annotations

import errno
import logging
import os
import re

import pyarrow as pa
import pyarrow.flight as flight

from knittrans import errors

__all__ = ["error_message", "from_error_message", "from_flight_error", "refusal", "to_flight_error"]

logger = logging.getLogger(__name__)

_PREFIX = re.compile(r"^([A-Z][A-Za-z]+): (.*?)(?:\. Detail:.*)?$", re.S)
_TYPES: dict[str, type[errors.KnitTransError]] = {
    cls.__name__: cls
    for cls in map(vars(errors).get, errors.__all__)
    if isinstance(cls, type) and issubclass(cls, errors.KnitTransError) and cls is not errors.KnitTransError
}


def error_message(exc: errors.KnitTransError) -> str:
    """``<ErrorClass>: <message>``: how a store names an error to its clients (Flight and the data lane)."""
    return f"{type(exc).__name__}: {exc}"


def from_error_message(text: str) -> errors.KnitTransError | None:
    """The KnitTrans error an :func:`error_message` names (None when it names none)."""
    match = _PREFIX.match(text)
    if match and match.group(1) in _TYPES:
        return _TYPES[match.group(1)](match.group(2))
    return None


def refusal(what: str, exc: Exception) -> errors.KnitTransError | None:
    """The KnitTrans error a store call (``what``) that raised ``exc`` answers with, logged (a full disk as a
    warning); None: an unexpected failure, logged with its traceback (call this in the ``except`` block).

    Shared by the Flight calls of the store server and its data lane, so both answer and log alike.
    """
    known = exc if isinstance(exc, errors.KnitTransError) else None
    if isinstance(exc, pa.ArrowInvalid | pa.ArrowTypeError | pa.ArrowNotImplementedError):
        # malformed client input the IPC reader found (e.g. a dictionary changed within a DoPut)
        known = errors.InvalidRequest(f"{what}: invalid Arrow data: {exc}")
    elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        known = errors.OverBudget(
            f"{what}: the store directory cannot take the write ({os.strerror(exc.errno)}); "
            "retry later or on another node"
        )
    if known is None:
        logger.exception("%s failed", what)
    else:
        log = logger.warning if isinstance(known, errors.OverBudget) and known is not exc else logger.info
        log("%s refused: %s: %s", what, type(known).__name__, known)
    return known


def to_flight_error(exc: errors.KnitTransError) -> flight.FlightError:
    """Typed Flight error whose message names the KnitTrans error class and the problem."""
    message = error_message(exc)
    if isinstance(exc, errors.Unauthenticated):
        return flight.FlightUnauthenticatedError(message)
    if isinstance(exc, errors.Unavailable):
        return flight.FlightUnavailableError(message)
    return flight.FlightServerError(message)


def from_flight_error(exc: BaseException, endpoint: str) -> errors.KnitTransError:
    """Rebuild the KnitTrans error a store server raised; transport failures become Unavailable."""
    text = str(exc)
    known = from_error_message(text)
    if known is not None:
        return known
    if isinstance(exc, flight.FlightUnauthenticatedError):
        return errors.Unauthenticated(f"store {endpoint} refused the call: {text.splitlines()[0]}")
    if isinstance(exc, flight.FlightUnavailableError | flight.FlightTimedOutError | pa.ArrowIOError):
        return errors.Unavailable(f"store {endpoint} cannot be reached: {text.splitlines()[0]}")
    return errors.KnitTransError(f"store {endpoint} failed: {text.splitlines()[0]}")
