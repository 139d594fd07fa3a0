"""``ControlClient``: a synchronous client of the control-plane REST API, with retries (docs/reference/rest.md)."""

from __future__ import annotations

import contextlib
import json as jsonlib
import logging
import os
import re
import ssl
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import pydantic_core

from knittrans.descriptors import UnitDescriptor
from knittrans.errors import KnitTransError, NotFound, Unavailable, error_of
from knittrans.manifest import Manifest
from knittrans.retry import DEFAULT_RETRY, RetryPolicy

__all__ = ["ControlClient", "JobFinished"]

logger = logging.getLogger(__name__)

_WARN_AFTER_ATTEMPTS = 5
"""A call failing this many times in a row is logged as a warning (earlier retries at debug level)."""

_DONE_HEADER = "x-knittrans-done"
_UNREGISTERED_NODE = re.compile(r"node '([^']+)' is not registered")


class JobFinished(KnitTransError):
    """The mini-batch asked for will never be admitted: the job was drained or reached ``total_steps``."""


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        kind, detail = str(body.get("error", "")), str(body.get("detail", response.text))
    except (ValueError, AttributeError):  # not JSON (a proxy's page), or JSON but not an object
        kind, detail = "", response.text
    status = response.status_code
    error = error_of(kind, status)
    raise error(detail if error is not KnitTransError else f"HTTP {status}: {detail}")


_JSON_CONTENT = {"Content-Type": "application/json"}


def _units_json(units: Sequence[UnitDescriptor | Mapping[str, Any]]) -> bytes:
    """A registration's body (``{"units": [...]}``) as compact JSON: descriptors (checked when made: every
    number finite) encoded by pydantic-core; anything else by ``json.dumps``, which refuses NaN and infinities
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
        # Long-polls use a pool of their own: a poll waiting in one thread (the feed's) never holds the
        # connection ordinary requests use. Its connections are kept like theirs, so a rank's polls for
        # mini-batch after mini-batch travel on one connection instead of connecting (and the server
        # accepting) anew next to each mini-batch's first fetch. A connection that a call opened after
        # ``close()`` is closed by that call (:meth:`_request`).
        self._closed = False
        self._poll_http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, verify=verify)

    def close(self) -> None:
        """Close the connection pools (a request still in flight in another thread closes its own connection
        when it returns: see :meth:`_request`)."""
        self._closed = True
        self._http.close()
        self._poll_http.close()

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
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        poll: bool = False,
    ) -> httpx.Response:
        pauses = self.retry.pauses()
        attempt = 0
        http = self._poll_http if poll else self._http
        while True:
            try:
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
            pause = next(pauses, None) if self.retries is None or attempt < self.retries else None
            if pause is None:
                raise Unavailable(
                    f"control plane {self.base_url}: {method} {path} failed after {attempt + 1} attempts: {problem}"
                )
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

    def _obj(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """The answer's JSON object."""
        result: dict[str, Any] = self._request(method, path, **kwargs).json()
        return result

    # ------------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        """``GET /v1/health``."""
        return self._obj("GET", "/v1/health")

    def overview(self) -> dict[str, Any]:
        """``GET /v1/overview`` (admin): jobs, store nodes and ranks, as the dashboard shows them."""
        return self._obj("GET", "/v1/overview")

    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text)."""
        return self._request("GET", "/metrics").text

    # ------------------------------------------------------------------ jobs (admin)
    def create_job(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/jobs``; the identical spec again is a no-op."""
        return self._obj("POST", "/v1/jobs", json=dict(spec))

    def get_job(self, job: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job}``."""
        return self._obj("GET", f"/v1/jobs/{job}")

    def update_quotas(self, job: str, quotas: Mapping[str, int]) -> dict[str, Any]:
        """``PUT /v1/jobs/{job}/quotas`` (effective from the next train step)."""
        return self._obj("PUT", f"/v1/jobs/{job}/quotas", json={"quotas": dict(quotas)})

    def pause(self, job: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/pause``."""
        return self._obj("POST", f"/v1/jobs/{job}/pause")

    def resume(self, job: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/resume``."""
        return self._obj("POST", f"/v1/jobs/{job}/resume")

    def drain(self, job: str) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/drain``."""
        return self._obj("POST", f"/v1/jobs/{job}/drain")

    def status(self, job: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job}/status``."""
        return self._obj("GET", f"/v1/jobs/{job}/status")

    # ------------------------------------------------------------------ nodes
    def register_node(
        self, node_id: str, endpoint: str, host: str = "", *, node_key: str | None = None
    ) -> dict[str, Any]:
        """``POST /v1/nodes``; ``node_key`` is the node's own credential (lets it move its endpoint)."""
        body: dict[str, Any] = {"node_id": node_id, "endpoint": endpoint, "host": host}
        if node_key is not None:
            body["node_key"] = node_key
        return self._obj("POST", "/v1/nodes", json=body)

    def remove_unit(self, job: str, unit_id: str, reason: str = "removed by an admin") -> dict[str, Any]:
        """``DELETE /v1/jobs/{job}/units/{unit}`` (admin): its unadmitted groups are regenerated."""
        return self._obj("DELETE", f"/v1/jobs/{job}/units/{unit_id}", params={"reason": reason})

    def mint_token(self, role: str, job: str | None = None, rank: int | None = None) -> str:
        """``POST /v1/tokens`` (admin): a bearer token scoped to one job's worker, one rank, or a store."""
        body = {"role": role, "job": job, "rank": rank}
        return str(self._request("POST", "/v1/tokens", json=body).json()["token"])

    def heartbeat(self, node_id: str, usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/nodes/{node}/heartbeat`` (Conflict when the node was declared lost).

        ``usage``: the store's ``stats`` (units, bytes, budget), shown by ``/metrics`` and ``/ui``.
        """
        body = dict(usage) if usage is not None else None
        return self._obj("POST", f"/v1/nodes/{node_id}/heartbeat", json=body)

    def list_nodes(self) -> list[dict[str, Any]]:
        """``GET /v1/nodes``."""
        result: list[dict[str, Any]] = self._request("GET", "/v1/nodes").json()
        return result

    def declare_lost(self, node_id: str, reason: str = "declared lost by an admin") -> dict[str, Any]:
        """``POST /v1/nodes/{node}/lost`` (admin)."""
        return self._obj("POST", f"/v1/nodes/{node_id}/lost", json={"reason": reason})

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
        pauses = RetryPolicy(budget_s=node_wait_s, max_backoff_s=0.5, jitter=0).pauses()
        while True:
            try:
                return self._obj("POST", f"/v1/jobs/{job}/units", content=data, headers=_JSON_CONTENT)
            except NotFound as exc:
                missing = _UNREGISTERED_NODE.search(str(exc))
                if missing is None:
                    raise
                pause = next(pauses, None)
                if pause is None:
                    raise NotFound(
                        f"store node {missing.group(1)!r} has not registered with the control plane "
                        f"{self.base_url} (waited {node_wait_s:g} s): start the store with --control-url "
                        f"{self.base_url} (it registers itself and heartbeats) before registering its units, "
                        f"or register it with POST /v1/nodes"
                    ) from None
                time.sleep(pause)

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
        return self._obj("POST", f"/v1/jobs/{job}/supply", json=body)

    # ------------------------------------------------------------------ mini-batches
    def manifest(
        self, job: str, n: int, timeout_s: float = 30.0, *, etag: str | None = None
    ) -> tuple[Manifest, str] | None:
        """``GET /v1/jobs/{job}/minibatches/{n}``: the manifest of mini-batch ``n`` and its ETag, or None when it
        was not admitted within ``timeout_s``.

        ``etag``: the ETag of a manifest of ``n`` already held; the call then waits for a different one (the
        mini-batch re-planned after a node loss) and returns None if none came within ``timeout_s``.

        Raises:
            JobFinished: mini-batch ``n`` will never be admitted (the job drained or completed).
            Conflict: ``n`` was consumed already (the trainer is past it).
            InvalidRequest: the answer is not a well-formed manifest.
        """
        headers = {"If-None-Match": etag} if etag is not None else None
        response = self._request(
            "GET",
            f"/v1/jobs/{job}/minibatches/{n}",
            params={"timeout_s": timeout_s},
            headers=headers,
            timeout_s=timeout_s + self.timeout_s,
            poll=True,
        )
        if response.status_code in (204, 304):
            if response.headers.get(_DONE_HEADER) == "1":
                raise JobFinished(f"job {job!r} will admit no mini-batch {n}")
            return None
        return Manifest.decode(response.content), response.headers.get("etag", "")

    def progress(self, job: str) -> dict[str, Any]:
        """``GET /v1/jobs/{job}/minibatches``: the trainer's position and the in-flight mini-batches' progress."""
        return self._obj("GET", f"/v1/jobs/{job}/minibatches")

    def fetched(self, job: str, n: int, attempt: int, ranks: Sequence[int] | None = None) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/minibatches/{n}/fetched``: ``ranks`` (None: every rank) hold their whole share.

        Raises:
            DataLost: that attempt was withdrawn (a store node holding its rows was lost).
        """
        body = {"attempt": attempt, "ranks": list(ranks) if ranks is not None else None}
        return self._obj("POST", f"/v1/jobs/{job}/minibatches/{n}/fetched", json=body)

    def ack(
        self,
        job: str,
        n: int,
        attempt: int,
        ranks: Sequence[int] | None = None,
        *,
        version: int | None = None,
        transfer: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/minibatches/{n}/ack``: ``ranks`` (None: every rank) finished mini-batch ``n``.

        ``version``: the policy version the optimizer step produced (weights already published); recorded in
        the same change as the ack. ``transfer``: each acked rank's transfer figures of the mini-batch, in
        ``ranks`` order (rank order when None), sent as columns (:class:`~knittrans.api.models.TransferIn`),
        seconds to the microsecond. DataLost when that attempt was withdrawn.
        """
        body: dict[str, Any] = {"attempt": attempt, "ranks": list(ranks) if ranks is not None else None}
        if version is not None:
            body["version"] = version
        if transfer is not None:
            names = ("exposed_s", "fetch_s", "row_bytes", "media_logical_bytes", "media_physical_bytes")
            columns = {name: [figures.get(name, 0) for figures in transfer] for name in names}
            for name in ("exposed_s", "fetch_s"):  # 0.000123, not 0.00012345678901234: 40 % fewer bytes to parse
                columns[name] = [round(s, 6) for s in columns[name]]
            body["transfer"] = columns
        return self._obj("POST", f"/v1/jobs/{job}/minibatches/{n}/ack", json=body)

    def report_version(self, job: str, version: int, rank: int = 0) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/versions``."""
        body = {"version": version, "rank": rank}
        return self._obj("POST", f"/v1/jobs/{job}/versions", json=body)

    def headroom(self, job: str, *, wait_s: float = 0.0, sources: Sequence[str] | None = None) -> dict[str, Any]:
        """``GET /v1/jobs/{job}/headroom``: room under the off-policy window; long-polls up to ``wait_s`` for one
        of ``sources`` (default: any) to have headroom."""
        params: dict[str, Any] = {"wait_s": wait_s}
        if sources is not None:
            params["sources"] = ",".join(sources)
        return self._obj("GET", f"/v1/jobs/{job}/headroom", params=params, timeout_s=wait_s + self.timeout_s)

    def report_rollout_weights(
        self, job: str, worker: str, *, version: int, told: int, loads: int, late: int, wait_s: float
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{job}/rollout/{worker}/weights``: the weights a rollout worker generates with, and its
        cumulative counters (files loaded, versions whose file came late, seconds waited)."""
        body = {"version": version, "told": told, "loads": loads, "late": late, "wait_s": wait_s}
        return self._obj("POST", f"/v1/jobs/{job}/rollout/{worker}/weights", json=body)

    def get_version(self, job: str) -> int:
        """``GET /v1/jobs/{job}/version``: the latest policy version."""
        return int(self._request("GET", f"/v1/jobs/{job}/version").json()["version"])


def _unbound(response: httpx.Response) -> httpx.Response:
    """``response`` (its body read) without httpx's stream wrapper, which refers back to the response.

    That reference made every response a reference cycle of ~50 objects (request, headers, URL, the
    connection pool's request and stream objects) that only the cyclic GC frees: three per mini-batch
    of a trainer rank, enough to trigger collections that pause its thread. The body is kept, so
    ``.content``, ``.json()`` and ``.close()`` work as before.
    """
    response.stream = httpx.ByteStream(response.content)
    return response


def _close_connection(response: httpx.Response) -> None:
    """Close the connection ``response`` came on (its body is read)."""
    stream = response.extensions.get("network_stream")
    if stream is not None:
        with contextlib.suppress(Exception):
            stream.close()
