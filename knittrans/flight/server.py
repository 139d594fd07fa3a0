"""``StoreServer``: Arrow Flight shell over a node's :class:`~knittrans.store.UnitStore` (docs/reference/wire.md)."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from knittrans.errors import InvalidRequest, OverBudget, PayloadTooLarge, Unauthenticated
from knittrans.flight.auth import BearerTokenFactory
from knittrans.flight.errors import refusal, to_flight_error
from knittrans.flight.lane import LaneServer
from knittrans.grants import check_listing, check_ticket
from knittrans.jsonlimits import nesting_over
from knittrans.names import check_name
from knittrans.schema import check_schema, validate_part
from knittrans.store import SealedUnit, SealSpec, StoreConfig, UnitStore
from knittrans.tickets import Ticket, UnitRead

__all__ = ["StoreServer", "StoreServerConfig"]

logger = logging.getLogger(__name__)
MAX_WAIT_S = 3600.0
"""Longest ``timeout_s`` a ``publish_units`` call may ask to wait for budget."""
MAX_BATCH_UNITS = 4096
"""Most units one ``seal_units`` or ``publish_units`` call may name."""
MAX_ACTION_BODY_BYTES = 4 << 20
"""Longest JSON body of an action (``publish_units`` of :data:`MAX_BATCH_UNITS` units fits)."""
MAX_ACTION_DEPTH = 8
"""Deepest JSON nesting of an action body (a batched one has 3: body, units, unit)."""
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True)
class StoreServerConfig:
    """A store node's Flight server."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """Directory, budget and spill settings of the underlying store."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = 0
    """TCP port; 0 picks a free one (see :attr:`StoreServer.port`)."""
    node_id: str = "node-0"
    """Name of this store node."""
    token: str | None = None
    """Bearer token every call must carry; None disables auth (loopback only)."""
    max_put_bytes: int = 8 << 30
    """Largest unit (trajectory + media bytes) a single writer may upload."""
    batch_bytes: int = 4 << 20
    """Target size of the record batches ``DoGet`` streams (zero-copy slices)."""
    ticket_key: str | None = None
    """HMAC key shared with the control plane: ``DoGet`` serves only tickets whose signed grants
    cover every read (:mod:`knittrans.grants`); None serves any well-formed ticket."""
    tls_cert: Path | None = None
    """PEM certificate (chain) to serve TLS with (``grpc+tls://``); needs ``tls_key``."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""
    data_lane: bool = True
    """Serve reads on the bulk data lane beside Flight too (:mod:`knittrans.flight.lane`: ``DoGet``'s answer
    as one framed Arrow IPC stream over a plain socket; clients find it with the ``data_lane`` action). Plain
    TCP only: a TLS store opens none (its reads stay on ``grpc+tls``). False: no lane."""
    data_lane_port: int | None = None
    """TCP port of the data lane; None (the default) or 0 picks a free one. Giving a port with TLS, or with
    ``data_lane=False``, is an error."""

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.data_lane_port is not None:
            if not self.data_lane:
                raise ValueError("data_lane_port given with data_lane=False: give a port or turn the lane off")
            if not 0 <= self.data_lane_port < 65536:
                raise ValueError(f"data_lane_port must be in [0, 65535] or None, not {self.data_lane_port}")
            if self.tls_cert is not None:
                raise ValueError(
                    "the data lane is plain TCP and this store serves TLS: run it without a data lane port "
                    "(it then opens no lane; reads stay on grpc+tls) or without TLS"
                )
        check_name(self.node_id, "node_id")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], not {self.port}")
        if self.max_put_bytes <= 0 or self.batch_bytes <= 0:
            raise ValueError("max_put_bytes and batch_bytes must be positive")
        if self.token is not None and not self.token:
            raise ValueError("token must be non-empty or None")


def _mapped(fn: F) -> F:
    """Turn KnitTrans errors into typed Flight errors (logged by :func:`refusal`); report unexpected ones."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except flight.FlightError:
            raise
        except Exception as exc:
            known = refusal(fn.__name__, exc)
            if known is None:
                raise flight.FlightInternalError(f"internal error in {fn.__name__}: {exc!r}") from None
            raise to_flight_error(known) from None

    return wrapper  # type: ignore[return-value]


def _body(action: flight.Action, *keys: str) -> dict[str, Any]:
    kind, raw = action.type, action.body.to_pybytes()
    if len(raw) > MAX_ACTION_BODY_BYTES:
        raise PayloadTooLarge(
            f"action {kind!r}: body is {len(raw)} bytes, more than the {MAX_ACTION_BODY_BYTES} allowed"
        )
    if nesting_over(raw, MAX_ACTION_DEPTH):
        raise InvalidRequest(f"action {kind!r}: body JSON nests deeper than the {MAX_ACTION_DEPTH} levels allowed")
    try:
        body = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"action {kind!r}: body is not JSON: {exc}") from None
    if not isinstance(body, dict) or any(k not in body for k in keys):
        raise InvalidRequest(f"action {kind!r}: body must be a JSON object with keys {list(keys)}")
    return body


def _unit_specs(kind: str, body: dict[str, Any]) -> list[tuple[SealSpec, dict[str, Any]]]:
    """The ``units`` of a batched action (1 to :data:`MAX_BATCH_UNITS` objects naming a unit, each with the
    optional counts of a :class:`SealSpec`) as specs beside their entries."""
    units = body["units"]
    if not isinstance(units, list) or not 1 <= len(units) <= MAX_BATCH_UNITS:
        raise InvalidRequest(f"action {kind!r}: 'units' must be a list of 1 to {MAX_BATCH_UNITS} objects")
    out = []
    for e in units:
        if not isinstance(e, dict) or "unit" not in e:
            raise InvalidRequest(f"action {kind!r}: every entry of 'units' must be an object with a 'unit' key")
        uid = check_name(e["unit"], "unit_id")
        if kind == "publish_units" and (not isinstance(e.get("dir"), str) or not e["dir"]):
            raise InvalidRequest(f"action {kind!r}: 'dir' of unit {uid!r} must be a non-empty string")
        counts = {k: e.get(k) for k in ("rows", "media_rows", "num_bytes")}
        for key, value in counts.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InvalidRequest(f"action {kind!r}: {key!r} must be a non-negative integer, not {value!r}")
        out.append((SealSpec(unit_id=uid, **counts), e))
    return out


def _path(descriptor: flight.FlightDescriptor) -> list[str]:
    """A descriptor's path as text: always UTF-8, as gRPC itself refuses a path that is not (a protobuf
    ``string`` field) before any of the server's code runs, for ``GetFlightInfo`` and ``DoPut`` alike: such a
    call ends in an untyped Flight error that no code of ours sees.
    :class:`~knittrans.flight.client.StoreClient` checks names before it sends them."""
    return [p.decode() for p in (descriptor.path or [])]


def _json(obj: object) -> list[bytes]:
    return [json.dumps(obj).encode()]


class StoreServer(flight.FlightServerBase):  # type: ignore[misc]
    """Arrow Flight server of one store node; listening as soon as it is constructed.

    Use ``server.serve()`` to block (the CLI) or just keep the object alive (tests), and
    ``server.shutdown()`` to stop. ``server.endpoint`` is the ``grpc://host:port`` to dial.
    """

    def __init__(self, config: StoreServerConfig) -> None:
        self.config = config
        self.store = UnitStore(config.store)
        self.auth = BearerTokenFactory(config.token) if config.token else None
        """The bearer-token check of every call (None: no token); the data lane checks with it too."""
        middleware = {"auth": self.auth} if self.auth is not None else {}
        scheme, tls = "grpc", None
        if config.tls_cert is not None and config.tls_key is not None:
            scheme = "grpc+tls"
            tls = [flight.CertKeyPair(cert=Path(config.tls_cert).read_bytes(), key=Path(config.tls_key).read_bytes())]
        super().__init__(f"{scheme}://{config.host}:{config.port}", middleware=middleware, tls_certificates=tls)
        self.endpoint = f"{scheme}://{config.host}:{self.port}"
        self.lane: LaneServer | None = None
        """The bulk data lane (None with ``data_lane=False`` or TLS)."""
        if config.data_lane and tls is None:
            try:
                port = config.data_lane_port or 0
                self.lane = LaneServer(config.host, port, read=self.read_ticket, auth=self.auth)
            except BaseException:
                super().shutdown()
                raise
        logger.info(
            "store node %s serving %s at %s%s",
            config.node_id,
            config.store.root,
            self.endpoint,
            f", data lane on port {self.lane.port}" if self.lane is not None else "",
        )

    def shutdown(self) -> None:
        """Stop the data lane (if any) and the Flight server."""
        if self.lane is not None:
            self.lane.close()
        super().shutdown()

    # --- reads -------------------------------------------------------------------------------
    def read_ticket(self, raw: bytes) -> pa.Table:
        """What ``DoGet`` of the ticket bytes ``raw`` answers: decoded strictly, its grants checked (signed
        mode), read zero-copy and cut into record batches of about ``batch_bytes``. The data lane serves
        its requests with this too."""
        decoded = Ticket.decode(raw)
        if self.config.ticket_key:
            check_ticket(self.config.ticket_key.encode(), decoded, now=time.time())
        table = self.store.read(decoded)
        if table.num_rows > 1 and table.nbytes > self.config.batch_bytes:
            rows = max(1, table.num_rows * self.config.batch_bytes // table.nbytes)
            table = pa.Table.from_batches(table.to_batches(max_chunksize=rows), schema=table.schema)
        return table

    @_mapped
    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        """Stream the rows × columns (or media rows) a strictly decoded ticket names."""
        return flight.RecordBatchStream(self.read_ticket(ticket.ticket))

    def _info(self, unit: SealedUnit) -> flight.FlightInfo:
        ticket = Ticket(job=unit.job, reads=(UnitRead(unit_id=unit.unit_id),))
        endpoint = flight.FlightEndpoint(ticket.encode(), [flight.Location(self.endpoint)])
        descriptor = flight.FlightDescriptor.for_path(unit.job, unit.unit_id)
        return flight.FlightInfo(unit.traj.schema, descriptor, [endpoint], unit.num_rows, unit.num_bytes)

    @_mapped
    def list_flights(self, context: Any, criteria: bytes) -> Iterator[flight.FlightInfo]:
        """One FlightInfo per sealed unit; criteria: a job name or empty for all jobs.

        A store with a ticket key (signed mode) lists one job only, for a caller that shows a grant
        of that job: criteria ``<job>`` newline ``<grant>`` (or just ``<grant>``). The listed tickets carry no
        grant, so they are a description, not a permission: reads still need a plan's grant.
        """
        try:
            text = criteria.decode() if criteria else ""
        except UnicodeDecodeError:
            raise InvalidRequest("ListFlights criteria must be UTF-8 (a job name, or <job>\\n<grant>)") from None
        job, _, grant = text.partition("\n")
        if self.config.ticket_key:
            if not grant and "." in job:  # a bare grant
                job, grant = "", job
            job = check_listing(self.config.ticket_key.encode(), grant, job=job or None, now=time.time())
        elif grant:
            raise InvalidRequest("this store has no ticket key: ListFlights criteria is a job name or empty")
        if job:
            check_name(job, "job")
        units = self.store.units(job or None)
        return iter([self._info(u) for u in units])

    @_mapped
    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        """FlightInfo of the unit named by descriptor path ``[job, unit]`` (signed mode:
        ``[job, unit, grant]`` with a grant of that job)."""
        path = _path(descriptor)
        if self.config.ticket_key:
            if len(path) != 3:
                raise Unauthenticated(
                    "this store describes units only with a grant of their job: descriptor path [job, unit, grant]"
                )
            check_listing(self.config.ticket_key.encode(), path[2], job=path[0], now=time.time())
            path = path[:2]
        if len(path) != 2:
            raise InvalidRequest(f"descriptor path must be [job, unit], got {path}")
        return self._info(self.store.get(path[0], path[1]))

    # --- writes ------------------------------------------------------------------------------
    @_mapped
    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any, writer: Any) -> None:
        """Receive one part of a pending unit, validating and acknowledging every batch.

        The stream owns its part while it runs (see :class:`~knittrans.store.PendingUnit`): a
        concurrent stream to the same part is refused, a later one replaces it, and a failing
        stream drops only its own rows.
        """
        path = _path(descriptor)
        if len(path) != 3 or path[2] not in ("traj", "media"):
            raise InvalidRequest(f"DoPut descriptor path must be [job, unit, 'traj'|'media'], got {path}")
        job, unit_id = check_name(path[0], "job"), check_name(path[1], "unit_id")
        part: Literal["traj", "media"] = "traj" if path[2] == "traj" else "media"
        check_schema(reader.schema, "trajectories" if part == "traj" else "media")
        pending, token = self.store.open_part(job, unit_id, part)
        ok = refused = False
        try:
            for chunk in reader:
                batch = chunk.data
                if batch is None:
                    continue
                total = sum(pending.received.values()) + batch.nbytes
                if total > self.config.max_put_bytes:
                    raise PayloadTooLarge(
                        f"unit {unit_id!r} upload reached {total} bytes, above the limit of "
                        f"{self.config.max_put_bytes} bytes"
                    )
                validate_part(batch, part)
                pending.write(part, batch, token=token, abandoned=context.is_cancelled)
                writer.write(pa.py_buffer(json.dumps({"rows": batch.num_rows, "bytes": total}).encode()))
            ok = True
        except (OverBudget, PayloadTooLarge):
            refused = True
            raise
        finally:
            self.store.close_part(pending, part, token, ok=ok)
            if refused:  # the unit cannot be completed: its other part gives its budget back now
                self.store.abort(job, unit_id, only=pending)

    # --- actions -----------------------------------------------------------------------------
    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        """The actions this server understands."""
        return [
            ("seal_units", "publish pending units written with DoPut, all or none: {job, units: [{unit, ...}]}"),
            (
                "publish_units",
                "same-host writer: publish units written into its temporaries, all or none: "
                "{job, units: [{unit, dir, ...}], timeout_s}",
            ),
            ("delete", "delete a sealed or pending unit: {job, unit}"),
            ("stats", "counts and bytes of this node"),
            ("health", "liveness and identity of this node"),
            ("data_lane", "the bulk data lane of this node: {port} (null: none)"),
        ]

    @_mapped
    def do_action(self, context: Any, action: flight.Action) -> list[bytes]:
        """Dispatch ``seal_units``, ``publish_units``, ``delete``, ``stats``, ``health`` and ``data_lane``."""
        kind = action.type
        if kind == "health":
            return _json({"ok": True, "node_id": self.config.node_id, "endpoint": self.endpoint})
        if kind == "stats":
            return _json({"node_id": self.config.node_id, **self.store.stats()})
        if kind == "data_lane":
            return _json({"port": self.lane.port if self.lane is not None else None})
        if kind in ("seal_units", "publish_units"):
            body = _body(action, "job", "units")
            job, specs = check_name(body["job"], "job"), _unit_specs(kind, body)
            if kind == "seal_units":
                sealed = self.store.seal_units(job, [spec for spec, _ in specs])
            else:
                timeout = body.get("timeout_s")
                number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
                if timeout is not None and not (number and 0 <= timeout <= MAX_WAIT_S):
                    raise InvalidRequest(
                        f"action {kind!r}: 'timeout_s' must be a number of seconds in [0, {MAX_WAIT_S}], "
                        f"not {timeout!r}"
                    )
                units = [(spec, e["dir"]) for spec, e in specs]
                sealed = self.store.publish_units(job, units, timeout=timeout, abandoned=context.is_cancelled)
            return _json({"units": [u.info() for u in sealed]})
        if kind == "delete":
            body = _body(action, "job", "unit")
            job, unit_id = check_name(body["job"], "job"), check_name(body["unit"], "unit_id")
            self.store.delete(job, unit_id)
            return _json({"deleted": unit_id})
        raise InvalidRequest(f"unknown action {kind!r}; known: {[a for a, _ in self.list_actions(None)]}")
