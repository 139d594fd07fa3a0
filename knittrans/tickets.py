"""Versioned JSON Flight tickets: issued by the control plane, decoded strictly by one function."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from knittrans.errors import InvalidTicket
from knittrans.jsonlimits import nesting_over
from knittrans.names import check_name, is_content_hash

__all__ = [
    "MAX_TICKET_BYTES",
    "MAX_TICKET_DEPTH",
    "TICKET_VERSION",
    "Ticket",
    "UnitRead",
    "join_tickets",
    "node_reads",
]

TICKET_VERSION = 1
"""Version of the ticket envelope; a ticket with another version is refused."""

MAX_TICKET_BYTES = 1 << 20
"""Largest ticket accepted (1 MiB): enough for thousands of row ranges."""
MAX_TICKET_DEPTH = 8
"""Deepest JSON nesting a ticket may have (a well-formed one has 4: object, reads, read, row range)."""


@dataclass(frozen=True, kw_only=True)
class UnitRead:
    """Rows of one unit: half-open ``[start, stop)`` ranges, sorted and non-overlapping."""

    unit_id: str
    """Storage unit id on the node the ticket is sent to."""
    row_ranges: tuple[tuple[int, int], ...] = ()
    """Row ranges to read; empty means every row of the unit."""

    def __post_init__(self) -> None:
        check_name(self.unit_id, "unit_id", error=InvalidTicket)
        prev = -1
        for r in self.row_ranges:
            if len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
                raise InvalidTicket(f"unit {self.unit_id!r}: row range {r!r} is not a pair of integers")
            start, stop = r
            if start < 0 or stop <= start:
                raise InvalidTicket(f"unit {self.unit_id!r}: row range [{start}, {stop}) is empty or negative")
            if start < prev:
                raise InvalidTicket(f"unit {self.unit_id!r}: row ranges overlap or are unsorted at [{start}, {stop})")
            prev = stop

    @property
    def num_rows(self) -> int | None:
        """Rows selected, or None when the whole unit is meant."""
        if not self.row_ranges:
            return None
        return sum(stop - start for start, stop in self.row_ranges)


def _check_no_row_twice(reads: tuple[UnitRead, ...]) -> None:
    """Bound what one ticket can serve: each row of a unit at most once (no repeated reads)."""
    per_unit: dict[str, list[tuple[int, int]]] = {}  # a unit read whole: []
    for r in reads:
        seen = per_unit.get(r.unit_id)
        if seen is not None and (not seen or not r.row_ranges):
            raise InvalidTicket(f"unit {r.unit_id!r} is read whole and again in the same ticket")
        per_unit.setdefault(r.unit_id, []).extend(r.row_ranges)
    for unit_id, ranges in per_unit.items():
        ranges.sort()
        for (_, stop), (start, _) in itertools.pairwise(ranges):
            if start < stop:
                raise InvalidTicket(f"unit {unit_id!r}: row {start} is read more than once in the ticket")


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """What one ``DoGet`` serves: rows × columns of units of one node, or media by content hash."""

    job: str
    """Job the units belong to."""
    kind: Literal["rows", "media"] = "rows"
    """``rows``: trajectory rows; ``media``: rows of the media tables selected by hash."""
    reads: tuple[UnitRead, ...] = ()
    """Units and row ranges, streamed in this order (``rows``) or searched (``media``)."""
    columns: tuple[str, ...] | None = None
    """Trajectory columns to project; None means all (``rows`` only)."""
    media_hashes: tuple[str, ...] = ()
    """Lower-case hex content hashes to serve, each once (``media`` only)."""
    grants: tuple[str, ...] = ()
    """Signed grants (:mod:`knittrans.grants`) a store with a ticket key checks the reads against."""

    def __post_init__(self) -> None:
        check_name(self.job, "job", error=InvalidTicket)
        if self.kind not in ("rows", "media"):
            raise InvalidTicket(f"ticket kind must be 'rows' or 'media', not {self.kind!r}")
        if self.kind == "rows" and not self.reads:
            raise InvalidTicket("a 'rows' ticket needs at least one read")
        if self.kind == "rows" and self.media_hashes:
            raise InvalidTicket("a 'rows' ticket takes no media hashes (a 'media' ticket serves those)")
        if self.kind == "media" and (self.columns is not None or any(r.row_ranges for r in self.reads)):
            raise InvalidTicket("a 'media' ticket takes no columns or row ranges: it names the units to search")
        _check_no_row_twice(self.reads)
        if self.kind == "media":
            if not self.media_hashes:
                raise InvalidTicket("a 'media' ticket needs at least one media hash")
            for h in self.media_hashes:
                if not is_content_hash(h):
                    raise InvalidTicket(f"media hash {h!r} is not 64 lower-case hex characters")
        if self.columns is not None:
            if not self.columns or not all(isinstance(c, str) and c for c in self.columns):
                raise InvalidTicket("columns must be a non-empty list of column names, or null for all")
            if len(set(self.columns)) != len(self.columns):
                raise InvalidTicket(f"columns contain duplicates: {list(self.columns)}")

    def encode(self) -> bytes:
        """Compact JSON bytes for ``pyarrow.flight.Ticket``."""
        body: dict[str, Any] = {"v": TICKET_VERSION, "kind": self.kind, "job": self.job}
        body["reads"] = [{"unit": r.unit_id, "rows": [list(x) for x in r.row_ranges]} for r in self.reads]
        if self.columns is not None:
            body["columns"] = list(self.columns)
        if self.media_hashes:
            body["media"] = list(self.media_hashes)
        if self.grants:
            body["grants"] = list(self.grants)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Ticket:
        """Decode ticket bytes strictly; raise :class:`InvalidTicket` naming what is wrong."""
        if len(raw) > MAX_TICKET_BYTES:
            raise InvalidTicket(f"ticket is {len(raw)} bytes, more than the {MAX_TICKET_BYTES} allowed")
        if nesting_over(raw, MAX_TICKET_DEPTH):
            raise InvalidTicket(f"ticket JSON nests deeper than the {MAX_TICKET_DEPTH} levels allowed")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise InvalidTicket(f"ticket is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidTicket("ticket must be a JSON object")
        if body.get("v") != TICKET_VERSION or type(body["v"]) is not int:  # true and 1.0 equal 1 too
            raise InvalidTicket(f"ticket version {body.get('v')!r} is not supported (expected {TICKET_VERSION})")
        unknown = set(body) - {"v", "kind", "job", "reads", "columns", "media", "grants"}
        if unknown:
            raise InvalidTicket(f"ticket has unknown fields: {sorted(unknown)}")
        reads_raw = body.get("reads", [])
        if not isinstance(reads_raw, list):
            raise InvalidTicket("ticket field 'reads' must be a list")
        reads = []
        for i, r in enumerate(reads_raw):
            if not isinstance(r, dict) or set(r) - {"unit", "rows"} or not isinstance(r.get("unit"), str):
                raise InvalidTicket(f"reads[{i}] must be an object {{'unit': str, 'rows': [[start, stop], ...]}}")
            rows = r.get("rows", [])
            if not isinstance(rows, list) or not all(isinstance(x, list) for x in rows):
                raise InvalidTicket(f"reads[{i}].rows must be a list of [start, stop] pairs")
            reads.append(UnitRead(unit_id=r["unit"], row_ranges=tuple(tuple(x) for x in rows)))
        columns = body.get("columns")
        if columns is not None and not isinstance(columns, list):
            raise InvalidTicket("ticket field 'columns' must be a list of names")
        media = body.get("media", [])
        if not isinstance(media, list):
            raise InvalidTicket("ticket field 'media' must be a list of hex hashes")
        grants = body.get("grants", [])
        if not isinstance(grants, list) or not all(isinstance(g, str) for g in grants):
            raise InvalidTicket("ticket field 'grants' must be a list of strings")
        return cls(
            job=body.get("job", ""),
            kind=body.get("kind", "rows"),
            reads=tuple(reads),
            columns=tuple(columns) if columns is not None else None,
            media_hashes=tuple(media),
            grants=tuple(grants),
        )


def node_reads(rows: Iterable[tuple[str, str, int]]) -> dict[str, tuple[UnitRead, ...]]:
    """Rows ``(node_id, unit_id, row)`` in read order as the reads of each node (nodes in first-use order).

    Consecutive rows of one unit make one read, a row right after the previous one extending its range
    (any other row starts a new range); reading a node's reads in order returns its rows in order. One
    ``DoGet`` per node returns its rows in order, so a node's rows must be contiguous in ``rows``.

    Raises:
        InvalidTicket: a node's rows are interrupted by another node's, or a range is not valid.
    """
    per_node: dict[str, list[tuple[str, list[tuple[int, int]]]]] = {}
    last: tuple[str, str] | None = None
    ranges: list[tuple[int, int]] = []
    for node_id, unit_id, row in rows:
        if last is not None and last[0] == node_id and last[1] == unit_id:
            start, stop = ranges[-1]
            if stop == row:
                ranges[-1] = (start, row + 1)
            else:
                ranges.append((row, row + 1))
            continue
        if (last is None or node_id != last[0]) and node_id in per_node:
            raise InvalidTicket(f"rows of node {node_id!r} are not contiguous in read order")
        ranges = [(row, row + 1)]
        per_node.setdefault(node_id, []).append((unit_id, ranges))
        last = (node_id, unit_id)
    return {
        node: tuple(UnitRead(unit_id=unit_id, row_ranges=tuple(r)) for unit_id, r in reads)
        for node, reads in per_node.items()
    }


def join_tickets(tickets: Sequence[Ticket]) -> Ticket:
    """One ticket that serves what ``tickets`` serve, in their order (one ``DoGet`` instead of several).

    ``rows`` tickets of one job and projection: reads concatenated. ``media`` tickets of one job:
    units once each, hashes concatenated. Grants: those of ``tickets`` once each, in first-seen order.

    Raises:
        InvalidTicket: no tickets, or they differ in kind, job or (``rows``) columns, or the joined
            ticket would read a row twice.
    """
    if not tickets:
        raise InvalidTicket("join_tickets needs at least one ticket")
    first = tickets[0]
    if len(tickets) == 1:
        return first
    joined = tuple(dict.fromkeys(g for t in tickets for g in t.grants))
    for t in tickets[1:]:
        if t.kind != first.kind or t.job != first.job or (first.kind == "rows" and t.columns != first.columns):
            raise InvalidTicket("only tickets of one kind, job and projection can be joined")
    if first.kind == "rows":
        return Ticket(
            job=first.job, reads=tuple(r for t in tickets for r in t.reads), columns=first.columns, grants=joined
        )
    units: list[UnitRead] = []
    for t in tickets:
        units.extend(r for r in t.reads if r not in units)
    return Ticket(
        job=first.job,
        kind="media",
        reads=tuple(units),
        media_hashes=tuple(h for t in tickets for h in t.media_hashes),
        grants=joined,
    )
