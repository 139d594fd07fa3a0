"""The mini-batch manifest: one immutable description of an admitted mini-batch (docs/reference/wire.md)."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from knittrans.errors import InvalidRequest, InvalidTicket
from knittrans.names import check_name, is_content_hash
from knittrans.plans import MediaFetch, MicroBatchReads, PlanRow, RowFetch
from knittrans.tickets import Ticket, UnitRead, node_reads

__all__ = ["MANIFEST_VERSION", "Manifest", "ManifestGroup", "ManifestNode", "RankPlan", "Row", "etag_of"]

MANIFEST_VERSION = 1
"""Version of the manifest layout; a manifest with another version is refused."""

Row = tuple[int, int, int]
"""One trajectory of a micro-batch: ``(index into Manifest.groups, row in its unit, prompt + response tokens)``."""


@dataclass(frozen=True, slots=True)
class ManifestNode:
    """A store node the mini-batch reads from."""

    node_id: str
    endpoint: str
    """Its Flight location when the manifest was built."""
    grant: str | None
    """Signed grant of every read and media hash of the mini-batch on this node (None: unsigned tickets)."""


@dataclass(frozen=True, slots=True)
class ManifestGroup:
    """A group of the mini-batch: where it is stored and which media its trajectories use."""

    group_id: str
    unit: int
    """Index into :attr:`Manifest.units`."""
    media: tuple[int, ...]
    """Indices into :attr:`Manifest.media`, in the order the group's trajectories use them."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Mini-batch ``global_index`` (re-plan ``attempt``), trained at ``policy_version``; see docs/reference/wire.md."""

    job: str
    global_index: int
    attempt: int
    """0 first; +1 each time a node loss withdraws the mini-batch and it is admitted again."""
    step: int
    mini_batch_index: int
    policy_version: int
    admitted_at: float
    """Wall-clock admission time (Unix seconds)."""
    columns: tuple[str, ...] | None
    """Trajectory columns the ranks read; None for all."""
    nodes: tuple[ManifestNode, ...]
    units: tuple[tuple[str, int], ...]
    """``(unit id, index into nodes)``."""
    groups: tuple[ManifestGroup, ...]
    media: tuple[tuple[str, int], ...]
    """``(content hash, index into units of a unit that holds it)``, each hash once."""
    ranks: tuple[tuple[tuple[Row, ...], ...], ...]
    """Rank → micro-batches → rows, in the order each micro-batch's reads return them."""

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the mini-batch is laid out for."""
        return len(self.ranks)

    @functools.cached_property
    def trajectories(self) -> int:
        """Trajectories of the whole mini-batch (the global loss normaliser)."""
        return sum(len(micro) for share in self.ranks for micro in share)

    @property
    def manifest_id(self) -> str:
        """``n{global_index}.a{attempt}``: names the mini-batch and attempt in logs and records."""
        return f"n{self.global_index}.a{self.attempt}"

    # ------------------------------------------------------------------ wire
    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON value (tuples stand for arrays; docs/reference/wire.md gives the layout)."""
        return {
            "manifest": MANIFEST_VERSION,
            "job": self.job,
            "global_index": self.global_index,
            "attempt": self.attempt,
            "step": self.step,
            "mini_batch_index": self.mini_batch_index,
            "policy_version": self.policy_version,
            "admitted_at": self.admitted_at,
            "world_size": self.world_size,
            "columns": list(self.columns) if self.columns is not None else None,
            "nodes": [[n.node_id, n.endpoint, n.grant] for n in self.nodes],
            "units": self.units,
            "groups": [[g.group_id, g.unit, g.media] for g in self.groups],
            "media": self.media,
            "ranks": self.ranks,  # tuples: json writes them as arrays
        }

    def encode(self) -> bytes:
        """Compact JSON bytes: what every rank receives."""
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Manifest:
        """Read a manifest from its JSON bytes strictly.

        Raises:
            InvalidRequest: not JSON, or a field is missing, unknown, of the wrong type, out of range,
                or contradicts another (the message names it).
        """
        with _collector_paused():
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise InvalidRequest(f"manifest is not JSON: {exc}") from None
            return cls.from_json(body)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        """Pickled (the ranks' broadcast) as one bytes object, unpickled with the collector paused (as
        :meth:`decode`)."""
        return _unpickle, (
            pickle.dumps({f.name: getattr(self, f.name) for f in fields(self)}, pickle.HIGHEST_PROTOCOL),
        )

    @classmethod
    def from_json(cls, body: object) -> Manifest:
        """:meth:`decode` of an already parsed JSON value."""
        d = _object(body)
        if _int(d["manifest"], "manifest") != MANIFEST_VERSION:
            raise InvalidRequest(f"manifest version {d['manifest']!r} is not {MANIFEST_VERSION}")
        columns = d["columns"]
        if columns is not None:
            columns = tuple(_column(c, f"columns[{i}]") for i, c in enumerate(_list(columns, "columns")))
        nodes = tuple(_node(v, f"nodes[{i}]") for i, v in enumerate(_list(d["nodes"], "nodes")))
        units = tuple(_unit(v, f"units[{i}]", len(nodes)) for i, v in enumerate(_list(d["units"], "units")))
        media = tuple(_media(v, f"media[{i}]", len(units)) for i, v in enumerate(_list(d["media"], "media")))
        groups = tuple(
            _group(v, f"groups[{i}]", len(units), len(media)) for i, v in enumerate(_list(d["groups"], "groups"))
        )
        _unique((n.node_id for n in nodes), "nodes", "node")
        _unique((u for u, _ in units), "units", "unit")
        _unique((g.group_id for g in groups), "groups", "group")
        _unique((h for h, _ in media), "media", "content hash")
        ranks = _ranks(d["ranks"], [g.unit for g in groups], [u for u, _ in units])
        admitted = d["admitted_at"]
        if not isinstance(admitted, int | float) or isinstance(admitted, bool):
            raise InvalidRequest(f"manifest field 'admitted_at' must be a number, not {admitted!r}")
        manifest = cls(
            job=_name(d["job"], "job"),
            global_index=_int(d["global_index"], "global_index"),
            attempt=_int(d["attempt"], "attempt"),
            step=_int(d["step"], "step"),
            mini_batch_index=_int(d["mini_batch_index"], "mini_batch_index"),
            policy_version=_int(d["policy_version"], "policy_version"),
            admitted_at=float(admitted),
            columns=columns,
            nodes=nodes,
            units=units,
            groups=groups,
            media=media,
            ranks=ranks,
        )
        if _int(d["world_size"], "world_size") != manifest.world_size:
            raise InvalidRequest(
                f"manifest field 'world_size' is {d['world_size']} but 'ranks' lays out {manifest.world_size} ranks"
            )
        return manifest

    # ------------------------------------------------------------------ a rank's slice
    def share(self, rank: int) -> RankPlan:
        """What ``rank`` reads: its micro-batches with their rows, one rows ticket per node and one media
        ticket per unique hash, each carrying its node's grant.

        Raises:
            InvalidRequest: ``rank`` is outside the manifest's world size, or a micro-batch's rows of one
                node are not contiguous in read order (one ``DoGet`` per node must return them in order).
        """
        if not 0 <= rank < self.world_size:
            raise InvalidRequest(f"rank {rank} is outside the manifest's world_size {self.world_size}")
        micro_batches = tuple(self._micro_batch(i, rows) for i, rows in enumerate(self.ranks[rank]))
        _ = self.trajectories  # the loss normaliser: counted now (by the feed thread), not in the training loop
        return RankPlan(manifest=self, rank=rank, micro_batches=micro_batches)

    @functools.cached_property
    def _nodes_by_id(self) -> dict[str, ManifestNode]:
        return {n.node_id: n for n in self.nodes}

    def _micro_batch(self, index: int, rows: Sequence[Row]) -> MicroBatchReads:
        plan_rows = []
        used: dict[int, None] = {}
        for g, row, num_tokens in rows:
            group = self.groups[g]
            unit_id, node = self.units[group.unit]
            plan_rows.append(
                PlanRow(
                    group_id=group.group_id,
                    unit_id=unit_id,
                    node_id=self.nodes[node].node_id,
                    row=row,
                    num_tokens=num_tokens,
                )
            )
            used.update(dict.fromkeys(group.media))
        try:
            per_node = node_reads((r.node_id, r.unit_id, r.row) for r in plan_rows)
        except InvalidTicket as exc:
            raise InvalidRequest(f"manifest {self.manifest_id} micro-batch {index}: {exc}") from None
        by_id = self._nodes_by_id
        fetches = tuple(
            RowFetch(
                node_id=node_id,
                endpoint=by_id[node_id].endpoint,
                ticket=Ticket(job=self.job, reads=reads, columns=self.columns, grants=_grants(by_id[node_id])),
            )
            for node_id, reads in per_node.items()
        )
        media = []
        for m in used:
            media_hash, unit = self.media[m]
            unit_id, node = self.units[unit]
            holder = self.nodes[node]
            ticket = Ticket(
                job=self.job,
                kind="media",
                reads=(UnitRead(unit_id=unit_id),),
                media_hashes=(media_hash,),
                grants=_grants(holder),
            )
            media.append(MediaFetch(hash=media_hash, node_id=holder.node_id, endpoint=holder.endpoint, ticket=ticket))
        return MicroBatchReads(index=index, rows=tuple(plan_rows), fetches=fetches, media=tuple(media))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """``rank``'s share of ``manifest``: the mini-batch's facts (job, index, attempt, step, policy version,
    admission time, trajectories) are the manifest's; the plan adds the rank's micro-batches."""

    manifest: Manifest
    """The mini-batch the share is cut from."""
    rank: int
    """Rank the share is for."""
    micro_batches: tuple[MicroBatchReads, ...]
    """The share cut into micro-batches; every rank of the mini-batch gets the same count when it can."""

    @property
    def plan_id(self) -> str:
        """``n{global_index}.a{attempt}.r{rank}``: names this share in logs and training records."""
        return f"{self.manifest.manifest_id}.r{self.rank}"


def etag_of(raw: bytes, global_index: int, attempt: int) -> str:
    """The HTTP entity tag of a manifest's bytes: names the mini-batch and attempt, and changes with the
    content (a node that moved to another endpoint gives the same attempt new bytes)."""
    return f'"n{global_index}.a{attempt}.{hashlib.sha256(raw).hexdigest()[:16]}"'


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while a manifest is built (docs/decisions/0011). A 1,024-rank manifest is
    thousands to tens of thousands of tuples; built with the collector on, each build set off dozens of young
    collections and, every few manifests, a full one over the trainer's whole heap (about 100 ms with torch
    imported). Off, its objects are looked at once, by the young collection after the build."""
    if not gc.isenabled():  # the caller's choice, or another thread's build under way
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _unpickle(state: bytes) -> Manifest:
    with _collector_paused():
        return Manifest(**pickle.loads(state))


def _grants(node: ManifestNode) -> tuple[str, ...]:
    return (node.grant,) if node.grant is not None else ()


# ---------------------------------------------------------------------- strict readers
_FIELDS = ("manifest", *(f.name for f in fields(Manifest)), "world_size")
"""The keys of a manifest's JSON object: its version, the :class:`Manifest` fields and ``world_size``."""
_FIELD_SET = frozenset(_FIELDS)


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"a manifest must be a JSON object, not {type(value).__name__}")
    if value.keys() != _FIELD_SET:
        unknown = sorted(str(k) for k in value if k not in _FIELD_SET)
        if unknown:
            raise InvalidRequest(f"a manifest has unknown fields: {unknown}")
        raise InvalidRequest(f"a manifest lacks fields: {[k for k in _FIELDS if k not in value]}")
    return value


def _int(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"manifest field {where!r} must be an integer >= 0, not {value!r}")
    return value


def _name(value: object, where: str) -> str:
    return check_name(value, f"manifest field {where!r}", error=InvalidRequest)


def _column(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"manifest field {where!r} must be a column name, not {value!r}")
    return value


_ARRAYS = (list, tuple)  # a tuple: from_json of to_json's own output


def _list(value: object, where: str, length: int | None = None) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, _ARRAYS):
        raise InvalidRequest(f"manifest field {where!r} must be a list, not {type(value).__name__}")
    if length is not None and len(value) != length:
        raise InvalidRequest(f"manifest field {where!r} must have {length} items, not {len(value)}")
    return value


def _index(value: object, where: str, size: int, of: str) -> int:
    if type(value) is not int or not 0 <= value < size:
        raise InvalidRequest(f"manifest field {where!r}: {value!r} is not an index into {of} (0..{size - 1})")
    return value


def _node(value: object, where: str) -> ManifestNode:
    node_id, endpoint, grant = _list(value, where, 3)
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise InvalidRequest(f"manifest field '{where}[1]' must be a Flight location, not {endpoint!r}")
    if grant is not None and (not isinstance(grant, str) or not grant):
        raise InvalidRequest(f"manifest field '{where}[2]' must be a grant string or null, not {grant!r}")
    return ManifestNode(_name(node_id, f"{where}[0]"), endpoint, grant)


def _unit(value: object, where: str, nodes: int) -> tuple[str, int]:
    unit_id, node = _list(value, where, 2)
    return _name(unit_id, f"{where}[0]"), _index(node, f"{where}[1]", nodes, "nodes")


def _media(value: object, where: str, units: int) -> tuple[str, int]:
    media_hash, unit = _list(value, where, 2)
    if not is_content_hash(media_hash):
        raise InvalidRequest(f"manifest field '{where}[0]' must be 64 lower-case hex characters, not {media_hash!r}")
    return media_hash, _index(unit, f"{where}[1]", units, "units")


def _group(value: object, where: str, units: int, media: int) -> ManifestGroup:
    group_id, unit, used = _list(value, where, 3)
    return ManifestGroup(
        _name(group_id, f"{where}[0]"),
        _index(unit, f"{where}[1]", units, "units"),
        tuple(_index(m, f"{where}[2][{j}]", media, "media") for j, m in enumerate(_list(used, f"{where}[2]"))),
    )


def _unique(names: Iterable[str], where: str, what: str) -> None:
    """Each of ``names`` (the ids of a table's rows) at most once."""
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        j = first.setdefault(name, i)
        if j != i:
            raise InvalidRequest(f"manifest field '{where}[{i}][0]': {what} {name!r} is also {where}[{j}]")


def _ranks(value: object, unit_of: list[int], unit_ids: list[str]) -> tuple[tuple[tuple[Row, ...], ...], ...]:
    """Rank → micro-batch → rows, each row of a unit at most once in the whole mini-batch (whichever group of
    the unit names it). ``unit_of``: each group's index into the units; ``unit_ids``: the units' ids."""
    groups = len(unit_of)
    out = []
    seen: set[tuple[int, int]] = set()
    # the usual case is checked inline; the field's own error (and its path string) only where it fails
    for r, share in enumerate(_list(value, "ranks")):
        micro_batches = []
        for m, micro in enumerate(share if type(share) in _ARRAYS else _list(share, f"ranks[{r}]")):
            rows = []
            for i, row in enumerate(micro if type(micro) in _ARRAYS else _list(micro, f"ranks[{r}][{m}]")):
                if type(row) in _ARRAYS and len(row) == 3:
                    g, unit_row, tokens = row
                    usual = type(g) is type(unit_row) is type(tokens) is int and 0 <= g < groups
                    usual = usual and unit_row >= 0 and tokens >= 0
                else:
                    usual = False
                if not usual:
                    where = f"ranks[{r}][{m}][{i}]"
                    g, unit_row, tokens = _list(row, where, 3)
                    _index(g, f"{where}[0]", groups, "groups")
                    _int(unit_row, f"{where}[1]")
                    _int(tokens, f"{where}[2]")
                key = (unit_of[g], unit_row)
                if key in seen:
                    raise InvalidRequest(
                        f"manifest field 'ranks[{r}][{m}][{i}]': row {unit_row} of unit {unit_ids[key[0]]!r} "
                        "is assigned twice"
                    )
                seen.add(key)
                rows.append((g, unit_row, tokens))
            micro_batches.append(tuple(rows))
        out.append(tuple(micro_batches))
    if not out:
        raise InvalidRequest("manifest field 'ranks' must lay out at least one rank")
    return tuple(out)
