"""The rank plan: what a trainer rank receives for its share of one admitted mini-batch.

The control plane builds a :class:`RankPlan` (:func:`knittrans.api.plans.render_rank_plan`), sends
:meth:`RankPlan.to_json` as the body of ``GET /v1/jobs/{job}/ranks/{rank}/next``, and the trainer
client reads it back with :meth:`RankPlan.from_json`, which refuses anything but a well-formed plan
and names the field that is wrong. Wire layout (key order as sent)::

    {"plan_id": "n7.a0.r1", "job": ..., "rank": 1, "step": 3, "mini_batch_index": 1,
     "global_index": 7, "policy_version": 7, "num_tokens": ...,
     "micro_batches": [{"index": 0, "num_tokens": ...,
                        "rows": [{"group_id", "unit_id", "node_id", "row", "num_tokens"}, ...],
                        "fetches": [{"node_id", "endpoint", "ticket"}, ...],
                        "media": [{"hash", "node_id", "endpoint", "ticket"}, ...]}, ...],
     "mini_batch_trajectories": 64, "admitted_at": 1767225600.0}

Tickets travel as the strings :meth:`knittrans.tickets.Ticket.encode` makes; here they are
:class:`~knittrans.tickets.Ticket` objects. ``RankPlanOut`` in ``api/models.py`` (the layout in the
OpenAPI schema) is made from these dataclasses.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from knittrans.errors import InvalidRequest, InvalidTicket
from knittrans.names import is_content_hash
from knittrans.tickets import Ticket

__all__ = ["MediaFetch", "MicroBatchReads", "PlanId", "PlanRow", "RankPlan", "RowFetch"]

Json = dict[str, Any]
"""One JSON object of the plan, as ``json.loads`` returns it."""


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class PlanId:
    """Identity of a plan: mini-batch ``n``, its re-plan ``attempt`` and the ``rank``; ``n{n}.a{attempt}.r{rank}``."""

    n: int
    """Global index of the mini-batch."""
    attempt: int
    """Re-plan attempt of that mini-batch (0 first; +1 each time a node loss withdraws it)."""
    rank: int
    """Data-parallel rank the plan is for."""

    def __post_init__(self) -> None:
        for name in ("n", "attempt", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequest(f"plan id field {name!r} must be an integer >= 0, not {value!r}")

    def __str__(self) -> str:
        return f"n{self.n}.a{self.attempt}.r{self.rank}"

    @classmethod
    def parse(cls, text: str) -> PlanId | None:
        """The plan id written as ``text``, or None when ``text`` is not one of ours."""
        parts = text.split(".")
        if len(parts) != 3 or [p[:1] for p in parts] != ["n", "a", "r"]:
            return None
        try:
            n, attempt, rank = (int(p[1:]) for p in parts)
        except ValueError:
            return None
        if min(n, attempt, rank) < 0:
            return None
        # what cls(n=..., attempt=..., rank=...) makes, without re-checking what was just checked (int() gives
        # ints, none negative): every ack at 1,024 ranks parses one on the state thread
        plan = object.__new__(cls)
        object.__setattr__(plan, "n", n)
        object.__setattr__(plan, "attempt", attempt)
        object.__setattr__(plan, "rank", rank)
        return plan


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRow:
    """One trajectory row of a micro-batch, in the order the micro-batch's reads return rows."""

    group_id: str
    """Group the row belongs to."""
    unit_id: str
    """Storage unit that holds the row."""
    node_id: str
    """Store node that owns the unit."""
    row: int
    """Row inside the unit."""
    num_tokens: int
    """Prompt + response tokens of the trajectory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RowFetch:
    """One ``DoGet``: every row of the micro-batch on one node, returned in ``rows`` order."""

    node_id: str
    """Store node to ask."""
    endpoint: str
    """Its Flight location when the plan was rendered."""
    ticket: Ticket
    """A ``rows`` ticket naming the unit row ranges."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaFetch:
    """One unique media hash of the micro-batch and the ``DoGet`` that serves it."""

    hash: str
    """Lower-case hex content hash of the media item."""
    node_id: str
    """Store node to ask."""
    endpoint: str
    """Its Flight location when the plan was rendered."""
    ticket: Ticket
    """A ``media`` ticket naming the hash and the unit that holds it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchReads:
    """One micro-batch of a rank's plan: its rows and the reads that fetch them."""

    index: int
    """Position in the rank's share (0, 1, ...)."""
    num_tokens: int
    """Tokens of its rows."""
    rows: tuple[PlanRow, ...]
    """Its rows, in the order the fetches return them."""
    fetches: tuple[RowFetch, ...]
    """One rows ``DoGet`` per store node, in row order."""
    media: tuple[MediaFetch, ...]
    """One entry per unique media hash its rows use, in first-use order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """A rank's share of mini-batch ``global_index`` (trained at ``policy_version``)."""

    plan_id: PlanId
    """Identity of the plan (acks and ``next?after=`` name it)."""
    job: str
    """Job the mini-batch belongs to."""
    rank: int
    """Rank the plan is for (equal to ``plan_id.rank``)."""
    step: int
    """Optimizer step the mini-batch belongs to."""
    mini_batch_index: int
    """Index ``k`` of the mini-batch within its step."""
    global_index: int
    """Global index ``n`` of the mini-batch (equal to ``plan_id.n``)."""
    policy_version: int
    """Policy version the mini-batch is trained at."""
    num_tokens: int
    """Tokens of the rank's share."""
    micro_batches: tuple[MicroBatchReads, ...]
    """The share cut into micro-batches; every rank of the mini-batch gets the same count when it can."""
    mini_batch_trajectories: int | None = None
    """Trajectories of the whole mini-batch over all ranks (None when the control plane does not say)."""
    admitted_at: float | None = None
    """Wall-clock admission time of the mini-batch (None when the control plane does not say)."""

    @property
    def local_trajectories(self) -> int:
        """Trajectories of this rank's share."""
        return sum(len(m.rows) for m in self.micro_batches)

    def to_json(self) -> Json:
        """The plan as sent on the wire (see the module docstring for the layout)."""
        return {
            "plan_id": str(self.plan_id),
            "job": self.job,
            "rank": self.rank,
            "step": self.step,
            "mini_batch_index": self.mini_batch_index,
            "global_index": self.global_index,
            "policy_version": self.policy_version,
            "num_tokens": self.num_tokens,
            "micro_batches": [
                {
                    "index": m.index,
                    "num_tokens": m.num_tokens,
                    "rows": [
                        {
                            "group_id": r.group_id,
                            "unit_id": r.unit_id,
                            "node_id": r.node_id,
                            "row": r.row,
                            "num_tokens": r.num_tokens,
                        }
                        for r in m.rows
                    ],
                    "fetches": [
                        {"node_id": f.node_id, "endpoint": f.endpoint, "ticket": f.ticket.encode().decode()}
                        for f in m.fetches
                    ],
                    "media": [
                        {
                            "hash": e.hash,
                            "node_id": e.node_id,
                            "endpoint": e.endpoint,
                            "ticket": e.ticket.encode().decode(),
                        }
                        for e in m.media
                    ],
                }
                for m in self.micro_batches
            ],
            "mini_batch_trajectories": self.mini_batch_trajectories,
            "admitted_at": self.admitted_at,
        }

    @classmethod
    def from_json(cls, body: object) -> RankPlan:
        """Read a plan from its JSON form strictly.

        Raises:
            InvalidRequest: a field is missing, unknown, of the wrong type, or contradicts another
                (the message names it, e.g. ``plan field micro_batches[0].rows[3].row``).
        """
        d = _object(body, "", _PLAN_FIELDS, optional=("mini_batch_trajectories", "admitted_at"))
        text = _str(d, "plan_id", "")
        plan_id = PlanId.parse(text)
        if plan_id is None:
            raise InvalidRequest(f"plan field 'plan_id' {text!r} is not of the form n<index>.a<attempt>.r<rank>")
        rank, n = _int(d, "rank", ""), _int(d, "global_index", "")
        if plan_id.rank != rank or plan_id.n != n:
            raise InvalidRequest(
                f"plan field 'plan_id' {text!r} does not match rank {rank} and global_index {n} of the plan"
            )
        micro = d["micro_batches"]
        if not isinstance(micro, list):
            raise InvalidRequest("plan field 'micro_batches' must be a list")
        trajectories = d.get("mini_batch_trajectories")
        if trajectories is not None:
            trajectories = _int(d, "mini_batch_trajectories", "")
        admitted = d.get("admitted_at")
        if admitted is not None:
            if not isinstance(admitted, int | float) or isinstance(admitted, bool):
                raise InvalidRequest(f"plan field 'admitted_at' must be a number or null, not {admitted!r}")
            admitted = float(admitted)
        return cls(
            plan_id=plan_id,
            job=_str(d, "job", ""),
            rank=rank,
            step=_int(d, "step", ""),
            mini_batch_index=_int(d, "mini_batch_index", ""),
            global_index=n,
            policy_version=_int(d, "policy_version", ""),
            num_tokens=_int(d, "num_tokens", ""),
            micro_batches=tuple(_micro_batch(m, f"micro_batches[{i}]") for i, m in enumerate(micro)),
            mini_batch_trajectories=trajectories,
            admitted_at=admitted,
        )


_PLAN_FIELDS = (
    "plan_id",
    "job",
    "rank",
    "step",
    "mini_batch_index",
    "global_index",
    "policy_version",
    "num_tokens",
    "micro_batches",
    "mini_batch_trajectories",
    "admitted_at",
)


def _field(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _object(value: object, path: str, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``value`` as a JSON object with exactly ``fields`` (those in ``optional`` may be missing)."""
    if isinstance(value, dict) and len(value) == len(fields) and value.keys() == _key_set(fields):
        return value  # the usual case, checked at once
    where = f"plan field {path!r}" if path else "a plan"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object, not {type(value).__name__}")
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise InvalidRequest(f"{where} has unknown fields: {sorted(map(str, unknown))}")
    missing = [k for k in fields if k not in value and k not in optional]
    if missing:
        raise InvalidRequest(f"{where} lacks fields: {missing}")
    return value


@functools.cache
def _key_set(fields: tuple[str, ...]) -> frozenset[str]:
    return frozenset(fields)


def _int(d: Mapping[str, Any], key: str, path: str) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"plan field {_field(path, key)!r} must be an integer >= 0, not {value!r}")
    return value


def _str(d: Mapping[str, Any], key: str, path: str) -> str:
    value = d[key]
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"plan field {_field(path, key)!r} must be a non-empty string, not {value!r}")
    return value


def _list(d: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = d[key]
    if not isinstance(value, list):
        raise InvalidRequest(f"plan field {_field(path, key)!r} must be a list, not {type(value).__name__}")
    return value


def _ticket(d: Mapping[str, Any], path: str, kind: Literal["rows", "media"]) -> Ticket:
    text = _str(d, "ticket", path)
    try:
        ticket = Ticket.decode(text.encode())
    except InvalidTicket as exc:
        raise InvalidRequest(f"plan field {_field(path, 'ticket')!r}: {exc}") from None
    if ticket.kind != kind:
        raise InvalidRequest(f"plan field {_field(path, 'ticket')!r} must be a {kind!r} ticket, not {ticket.kind!r}")
    return ticket


def _row(value: object, path: str) -> PlanRow:
    d = _object(value, path, ("group_id", "unit_id", "node_id", "row", "num_tokens"))
    g, u, n, row, tokens = d["group_id"], d["unit_id"], d["node_id"], d["row"], d["num_tokens"]
    # the usual case (a plan has a row per trajectory), checked at once; else each field with its error
    ok = type(g) is type(u) is type(n) is str and g and u and n and type(row) is type(tokens) is int
    if ok and row >= 0 and tokens >= 0:
        return PlanRow(group_id=g, unit_id=u, node_id=n, row=row, num_tokens=tokens)
    return PlanRow(
        group_id=_str(d, "group_id", path),
        unit_id=_str(d, "unit_id", path),
        node_id=_str(d, "node_id", path),
        row=_int(d, "row", path),
        num_tokens=_int(d, "num_tokens", path),
    )


def _fetch(value: object, path: str) -> RowFetch:
    d = _object(value, path, ("node_id", "endpoint", "ticket"))
    return RowFetch(
        node_id=_str(d, "node_id", path), endpoint=_str(d, "endpoint", path), ticket=_ticket(d, path, "rows")
    )


def _media(value: object, path: str) -> MediaFetch:
    d = _object(value, path, ("hash", "node_id", "endpoint", "ticket"))
    media_hash = d["hash"]
    if not is_content_hash(media_hash):
        raise InvalidRequest(
            f"plan field {_field(path, 'hash')!r} must be 64 lower-case hex characters, not {media_hash!r}"
        )
    return MediaFetch(
        hash=media_hash,
        node_id=_str(d, "node_id", path),
        endpoint=_str(d, "endpoint", path),
        ticket=_ticket(d, path, "media"),
    )


def _micro_batch(value: object, path: str) -> MicroBatchReads:
    d = _object(value, path, ("index", "num_tokens", "rows", "fetches", "media"))
    return MicroBatchReads(
        index=_int(d, "index", path),
        num_tokens=_int(d, "num_tokens", path),
        rows=tuple(_row(r, f"{path}.rows[{i}]") for i, r in enumerate(_list(d, "rows", path))),
        fetches=tuple(_fetch(f, f"{path}.fetches[{i}]") for i, f in enumerate(_list(d, "fetches", path))),
        media=tuple(_media(m, f"{path}.media[{i}]") for i, m in enumerate(_list(d, "media", path))),
    )
