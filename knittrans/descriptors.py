"""Unit descriptors: what a writer tells the control plane about a sealed storage unit."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields
from typing import Any

from knittrans.errors import InvalidRequest
from knittrans.names import check_name, is_content_hash

__all__ = ["GROUP_FIELDS", "UNIT_FIELDS", "GroupRecord", "UnitDescriptor"]


SCHEMA_VERSION = 1
"""Version of the trajectory and media Arrow schemas (:mod:`knittrans.columns` stores it in their metadata),
checked on every read and put; the one version descriptors may name."""
MAX_INT32 = (1 << 31) - 1
"""Largest version, row or token count a descriptor may carry (the Arrow columns are int32)."""
MAX_COUNT = (1 << 53) - 1
"""Largest byte count a descriptor may carry (exact in a JSON double)."""


def _check_int(value: object, what: str, *, limit: int = MAX_INT32) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise InvalidRequest(f"{what} {value!r} must be an integer in [0, {limit}]")


def _plain_counts(values: tuple[object, ...]) -> bool:
    """True when every value is a plain ``int`` in ``[0, MAX_INT32]``, checked in C loops; False also for ``int``
    subclasses, which :func:`_check_int` then takes value by value."""
    if set(map(type, values)) != {int}:
        return False
    return min(values) >= 0 and max(values) <= MAX_INT32  # type: ignore[type-var,operator]


@dataclass(frozen=True, kw_only=True)
class GroupRecord:
    """One GRPO group inside a unit: its rows are ``[row_start, row_start + num_trajectories)``."""

    group_id: str
    """Group id, unique within the job."""
    source: str
    """Data source the prompt came from."""
    row_start: int
    """First row of the group in the unit."""
    num_trajectories: int
    """Rows (responses) in the group."""
    trajectory_tokens: tuple[int, ...]
    """Prompt + response tokens of each trajectory, in row order."""
    version_start: int
    """Smallest policy version at which any trajectory of the group started."""
    version_end: int
    """Largest policy version that produced a token of the group."""
    version_weighted: float
    """Token-weighted mean policy version of the group's response tokens."""
    finished_at: float
    """Unix time (seconds) at which the last trajectory of the group finished."""
    media_hashes: tuple[str, ...] = ()
    """Hex content hashes of the unique media the group uses."""

    def __post_init__(self) -> None:
        check_name(self.group_id, "group_id")
        check_name(self.source, "source")
        if self.num_trajectories <= 0 or len(self.trajectory_tokens) != self.num_trajectories:
            raise InvalidRequest(
                f"group {self.group_id!r}: num_trajectories={self.num_trajectories} but "
                f"{len(self.trajectory_tokens)} token counts"
            )
        if self.version_end < self.version_start:
            raise InvalidRequest(f"group {self.group_id!r}: version_end < version_start")
        for name in ("row_start", "version_start", "version_end"):
            _check_int(getattr(self, name), f"group {self.group_id!r}: {name}")
        tokens = self.trajectory_tokens
        if not _plain_counts(tokens):  # find and name the bad one
            for t in tokens:
                _check_int(t, f"group {self.group_id!r}: trajectory_tokens")
        vw = self.version_weighted
        if (
            not isinstance(vw, int | float)
            or not math.isfinite(vw)
            or not (self.version_start - 1e-3 <= vw <= self.version_end + 1e-3)
        ):
            raise InvalidRequest(
                f"group {self.group_id!r}: version_weighted {vw!r} must be a finite number in "
                f"[version_start, version_end] = [{self.version_start}, {self.version_end}]"
            )
        if not isinstance(self.finished_at, int | float) or not math.isfinite(self.finished_at) or self.finished_at < 0:
            raise InvalidRequest(
                f"group {self.group_id!r}: finished_at {self.finished_at!r} must be a finite non-negative Unix time"
            )
        for h in self.media_hashes:
            if not is_content_hash(h):
                raise InvalidRequest(f"group {self.group_id!r}: media hash {h!r} is not 64 lower-case hex characters")


@dataclass(frozen=True, kw_only=True)
class UnitDescriptor:
    """A sealed, immutable storage unit: where it lives and which groups it holds."""

    unit_id: str
    """Unit id, unique within the job."""
    job: str
    """Job the unit belongs to."""
    node_id: str
    """Store node that owns the unit."""
    endpoint: str
    """Flight location of that node, e.g. ``grpc://127.0.0.1:8815``."""
    num_rows: int
    """Trajectory rows in the unit."""
    num_bytes: int
    """Bytes of the sealed IPC file (trajectories and media)."""
    schema_version: int
    """Trajectory schema version the unit was written with."""
    groups: tuple[GroupRecord, ...]
    """Groups in row order; together they cover ``[0, num_rows)`` exactly."""

    def __post_init__(self) -> None:
        check_name(self.unit_id, "unit_id")
        check_name(self.job, "job")
        check_name(self.node_id, "node_id")
        _check_int(self.num_bytes, f"unit {self.unit_id!r}: num_bytes", limit=MAX_COUNT)
        if self.schema_version != SCHEMA_VERSION:
            raise InvalidRequest(
                f"unit {self.unit_id!r}: schema_version {self.schema_version!r} is not "
                f"supported (expected {SCHEMA_VERSION})"
            )
        row = 0
        for g in self.groups:
            if g.row_start != row:
                raise InvalidRequest(
                    f"unit {self.unit_id!r}: group {g.group_id!r} starts at row {g.row_start}, expected {row}"
                )
            row += g.num_trajectories
        if row != self.num_rows:
            raise InvalidRequest(f"unit {self.unit_id!r}: groups cover {row} rows, unit has {self.num_rows}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (what :func:`dataclasses.asdict` gives, without its deep copy)."""
        values = dict(zip(UNIT_FIELDS, _unit_values(self), strict=True))
        values["groups"] = tuple(dict(zip(GROUP_FIELDS, _group_values(g), strict=True)) for g in self.groups)
        return values

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UnitDescriptor:
        """Inverse of :meth:`to_dict`; raises :class:`InvalidRequest` for bad fields."""
        try:
            groups = tuple(
                GroupRecord(
                    **{
                        **g,
                        "trajectory_tokens": tuple(g["trajectory_tokens"]),
                        "media_hashes": tuple(g.get("media_hashes", ())),
                    }
                )
                for g in d["groups"]
            )
            return cls(**{**d, "groups": groups})
        except (KeyError, TypeError) as exc:
            raise InvalidRequest(f"bad unit descriptor: {exc}") from None


GROUP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GroupRecord))
"""Fields of :class:`GroupRecord` in order: its JSON object and ``GroupIn`` of the API follow this list
(a test checks ``GroupIn``)."""
UNIT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(UnitDescriptor))
"""Fields of :class:`UnitDescriptor` in order (``UnitIn`` of the API follows this list)."""

_group_values = operator.attrgetter(*GROUP_FIELDS)
_unit_values = operator.attrgetter(*UNIT_FIELDS)


_new = object.__new__
_setattr = object.__setattr__


def checked_group(values: dict[str, Any]) -> GroupRecord:
    """A :class:`GroupRecord` whose ``values`` (every field of :data:`GROUP_FIELDS`, in that order, with
    tuples where it has tuples) the caller has already checked, without its per-field checks: the
    writer describing the tables it built and validated. Takes ``values`` over as the record's fields."""
    group = _new(GroupRecord)
    _setattr(group, "__dict__", values)
    return group
