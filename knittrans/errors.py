"""The KnitTrans exception tree and each error's HTTP status (over Flight: a FlightServerError naming the class).

::

    KnitTransError
    ├── InvalidRequest (ValueError)      bad input from a client; 409
    │   ├── InvalidName                  unit id, job or node name that is not a safe identifier
    │   ├── InvalidTicket                a Flight ticket that does not decode strictly
    │   ├── SchemaMismatch               a batch or unit whose schema is not ours / wrong version
    │   └── InvalidJobSpec               a job spec that cannot be run
    ├── NotFound (LookupError)           unknown unit, job, node, media hash; 404
    ├── Conflict                         a state change that contradicts the current state; 409
    │   └── DedupStateError (RuntimeError)  a DedupEncoder method called out of order
    ├── PayloadTooLarge                  an upload above the configured limit; 413
    ├── OverBudget                       the store's byte budget stayed full past the writer's timeout; 507
    ├── Unauthenticated                  missing or wrong bearer token; 401 / FlightUnauthenticatedError
    ├── DataLost                         rows that were planned live on a node declared lost; 410
    └── Unavailable                      store node or control plane unreachable; 503 / FlightUnavailableError

    StateError (RuntimeError)            the control plane's state database cannot be used as it is (at start)
"""

from __future__ import annotations

import re

__all__ = [
    "HTTP_STATUS",
    "Conflict",
    "DataLost",
    "DedupStateError",
    "InvalidJobSpec",
    "InvalidName",
    "InvalidRequest",
    "InvalidTicket",
    "KnitTransError",
    "NotFound",
    "OverBudget",
    "PayloadTooLarge",
    "SchemaMismatch",
    "StateError",
    "Unauthenticated",
    "Unavailable",
    "error_kind",
    "error_of",
    "http_status",
]


class KnitTransError(Exception):
    """Base class of every error KnitTrans raises on purpose."""


class InvalidRequest(KnitTransError, ValueError):
    """A client sent something malformed; the message names what was wrong."""


class InvalidName(InvalidRequest):
    """A unit id, job or node name is not a safe identifier (e.g. path traversal)."""


class InvalidTicket(InvalidRequest):
    """A Flight ticket did not decode strictly."""


class SchemaMismatch(InvalidRequest):
    """A record batch or unit does not have the expected schema or schema version."""


class InvalidJobSpec(InvalidRequest):
    """A job spec cannot be run; the message says which field and why."""


class NotFound(KnitTransError, LookupError):
    """An unknown unit, job, node or media hash."""


class Conflict(KnitTransError):
    """A state change that contradicts the current state (e.g. resuming a drained job)."""


class DedupStateError(Conflict, RuntimeError):
    """A :class:`~knittrans.trainer.dedup.DedupEncoder` method was called out of order (e.g. ``features()``
    before a mini-batch began)."""


class PayloadTooLarge(KnitTransError):
    """An upload larger than the configured limit."""


class OverBudget(KnitTransError):
    """The store's byte budget stayed exhausted past the writer's timeout."""


class Unauthenticated(KnitTransError):
    """A missing or wrong bearer token."""


class DataLost(KnitTransError):
    """Rows that were planned live on a store node that was declared lost."""


class Unavailable(KnitTransError):
    """A peer (store node, control plane) cannot be reached right now."""


# 422 is kept for requests that break the published schema (pydantic refuses them before the service
# runs). A request that matches the schema but that the service refuses -- its fields contradict each
# other (K > G), or it contradicts the job's state or stored data (supply for a source without a
# quota) -- is a 409: the schema cannot state these rules, and a schema-valid request is never a 4xx
# that says "your request is malformed". The error kind (``invalid_job_spec``, ``invalid_request``)
# still names what was wrong.
HTTP_STATUS: tuple[tuple[type[KnitTransError], int], ...] = (
    (InvalidRequest, 409),  # and its subclasses (InvalidJobSpec, SchemaMismatch, ...)
    (NotFound, 404),
    (Conflict, 409),
    (PayloadTooLarge, 413),
    (OverBudget, 507),
    (Unauthenticated, 401),
    (DataLost, 410),
    (Unavailable, 503),
)
"""HTTP status of each error (first ``isinstance`` match): the control plane answers with it
(:mod:`knittrans.api.httperrors`) and :class:`~knittrans.controlclient.ControlClient` reads it back."""


def http_status(exc: KnitTransError) -> int:
    """HTTP status of a KnitTrans error (500 for anything unmapped)."""
    for kind, status in HTTP_STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def error_kind(cls: type[BaseException]) -> str:
    """The ``error`` kind the control plane answers an error of class ``cls`` with: its name in snake case
    (``InvalidJobSpec`` -> ``invalid_job_spec``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


_KINDS: dict[str, type[KnitTransError]] = {
    error_kind(cls): cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, KnitTransError)
}
"""Each error class by the ``error`` kind of the control plane's answers: its name in snake case."""


def error_of(kind: str, status: int) -> type[KnitTransError]:
    """The error a client raises for an HTTP error answer: the class its ``error`` kind names
    (``invalid_job_spec`` -> :class:`InvalidJobSpec`); for a kind no class has, the class of its status
    (400 and 422: :class:`InvalidRequest`; :class:`KnitTransError` when none maps to it)."""
    if kind in _KINDS:
        return _KINDS[kind]
    if status in (400, 422):
        return InvalidRequest
    return next((cls for cls, code in HTTP_STATUS if code == status and cls is not InvalidRequest), KnitTransError)


class StateError(RuntimeError):
    """The control plane's state database cannot be used as it is (empty, foreign, other format, unreadable).

    Raised when the control plane starts, before it serves anything: not a request error, so not a
    :class:`KnitTransError`."""
