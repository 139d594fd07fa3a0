"""``ControlClient``: a small synchronous client of the control-plane REST API, with retries.

Used by rollout writers (units, supply, version), store nodes (register, heartbeat), trainer ranks
(next plan, ack, version) and the demo. Every call is safe to retry (the server makes repeats no-ops),
so connection errors and 503 answers are retried with exponential backoff before :class:`Unavailable`
is raised. Error answers are raised as the matching :mod:`knittrans.errors` exception.

``register_units`` (a writer's one request per write) goes over the control plane's registration
lane when it has one (:mod:`knittrans.controllane`), else over a kept-alive ``http.client``
connection of its own when the control plane is plain http: about 1 ms less client CPU per request
than httpx. Anything those cannot answer (https, a call while another thread holds them, a
dropped connection, a 503) is sent again through httpx with its retries; a repeated registration is a
no-op.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json as jsonlib
import logging
import os
import re
import ssl
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import pydantic_core

from knittrans.controllane import LaneRegistrar
from knittrans.descriptors import UnitDescriptor
from knittrans.errors import (
    InvalidJobSpec,
    InvalidRequest,
    KnitTransError,
    NotFound,
    Unavailable,
    error_of_status,
)
from knittrans.plans import PlanId, RankPlan
from knittrans.retry import DEFAULT_RETRY, RetryPolicy

__all__ = ["ControlClient", "JobFinished", "PlanStreamReader", "StreamUnsupported"]

logger = logging.getLogger(__name__)

_WARN_AFTER_ATTEMPTS = 5
"""A call failing this many times in a row is logged as a warning (earlier retries at debug level)."""

_DONE_HEADER = "x-knittrans-done"
_UNREGISTERED_NODE = re.compile(r"node '([^']+)' is not registered")


class JobFinished(KnitTransError):
    """No further plan will come for this rank: the job was drained or reached ``total_steps``."""


class StreamUnsupported(KnitTransError):
    """The control plane has no plan stream (``.../plans``: a server from before it); use ``next``."""


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        kind, detail = str(body.get("error", "")), str(body.get("detail", response.text))
    except ValueError:
        kind, detail = "", response.text
    status = response.status_code
    if kind == "invalid_job_spec":  # 422 (schema) or 409 (a rule across fields or against the state)
        raise InvalidJobSpec(detail)
    if status in (400, 422) or kind in ("invalid_request", "invalid_name"):
        raise InvalidRequest(detail)
    error = error_of_status(status)
    raise error(f"{detail}" if error is not KnitTransError else f"HTTP {status}: {detail}")


_JSON_CONTENT = {"Content-Type": "application/json"}


def _units_json(units: Sequence[UnitDescriptor | Mapping[str, Any]]) -> bytes:
    """A registration's body (``{"units": [...]}``) as compact JSON: descriptors (checked when made: every
    number finite) encoded by pydantic-core (about 0.1 ms for 8 units of 8 groups, against 0.3 for
    ``to_dict`` and ``json.dumps``); anything else by ``json.dumps``, which refuses NaN and infinities
    (``ValueError``) instead of writing them."""
    if all(isinstance(u, UnitDescriptor) for u in units):
        return pydantic_core.to_json({"units": units})
    body = {"units": [u.to_dict() if isinstance(u, UnitDescriptor) else dict(u) for u in units]}
    return jsonlib.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class ControlClient:
    """Synchronous client of one control plane.

    Args:
        base_url: e.g. ``http://127.0.0.1:8700``.
        token: bearer token (worker or admin), or None.
        timeout_s: timeout of ordinary requests (long-polls add their own wait).
        retry: the shared :class:`~knittrans.retry.RetryPolicy` for connection errors and 503
            answers (default: 120 s budget, exponential backoff with jitter).
        retries: optional cap on attempts after the first (tests and probes that must fail fast).
        tls_ca: PEM file of the CA that signed an ``https://`` control plane's certificate (default
            ``$KNITTRANS_TLS_CA``; without either, the system roots verify it).
        lane: send ``register_units`` over the control plane's registration lane when it has one
            (:mod:`knittrans.controllane`); False: over HTTP only.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        retries: int | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        lane: bool = True,
    ) -> None:
        if (retries is not None and retries < 0) or not timeout_s > 0:
            raise ValueError("retries must be >= 0 (or None) and timeout_s > 0")
        self.retry = retry
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        ca = tls_ca if tls_ca is not None else os.environ.get("KNITTRANS_TLS_CA")
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca else True
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, verify=verify)
        # Long-polls use a pool of their own, each poll on a new connection: a poll waiting in another
        # thread (the early poll, the successor poll) never holds the connection ordinary requests use, and
        # the connect happens while the poll waits anyway. Measured after the server's TCP_NODELAY fix
        # (benchmarks/trainer/cold_path.py, quiet machine): admission -> first micro-batch 5.4 ms cold / 7.0 ms
        # warm p50 this way, 7.0 / 7.9-9.0 ms with kept-alive poll connections.
        # ``Connection: close``: a poll's connection closes itself after its response. Without it, a poll
        # still connecting when ``close()`` ran got its socket after the pool had closed its connections,
        # and that socket stayed open until the garbage collector found it.
        self._closed = False
        self._poll_http = httpx.Client(
            base_url=self.base_url,
            headers={**headers, "Connection": "close"},
            timeout=timeout_s,
            verify=verify,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        # The hot POST (a writer's registration, once per write) over one kept-alive ``http.client``
        # connection: about 1 ms less client CPU per request than httpx (0.3 vs 1.4 ms, one scratch run).
        # Plain http only; https, a call while another thread holds it, and anything that goes wrong on
        # it take the httpx path above (see :meth:`_post_lean`).
        split = urlsplit(self.base_url)
        self._lean_at = (split.hostname, split.port or 80, split.path) if split.scheme == "http" else None
        self._lean_headers = {**headers, "Content-Type": "application/json"}
        self._lean_conn: http.client.HTTPConnection | None = None
        self._lean_lock = threading.Lock()
        auth = headers.get("Authorization", "").encode()
        # the finder holds the pool, not this client: a bound method here would make the client a reference
        # cycle, left to the cyclic GC when it is dropped (see test_trainer_client's cyclic-GC test)
        find = functools.partial(_find_lane, self._http, min(timeout_s, 5.0))
        self.lane = LaneRegistrar(self.base_url, auth, timeout_s=timeout_s, find=find) if lane else None
        """The registration lane's client (None: ``lane=False``)."""

    def close(self) -> None:
        """Close the connection pools (a request still in flight in another thread closes its own connection
        when it returns: see :meth:`_request`)."""
        self._closed = True
        if self.lane is not None:
            self.lane.close()
        self._http.close()
        self._poll_http.close()
        if self._lean_lock.acquire(blocking=False):  # else the call holding it closes it when done
            try:
                self._drop_lean()
            finally:
                self._lean_lock.release()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        poll: bool = False,
    ) -> httpx.Response:
        pauses = self.retry.pauses()
        attempt = 0
        http = self._poll_http if poll else self._http
        while True:
            try:
                headers = _JSON_CONTENT if content is not None else None
                response = http.request(
                    method,
                    path,
                    json=json,
                    content=content,
                    headers=headers,
                    params=params,
                    timeout=timeout_s or self.timeout_s,
                )
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if self._closed:
                    # closed while this request was in flight: a connection it opened after the pool closed
                    # went back to that closed pool, which no longer closes anything (its socket would stay
                    # open until the garbage collector found it)
                    _close_connection(response)
                if response.status_code != 503:
                    _raise_for(response)
                    return _unbound(response)
                problem = "503 " + response.text[:200]
            pause = self._retry_pause(pauses, attempt, f"{method} {path}", problem)
            attempt += 1
            # one warning per call once it has failed a few times (a restart in progress), debug before
            level = logging.WARNING if attempt == _WARN_AFTER_ATTEMPTS else logging.DEBUG
            logger.log(
                level,
                "control plane %s: %s %s: %s; retrying (budget %.0f s)",
                self.base_url,
                method,
                path,
                problem,
                self.retry.budget_s,
            )
            time.sleep(pause)

    def _retry_pause(self, pauses: Iterator[float], attempt: int, what: str, problem: str) -> float:
        """The pause before retrying ``what`` after failed attempt ``attempt`` (0-based), by the retry policy
        and ``retries``; :class:`Unavailable` naming ``problem`` once the budget is spent."""
        pause = next(pauses, None) if self.retries is None or attempt < self.retries else None
        if pause is None:
            raise Unavailable(f"control plane {self.base_url}: {what} failed after {attempt + 1} attempts: {problem}")
        return pause

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    def _post_lean(self, path: str, data: bytes) -> Any:
        """``POST path`` with the JSON ``data`` on the kept-alive ``http.client`` connection; its JSON answer.

        Only for requests whose repeat is a no-op: when the connection fails (a kept-alive connection the
        server closed, a restart, a timeout) or the answer is 503, the request goes again by
        :meth:`_request`, with its retries. So does a call while another thread uses the connection, or to
        an https control plane. Errors are raised as :meth:`_json` raises them.
        """
        if self._lean_at is None or self._closed or not self._lean_lock.acquire(blocking=False):
            return self._request("POST", path, content=data).json()
        status, payload = 0, b""
        try:
            host, port, prefix = self._lean_at
            try:
                if self._lean_conn is None:
                    self._lean_conn = http.client.HTTPConnection(host or "", port, timeout=self.timeout_s)
                self._lean_conn.request("POST", prefix + path, body=data, headers=self._lean_headers)
                answer = self._lean_conn.getresponse()
                payload = answer.read()
                status = answer.status
                if answer.will_close:
                    self._drop_lean()
            except (OSError, http.client.HTTPException) as exc:
                logger.debug("control plane %s: POST %s: %s; again by the pooled client", self.base_url, path, exc)
                self._drop_lean()
                status = 0
            if self._closed:  # closed while this call held the connection
                self._drop_lean()
        finally:
            self._lean_lock.release()
        if status == 0 or status == 503:
            return self._request("POST", path, content=data).json()
        if status >= 400:
            _raise_for(httpx.Response(status, content=payload))
        return jsonlib.loads(payload)

    def _drop_lean(self) -> None:
        """Close the kept-alive ``http.client`` connection (the caller holds its lock)."""
        if self._lean_conn is not None:
            self._lean_conn.close()
            self._lean_conn = None

    # ------------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        """``GET /v1/health``."""
        result: dict[str, Any] = self._json("GET", "/v1/health")
        return result

    def overview(self) -> dict[str, Any]:
        """``GET /v1/overview`` (admin): jobs, store nodes and ranks, as the dashboard shows them."""
        result: dict[str, Any] = self._json("GET", "/v1/overview")
        return result

    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text)."""
        return self._request("GET", "/metrics").text

    # ------------------------------------------------------------------ jobs (admin)
    def create_job(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/jobs``; the identical spec again is a no-op."""
        result: dict[str, Any] = self._json("POST", "/v1/jobs", json=dict(spec))
        return result

    def get_job(self, job: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job}``."""
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{job}")
        return result

    def update_quotas(self, job: str, quotas: Mapping[str, int]) -> dict[str, Any]:
        """``PUT /v1/jobs/{job}/quotas`` (effective from the next train step)."""
        result: dict[str, Any] = self._json("PUT", f"/v1/jobs/{job}/quotas", json={"quotas": dict(quotas)})
        return result

    def pause(self, job: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/pause``."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/pause")
        return result

    def resume(self, job: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/resume``."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/resume")
        return result

    def drain(self, job: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/drain``."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/drain")
        return result

    def status(self, job: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job}/status``."""
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{job}/status")
        return result

    # ------------------------------------------------------------------ nodes
    def register_node(
        self, node_id: str, endpoint: str, host: str = "", *, node_key: str | None = None
    ) -> dict[str, Any]:
        """``POST /v1/nodes``; ``node_key`` is the node's own credential (lets it move its endpoint)."""
        body: dict[str, Any] = {"node_id": node_id, "endpoint": endpoint, "host": host}
        if node_key is not None:
            body["node_key"] = node_key
        result: dict[str, Any] = self._json("POST", "/v1/nodes", json=body)
        return result

    def remove_unit(self, job: str, unit_id: str, reason: str = "removed by an admin") -> dict[str, Any]:
        """``DELETE /v1/jobs/{job}/units/{unit}`` (admin): its unadmitted groups are regenerated."""
        result: dict[str, Any] = self._json("DELETE", f"/v1/jobs/{job}/units/{unit_id}", params={"reason": reason})
        return result

    def mint_token(self, role: str, job: str | None = None, rank: int | None = None) -> str:
        """``POST /v1/tokens`` (admin): a bearer token scoped to one job's worker, one rank, or a store."""
        body = {"role": role, "job": job, "rank": rank}
        return str(self._json("POST", "/v1/tokens", json=body)["token"])

    def heartbeat(self, node_id: str, usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/nodes/{node}/heartbeat`` (Conflict when the node was declared lost).

        ``usage``: the store's ``stats`` (units, bytes, budget), shown by ``/metrics`` and ``/ui``.
        """
        body = dict(usage) if usage is not None else None
        result: dict[str, Any] = self._json("POST", f"/v1/nodes/{node_id}/heartbeat", json=body)
        return result

    def list_nodes(self) -> list[dict[str, Any]]:
        """``GET /v1/nodes``."""
        result: list[dict[str, Any]] = self._json("GET", "/v1/nodes")
        return result

    def declare_lost(self, node_id: str, reason: str = "declared lost by an admin") -> dict[str, Any]:
        """``POST /v1/nodes/{node}/lost`` (admin)."""
        result: dict[str, Any] = self._json("POST", f"/v1/nodes/{node_id}/lost", json={"reason": reason})
        return result

    # ------------------------------------------------------------------ units and supply
    def register_units(
        self, job: str, units: Sequence[UnitDescriptor | Mapping[str, Any]], *, node_wait_s: float = 10.0
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/units`` with ``{"units": [...]}``; all or none; repeats are no-ops.

        A unit's store node must be registered with the control plane (a store started with
        ``--control-url`` registers itself and heartbeats). Right after a store starts it may not be
        yet: the call then waits up to ``node_wait_s`` for it, and raises ``NotFound`` naming the
        node and what to do once that time is over (``node_wait_s=0``: at once).
        """
        if node_wait_s < 0:
            raise ValueError("node_wait_s must be >= 0")
        data = _units_json(units)
        deadline = time.monotonic() + node_wait_s
        pause = 0.05
        while True:
            try:
                result = self.lane.register(job, data) if self.lane is not None else None
                if result is None:
                    result = self._post_lean(f"/v1/jobs/{job}/units", data)
                return result
            except NotFound as exc:
                missing = _UNREGISTERED_NODE.search(str(exc))
                if missing is None:
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotFound(
                        f"store node {missing.group(1)!r} has not registered with the control plane "
                        f"{self.base_url} (waited {node_wait_s:g} s): start the store with --control-url "
                        f"{self.base_url} (it registers itself and heartbeats) before registering its units, "
                        f"or register it with POST /v1/nodes"
                    ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)

    def report_supply(
        self,
        job: str,
        *,
        started: Mapping[str, int] | None = None,
        group_ids: Mapping[str, Sequence[str]] | None = None,
        dropped: Mapping[str, int] | None = None,
        regenerates: Sequence[str] = (),
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/supply``; a fresh ``request_id`` makes retries count once.

        ``regenerates``: lost/expired group ids (from status ``to_regenerate``) whose replacements start now.
        """
        body = {
            "started": dict(started or {}),
            "group_ids": {s: list(v) for s, v in (group_ids or {}).items()},
            "dropped": dict(dropped or {}),
            "regenerates": list(regenerates),
            "request_id": request_id or uuid.uuid4().hex,
        }
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/supply", json=body)
        return result

    # ------------------------------------------------------------------ ranks
    def next_plan(
        self, job: str, rank: int, timeout_s: float = 30.0, *, after: str | None = None, ack: str | None = None
    ) -> RankPlan | None:
        """``GET /v1/jobs/{job}/ranks/{rank}/next``: the plan, or None when none came within ``timeout_s``.

        ``after``: the rank's current, un-acked plan id; returns the plan of the mini-batch after it
        (for prefetching across the ack), Conflict when ``after`` is not the current plan, DataLost
        when it was withdrawn.

        ``ack``: the rank's current plan id, acked first in the same request (one request per
        mini-batch instead of :meth:`ack` and ``next``; no transfer figures; safe to retry, the ack
        is idempotent); NotFound, Conflict or DataLost as for :meth:`ack` when it is refused, and
        then nothing was acked. Not together with ``after``.

        Raises:
            JobFinished: the job will plan nothing more for this rank (after ``after``).
            InvalidRequest: the answer is not a well-formed plan.
        """
        params: dict[str, Any] = {"timeout_s": timeout_s}
        if after is not None:
            params["after"] = after
        if ack is not None:
            params["ack"] = ack
        response = self._request(
            "GET", f"/v1/jobs/{job}/ranks/{rank}/next", params=params, timeout_s=timeout_s + self.timeout_s, poll=True
        )
        if response.status_code == 204:
            if response.headers.get(_DONE_HEADER) == "1":
                raise JobFinished(f"job {job!r} has no further mini-batch for rank {rank}")
            return None
        return RankPlan.from_json(response.json())

    def plan_stream(self, job: str, rank: int, *, keepalive_s: float = 10.0, gateway: bool = False) -> PlanStreamReader:
        """The rank's plan stream (``GET .../plans``), opened on first read; see :class:`PlanStreamReader`.
        ``gateway``: from the server's plan gateway when it runs one (``GET /v1/plan-gateway``), else its own."""
        return PlanStreamReader(self, job, rank, keepalive_s=keepalive_s, gateway=gateway)

    def plan_gateway(self) -> str | None:
        """``GET /v1/plan-gateway``: the base URL of the server's plan gateway; None when it runs none, or
        its gateway exited (404, 503: use the server's own plan stream)."""
        response = _unbound(self._http.get("/v1/plan-gateway"))
        if response.status_code in (404, 503, 405):
            return None
        _raise_for(response)
        url: str = response.json()["url"]
        return url

    def iter_plans(self, job: str, rank: int, timeout_s: float = 30.0) -> Iterator[RankPlan]:
        """Yield the rank's plans until the job is finished; ack each before asking for the next."""
        while True:
            try:
                plan = self.next_plan(job, rank, timeout_s)
            except JobFinished:
                return
            if plan is not None:
                yield plan

    def fetched(self, job: str, rank: int, plan_id: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/ranks/{rank}/fetched``: this rank holds its whole share (before its step).

        Raises:
            DataLost: the plan was withdrawn (a store node holding its rows was lost).
        """
        body = {"plan_id": plan_id}
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/ranks/{rank}/fetched", json=body)
        return result

    def ack(self, job: str, rank: int, plan_id: str, transfer: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/ranks/{rank}/ack`` (DataLost when the plan was withdrawn).

        ``transfer``: the rank's transfer figures of the mini-batch (see :class:`~knittrans.api.models.TransferIn`).
        """
        body: dict[str, Any] = {"plan_id": plan_id}
        if transfer is not None:
            body["transfer"] = dict(transfer)
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/ranks/{rank}/ack", json=body)
        return result

    def report_version(self, job: str, version: int, rank: int = 0) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/versions``."""
        body = {"version": version, "rank": rank}
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/versions", json=body)
        return result

    def headroom(self, job: str, *, wait_s: float = 0.0, sources: Sequence[str] | None = None) -> dict[str, Any]:
        """``GET /v1/jobs/{job}/headroom``: room under the off-policy window; long-polls up to ``wait_s`` for one
        of ``sources`` (default: any) to have headroom."""
        params: dict[str, Any] = {"wait_s": wait_s}
        if sources is not None:
            params["sources"] = ",".join(sources)
        result: dict[str, Any] = self._json(
            "GET", f"/v1/jobs/{job}/headroom", params=params, timeout_s=wait_s + self.timeout_s
        )
        return result

    def report_rollout_weights(
        self, job: str, worker: str, *, version: int, told: int, loads: int, late: int, wait_s: float
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/rollout/{worker}/weights``: the weights a rollout worker generates with, and its
        cumulative counters (files loaded, versions whose file came late, seconds waited)."""
        body = {"version": version, "told": told, "loads": loads, "late": late, "wait_s": wait_s}
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job}/rollout/{worker}/weights", json=body)
        return result

    def get_version(self, job: str) -> int:
        """``GET /v1/jobs/{job}/version``: the latest policy version."""
        return int(self._json("GET", f"/v1/jobs/{job}/version")["version"])


class PlanStreamReader:
    """A rank's plan stream (``GET /v1/jobs/{job}/ranks/{rank}/plans``): the plan of its next un-acked
    mini-batch pushed by the server as one NDJSON line whenever it changes, instead of a long-poll
    per mini-batch. Acks go by :meth:`ControlClient.ack` as before; tell the reader which plans were
    acked (:meth:`acked`), since a line of a plan sent before its ack may still be buffered (a plan
    prefetched with ``next?after=`` is also pushed here once it becomes the current one).

    A broken stream (connection lost, no line within three keep-alive periods) is reopened with the
    client's retry policy; the server then sends the rank's un-acked plan again. :class:`StreamUnsupported`
    when the server has no such endpoint (use :meth:`ControlClient.next_plan`).
    """

    def __init__(
        self, client: ControlClient, job: str, rank: int, *, keepalive_s: float = 10.0, gateway: bool = False
    ) -> None:
        if not keepalive_s > 0:
            raise ValueError("keepalive_s must be > 0")
        self.client, self.job, self.rank, self.keepalive_s = client, job, rank, keepalive_s
        self.gateway = gateway
        """Open each stream on the server's plan gateway when it runs one (asked again at each reconnect:
        a gateway that died is answered 503 and the server's own stream is used)."""
        self.source: str | None = None
        """Base URL the current (or last) stream came from."""
        self._response: httpx.Response | None = None
        self._lines: Iterator[str] | None = None
        self._acked_through = -1  # highest global index this rank acked: an acked mini-batch is never withdrawn
        self.opened = 0
        """Streams opened (the first one and each reconnect)."""
        self.closed = False

    def acked(self, plan_id: str) -> None:
        """``plan_id`` was acked: lines of it, or of any earlier mini-batch (or attempt), are skipped."""
        parsed = PlanId.parse(str(plan_id))
        if parsed is not None:
            self._acked_through = max(self._acked_through, parsed.n)

    def next(self, timeout_s: float = 30.0) -> RankPlan | None:
        """The next plan not acked through this reader; None when none came within about ``timeout_s``
        (checked at each line: up to one keep-alive period later).

        Raises:
            JobFinished: no further plan will come for this rank.
            StreamUnsupported: the server has no plan stream.
            Unavailable: the stream could not be reopened within the retry budget.
        """
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            line = self._line()
            if line is not None and line.strip():
                body = jsonlib.loads(line)
                if not isinstance(body, dict):
                    raise InvalidRequest(f"plan stream line is not an object: {line[:200]!r}")
                if "plan_id" in body:  # a plan (the other lines carry no plan id)
                    plan = RankPlan.from_json(body)
                    if plan.global_index > self._acked_through:
                        return plan
                elif body.get("done"):
                    self._drop()
                    raise JobFinished(f"job {self.job!r} has no further mini-batch for rank {self.rank}")
                elif "ack_error" in body:
                    logger.warning("plan stream of rank %d: ack refused: %s", self.rank, body)
            if time.monotonic() >= deadline:
                return None
        return None

    def _line(self) -> str | None:
        """One line of the stream (opening it first if needed); None after a broken stream was dropped, or
        once the reader is closed."""
        if self._lines is None:
            self._open()
        lines = self._lines
        if lines is None:  # closed meanwhile
            return None
        try:
            return next(lines)
        except (httpx.TransportError, httpx.StreamError, StopIteration) as exc:
            if not self.closed:
                logger.info("plan stream of rank %d of job %s broke (%s); reopening", self.rank, self.job, exc)
            self._drop()
            return None

    def _open(self) -> None:
        client = self.client
        pauses = client.retry.pauses()
        attempt = 0
        path = f"/v1/jobs/{self.job}/ranks/{self.rank}/plans"
        # read timeout: three keep-alive periods without a line mean the server (or the path to it) is gone
        timeout = httpx.Timeout(client.timeout_s, read=3 * self.keepalive_s + client.timeout_s)
        while not self.closed:
            try:
                base = (client.plan_gateway() if self.gateway else None) or client.base_url
                request = client._poll_http.build_request(
                    "GET", base + path, params={"keepalive_s": self.keepalive_s}, timeout=timeout
                )
                response = client._poll_http.send(request, stream=True)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    self._response, self._lines = response, response.iter_lines()
                    self.opened += 1
                    self.source = base
                    if self.closed:  # closed by another thread while this one opened it
                        self._drop()
                    return
                response.read()  # and closed
                response = _unbound(response)
                if response.status_code == 405 or (response.status_code == 404 and _unknown_route(response)):
                    raise StreamUnsupported(f"control plane {client.base_url} has no plan stream ({path})")
                if response.status_code != 503:
                    _raise_for(response)
                problem = "503 " + response.text[:200]
            pause = client._retry_pause(pauses, attempt, f"plan stream {path}", problem)
            attempt += 1
            time.sleep(pause)

    def close(self) -> None:
        """Close the stream for good (from any thread): a read in progress ends, later reads return None."""
        self.closed = True
        self._drop()

    def _drop(self) -> None:
        """Close the current stream (the next read opens a new one unless the reader is closed)."""
        response, self._response, self._lines = self._response, None, None
        if response is not None:
            response.close()
            _unbound(response, b"")


def _unknown_route(response: httpx.Response) -> bool:
    """A 404 of the server's router (no such path), not of an unknown job or rank."""
    try:
        return bool(response.json().get("detail") == "Not Found")
    except ValueError:
        return True


def _unbound(response: httpx.Response, body: bytes | None = None) -> httpx.Response:
    """``response`` (its body read, or ``body`` in its place: a stream closed unread) without httpx's stream
    wrapper, which refers back to the response.

    That reference made every response a reference cycle of ~50 objects (request, headers, URL, the
    connection pool's request and stream objects) that only the cyclic GC frees: three per mini-batch
    of a trainer rank, enough to trigger collections that pause its thread. The body is kept, so
    ``.content``, ``.json()`` and ``.close()`` work as before.
    """
    response.stream = httpx.ByteStream(response.content if body is None else body)
    return response


def _close_connection(response: httpx.Response) -> None:
    """Close the connection ``response`` came on (its body is read)."""
    stream = response.extensions.get("network_stream")
    if stream is not None:
        with contextlib.suppress(Exception):
            stream.close()


def _find_lane(http: httpx.Client, timeout_s: float) -> tuple[int, int] | None:
    """``GET /v1/lane``, one try: ``(port, max_bytes)``, or None when the control plane has no lane."""
    response = _unbound(http.get("/v1/lane", timeout=timeout_s))
    if response.status_code == 404:
        return None
    _raise_for(response)
    body = response.json()
    return int(body["port"]), int(body["max_bytes"])
