"""The control plane's registration lane: a writer's unit registration as one action on plain TCP.

Why: every put ends with one registration, and it waits for it. On this project's 2-core VMs the
kept-alive HTTP request to a control plane that idled for 10 ms took 3.45 ms p50 for the text
mini-batch's 8 units, the same registration as a lane action 2.76 ms, with 13 % less control-plane
CPU (``benchmarks/transfer/results/register_lane.md``): uvicorn's parsing, the ASGI layers and the
event loop's hand-over to the state thread and back are a large share of a registration's time. A
lane connection's thread is woken straight by its socket and hands the registration to the state
thread (:meth:`StateRunner.call`).

Wire: the store data lane's action frame (:mod:`knittrans.flight.lane`): type ``register_units``,
body ``<job> NUL <the UnitsIn JSON of POST /v1/jobs/{job}/units>``, with the ``authorization``
value that request would carry. The answer is the route's JSON (``UnitsOut``), or an error frame
``<ErrorClass>: <message>`` with the route's errors and words (a body that fails validation:
``InvalidRequest`` naming the fields, as the route's 422; a token that does not cover the job:
``Unauthenticated``). The same limits as the store's lane (a body of at most
:data:`~knittrans.flight.lane.MAX_ACTION_BYTES`; larger registrations go over HTTP), the same
time limits and connection cap; a malformed frame gets an error frame and the connection is
closed; the service's state is only touched on its state thread, so everything else is served
as before while a lane registration runs.

Found with ``GET /v1/lane`` (its port; 404 when the control plane runs without one: ``--no-lane``,
or TLS, as the lane is plain TCP). :class:`~knittrans.controlclient.ControlClient` uses it for
``register_units`` and keeps to HTTP when it cannot (no lane, an unreachable port, a busy
connection, a body over the limit); a registration repeated over HTTP after a lost answer is a
no-op, as every repeat is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from fastapi.exceptions import RequestValidationError

from knittrans.api.auth import request_for
from knittrans.api.httperrors import validation_detail
from knittrans.api.routes.units import register_body
from knittrans.controllane import REGISTER
from knittrans.errors import InvalidRequest
from knittrans.flight.lane import LaneServer
from knittrans.names import check_name

__all__ = ["RegistrationLane"]


def _no_reads(ticket: bytes) -> pa.Table:
    raise InvalidRequest("the control plane's lane serves unit registrations only, not reads")


class RegistrationLane:
    """The lane of one running app (started and closed by its lifespan): a :class:`LaneServer` whose
    actions are registrations, checked with the app's tokens and run on its state thread."""

    def __init__(self, state: Any, host: str, port: int) -> None:
        # the handler holds the app's state, not this object: a bound method would make the lane a cycle
        self._server = LaneServer(host, port, read=_no_reads, auth=None, act=functools.partial(_act, state))
        self.port = self._server.port

    @property
    def served(self) -> int:
        """Registrations answered over the lane (``GET /v1/lane``; tests check that the lane served)."""
        return self._server.actions_served

    def close(self) -> None:
        """Stop accepting and drop every connection (registrations in progress finish on the state thread)."""
        self._server.close()


def _act(state: Any, kind: str, authorization: bytes, body: bytes, abandoned: Callable[[], bool]) -> bytes:
    """One lane action of the app whose state is ``state``: a registration, checked and answered as its route."""
    if kind != REGISTER:
        raise InvalidRequest(f"the control plane's lane serves {REGISTER!r} actions only, not {kind!r}")
    name, sep, raw = body.partition(b"\0")
    if not sep:
        raise InvalidRequest(f"{REGISTER} over the lane: no NUL byte between the job's name and the body")
    job = check_name(name.decode("utf-8", errors="replace"), "job")
    state.tokens.check_worker(request_for("POST", f"/v1/jobs/{job}/units", authorization, {"job": job}))
    try:
        result = state.runner.call(register_body, state.service, job, raw)
    except RequestValidationError as exc:
        raise InvalidRequest(validation_detail(exc)) from None
    return json.dumps(result).encode()
