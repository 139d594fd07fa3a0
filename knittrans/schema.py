"""Arrow schemas of trajectories and media, a vectorised builder, and a validator naming column and row."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from knittrans.columns import (
    HASH_TYPE as _HASH,
)
from knittrans.columns import (
    MEDIA_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TABLE_KIND_KEY,
    TRAJECTORY_COLUMNS,
    TRAJECTORY_SCHEMA,
)
from knittrans.errors import InvalidRequest, SchemaMismatch
from knittrans.userfields import USER_FIELD_NAME_RE, UserField, is_primitive_numeric

__all__ = [
    "EMPTY_MEDIA",
    "MEDIA_SCHEMA",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "TABLE_KIND_KEY",
    "TRAJECTORY_COLUMNS",
    "TRAJECTORY_SCHEMA",
    "Media",
    "TrajectoryGroup",
    "UnitTables",
    "build_media_table",
    "build_unit_tables",
    "build_units_tables",
    "build_user_column",
    "check_schema",
    "validate_media",
    "validate_part",
    "validate_trajectories",
]

_SCHEMAS = {"trajectories": TRAJECTORY_SCHEMA, "media": MEDIA_SCHEMA}
EMPTY_MEDIA: pa.Table = MEDIA_SCHEMA.empty_table()
"""The media table of a unit without media (Arrow tables are immutable: one shared instance)."""
_INT32 = np.dtype(np.int32)


def check_schema(schema: pa.Schema, kind: Literal["trajectories", "media"] = "trajectories") -> None:
    """Raise :class:`SchemaMismatch` unless ``schema`` is ours (types, order, version).

    Units and puts must carry every fixed column; a trajectory table may carry per-job user fields
    (:mod:`knittrans.userfields`) after them, which this check accepts by name only (the job spec
    declares their types).
    """
    expected = _SCHEMAS[kind]
    if schema.equals(expected, check_metadata=True):  # the common case, in C++
        return
    meta = schema.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY)
    if version != str(SCHEMA_VERSION).encode():
        got = version.decode(errors="replace") if version is not None else "none"
        raise SchemaMismatch(f"{kind} schema version is {got}, expected {SCHEMA_VERSION}")
    if meta.get(TABLE_KIND_KEY) != kind.encode():
        raise SchemaMismatch(f"schema is tagged {meta.get(TABLE_KIND_KEY)!r}, expected {kind!r}")
    names = schema.names
    if kind == "trajectories" and len(names) > len(expected.names) and names[: len(expected.names)] == expected.names:
        for extra in names[len(expected.names) :]:  # per-job user fields follow the fixed columns
            if not USER_FIELD_NAME_RE.match(extra) or extra in expected.names or names.count(extra) > 1:
                raise SchemaMismatch(f"{kind} user column {extra!r} is not a valid, unique user field name")
        schema = pa.schema(list(schema)[: len(expected.names)], metadata=schema.metadata)
    if schema.names != expected.names:
        missing = [n for n in expected.names if n not in schema.names]
        extra = [n for n in schema.names if n not in expected.names]
        raise SchemaMismatch(f"{kind} columns differ: missing {missing}, unexpected {extra}, order {schema.names}")
    for got_f, want_f in zip(schema, expected, strict=True):
        if not got_f.type.equals(want_f.type):
            raise SchemaMismatch(f"{kind} column {got_f.name!r} has type {got_f.type}, expected {want_f.type}")


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def validate_trajectories(table: pa.Table) -> None:
    """Check schema and per-row invariants; the error names the offending column and row."""
    check_schema(table.schema, "trajectories")
    for name in table.column_names:
        if table.column(name).null_count:
            row = _first_bad(table.column(name).is_null().to_numpy(zero_copy_only=False))
            raise InvalidRequest(f"column {name!r} is null at row {row}")
    resp_len = pc.list_value_length(table.column("response_ids")).to_numpy()
    for name in ("response_logprobs", "loss_mask"):
        n = pc.list_value_length(table.column(name)).to_numpy()
        if n.shape != resp_len.shape or (n != resp_len).any():
            row = _first_bad(n != resp_len)
            raise InvalidRequest(
                f"column {name!r} has length {int(n[row])} != response_ids length {int(resp_len[row])} at row {row}"
            )
    for name in ("prompt_ids", "response_ids"):
        tokens = pc.list_flatten(table.column(name))
        if len(tokens) and pc.min(tokens).as_py() < 0:
            lens = pc.list_value_length(table.column(name)).to_numpy()
            first = int(np.flatnonzero(tokens.to_numpy() < 0)[0])
            row = int(np.searchsorted(np.cumsum(lens), first, side="right"))
            raise InvalidRequest(f"column {name!r} holds a negative token id at row {row}")
    mask = pc.list_flatten(table.column("loss_mask"))
    if len(mask) and pc.max(mask).as_py() > 1:
        raise InvalidRequest("column 'loss_mask' holds a value other than 0 or 1")
    vs = table.column("version_start").to_numpy()
    ve = table.column("version_end").to_numpy()
    if (ve < vs).any():
        row = _first_bad(ve < vs)
        raise InvalidRequest(f"column 'version_end' ({ve[row]}) < version_start ({vs[row]}) at row {row}")
    vw = table.column("version_weighted").to_numpy()
    bad = ~((vw >= vs - 1e-3) & (vw <= ve + 1e-3))
    if bad.any():
        row = _first_bad(bad)
        raise InvalidRequest(
            f"column 'version_weighted' ({vw[row]}) is outside [version_start, version_end] at row {row}"
        )
    ids = table.column("traj_id")
    if pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        dup = next(str(v["values"]) for v in counts.to_pylist() if v["counts"] > 1)
        row = ids.to_pylist().index(dup)
        raise InvalidRequest(f"column 'traj_id' value {dup!r} is duplicated (first at row {row})")


def validate_media(table: pa.Table) -> None:
    """Check the media schema, that every hash is unique and that each is the SHA-256 :attr:`Media.hash` of its
    row's content; errors name the row."""
    check_schema(table.schema, "media")
    cols = [table.column(c).to_pylist() for c in ("media_hash", "kind", "dtype", "shape")]
    data = table.column("data")
    seen: set[bytes] = set()
    for row, (want, kind, dtype, shape) in enumerate(zip(*cols, strict=True)):
        if want in seen:
            raise InvalidRequest(f"column 'media_hash' is duplicated at row {row}")
        seen.add(want)
        got = _media_hash(kind, dtype, shape, memoryview(data[row].as_buffer()))
        if got != want:
            raise InvalidRequest(
                f"media row {row}: media_hash {bytes(want).hex()} is not the SHA-256 of its "
                f"kind, dtype, shape and bytes ({got.hex()})"
            )


def validate_part(batch: pa.RecordBatch | pa.Table, part: Literal["traj", "media"]) -> None:
    """Content checks for one uploaded batch of a unit part (what a store's ``DoPut`` accepts).

    Trajectories: no nulls, per-row list lengths (``loss_mask``/``response_logprobs`` match
    ``response_ids``), token ids ≥ 0, mask values 0/1, version order; media: unique rows and
    hashes that are SHA-256 of the content. Extend here when columns are added.
    """
    table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
    if part == "traj":
        validate_trajectories(table)
    else:
        validate_media(table)


def as_numpy(value: Any) -> np.ndarray:
    """``value`` (a list, numpy array or torch tensor) as a numpy array, without importing torch."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _to_numpy(value: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """numpy view of a list/array/tensor as a 1-D array of ``dtype`` (copies only to cast)."""
    arr = as_numpy(value).reshape(-1)
    return arr if arr.dtype == dtype else arr.astype(dtype)


def _pooled(n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised 1-D array of ``n`` values from Arrow's memory pool.

    glibc gives back the freed top of its heap once it passes its trim threshold, so the few MB a
    build concatenates would land on fresh pages every time; Arrow's allocator keeps freed pages for
    the next build. The array keeps its buffer alive."""
    return np.frombuffer(pa.allocate_buffer(n * dtype.itemsize), dtype=dtype)


def _list_values(
    rows: Sequence[Any], dtype: np.dtype[Any], too_many: str | None = "write smaller units"
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row sequences as one values array of ``dtype`` and int64 row offsets (one concatenate).

    Rows numpy can concatenate as they are (1-D arrays or lists: the usual case) are joined in one
    call and cast once; anything else (scalars, 2-D rows, GPU tensors) is converted row by row first.
    ``too_many`` is the advice of the error when the values do not fit int32 offsets (None: no such limit).
    """
    try:
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        values = _pooled(int(lengths.sum()), dtype)
        if len(rows):  # cast as ``astype`` would; a row that is not 1-D does not fit ``values``
            np.concatenate(rows, out=values, casting="unsafe")
    except (TypeError, ValueError, RuntimeError):
        parts = [_to_numpy(r, dtype) for r in rows]  # rows is not empty: the concatenate failed
        lengths = np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts))
        values = np.concatenate(parts)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if too_many is not None and offsets[-1] >= 2**31:
        raise InvalidRequest(f"{offsets[-1]} list values do not fit int32 offsets; {too_many}")
    return values, offsets


def _media_hash(kind: str, dtype: str, shape: Sequence[int], payload: bytes | memoryview) -> bytes:
    """SHA-256 over a header line ``kind|dtype|[shape]`` and the payload: :attr:`Media.hash`."""
    h = hashlib.sha256(f"{kind}|{dtype}|{list(shape)}\n".encode())
    h.update(payload)
    return h.digest()


@dataclass(frozen=True, kw_only=True)
class Media:
    """One media item (image, audio, ...): raw bytes (e.g. encoded PNG) or a numpy/torch array."""

    kind: str
    """What it is, e.g. ``image`` or ``audio``."""
    data: Any
    """``bytes`` or a numpy array / torch tensor (stored C-contiguous with its dtype and shape)."""

    @cached_property
    def _parts(self) -> tuple[str, tuple[int, ...], bytes]:
        if isinstance(self.data, bytes | bytearray | memoryview):
            raw = bytes(self.data)
            return "bytes", (len(raw),), raw
        value = self.data
        if hasattr(value, "detach"):  # torch.Tensor
            t = value.detach().cpu().contiguous()
            name = str(t.dtype).removeprefix("torch.")
            if name == "bfloat16":
                import torch

                return name, tuple(t.shape), t.view(torch.int16).numpy().tobytes()
            value = t.numpy()
        arr = np.ascontiguousarray(value)
        return str(arr.dtype), tuple(int(x) for x in arr.shape), arr.tobytes()

    @property
    def dtype(self) -> str:
        """``bytes`` for raw bytes, else the numpy/torch dtype name."""
        return self._parts[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """Array shape, ``(len,)`` for raw bytes."""
        return self._parts[1]

    @property
    def payload(self) -> bytes:
        """Stored bytes."""
        return self._parts[2]

    @cached_property
    def hash(self) -> bytes:
        """SHA-256 over ``kind|dtype|shape`` and the payload (32 bytes)."""
        return _media_hash(self.kind, self.dtype, self.shape, self.payload)

    @property
    def hex(self) -> str:
        """Lower-case hex of :attr:`hash` (the form tickets and descriptors use)."""
        return self.hash.hex()


def build_media_table(media: Sequence[Media]) -> pa.Table:
    """Media table with one row per unique hash, in first-seen order."""
    unique: dict[bytes, Media] = {}
    for m in media:
        unique.setdefault(m.hash, m)
    items = list(unique.values())
    if not items:
        return EMPTY_MEDIA
    return pa.Table.from_arrays(
        [
            pa.array([m.hash for m in items], type=_HASH),
            pa.array([m.kind for m in items], type=pa.string()),
            pa.array([m.shape for m in items], type=pa.list_(pa.int32())),
            pa.array([m.dtype for m in items], type=pa.string()),
            pa.array([m.payload for m in items], type=pa.large_binary()),
        ],
        schema=MEDIA_SCHEMA,
    )


def _per_row(value: Any, n: int, what: str, group_id: str) -> list[Any]:
    """Broadcast a scalar to ``n`` rows or check a sequence has ``n`` entries."""
    if value is None or np.isscalar(value):
        return [value] * n
    seq = list(value)
    if len(seq) != n:
        raise InvalidRequest(f"group {group_id!r}: {what} has {len(seq)} entries for {n} responses")
    return seq


@dataclass(frozen=True, kw_only=True)
class TrajectoryGroup:
    """The ``n`` responses to one prompt (a GRPO group), as handed to :func:`build_unit_tables`."""

    group_id: str
    """Group id, unique within the job."""
    source: str
    """Data source of the prompt."""
    prompt_ids: Any = None
    """Prompt token ids (list, numpy array or torch tensor), shared by every response; ignored
    when :attr:`response_prompt_ids` is given."""
    response_ids: Sequence[Any]
    """Token ids of each response."""
    response_logprobs: Sequence[Any]
    """Sampling log-probabilities, one per response token."""
    rewards: Any
    """One reward per response."""
    advantages: Any = None
    """One advantage per response; None means GRPO's ``(r - mean) / (std + 1e-6)`` over the group."""
    version_start: Any = 0
    """Policy version at which each response started (int for all, or one per response); 0 by
    default, for plain transfer without version tracking."""
    version_end: Any = None
    """Policy version of each response's last token (int or one per response); None means
    ``version_start``."""
    version_weighted: Any = None
    """Token-weighted version per response; None means the mean of start and end."""
    loss_masks: Sequence[Any] | None = None
    """Per-response masks over response tokens (1 = trained); None means all ones."""
    media: Sequence[Media] = ()
    """Media every response of the group uses (e.g. the prompt's image), in order."""
    response_media: Sequence[Sequence[Media]] | None = None
    """Extra media per response (e.g. tool outputs), appended after :attr:`media`."""
    finished_at: Any = None
    """Unix seconds each response finished (float or one per response); None means now."""
    traj_ids: Sequence[str] | None = None
    """Trajectory ids; None means ``<group_id>.<i>``."""
    response_prompt_ids: Sequence[Any] | None = None
    """A prompt per response (multi-turn or agentic rollouts whose contexts differ), instead of
    the shared :attr:`prompt_ids`."""
    user_fields: Mapping[str, Any] | None = None
    """Values of the job's declared user fields: ``{name: one value per response}`` (or one value
    for all responses when the field is listed in ``shared_user_fields``)."""
    shared_user_fields: frozenset[str] = frozenset()
    """User fields given once for the whole group (e.g. a per-prompt value), repeated per row."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if n == 0:
            raise InvalidRequest(f"group {self.group_id!r} has no responses")
        if self.prompt_ids is None and self.response_prompt_ids is None:
            raise InvalidRequest(
                f"group {self.group_id!r}: give prompt_ids (shared) or response_prompt_ids (per response)"
            )
        if len(self.response_logprobs) != n:
            raise InvalidRequest(
                f"group {self.group_id!r}: {len(self.response_logprobs)} logprob lists for {n} responses"
            )

    @property
    def num_responses(self) -> int:
        """Responses (rows) in the group."""
        return len(self.response_ids)


@dataclass(frozen=True)
class UnitTables:
    """The two tables of one storage unit."""

    traj: pa.Table
    """Trajectory rows, :data:`TRAJECTORY_SCHEMA`."""
    media: pa.Table
    """Unique media, :data:`MEDIA_SCHEMA` (possibly empty)."""


def build_unit_tables(groups: Sequence[TrajectoryGroup], *, user_fields: Sequence[UserField] = ()) -> UnitTables:
    """Build (and validate) the trajectory and media tables for whole groups, rows in group order.

    ``user_fields`` are the job's declared extra columns; every group must give each of them
    (:attr:`TrajectoryGroup.user_fields`) and nothing else.
    """
    return build_units_tables([groups], user_fields=user_fields)[0]


def build_units_tables(
    units: Sequence[Sequence[TrajectoryGroup]], *, user_fields: Sequence[UserField] = ()
) -> list[UnitTables]:
    """:func:`build_unit_tables` for several units at once (one per group list), in order.

    The rows of every unit are gathered together (one concatenation per column) and made into
    Arrow arrays once; each unit's numeric and list columns are slices of those (zero-copy), its
    string columns (with its own ``source`` dictionary), media table (deduplicated within the unit)
    and user-field columns its own: each unit holds the table :func:`build_unit_tables` gives for
    its groups alone, and its IPC files have the same size (Arrow's writer pads a sliced buffer with
    the bytes that follow it in the shared buffer instead of zeros). The rows are validated in one
    pass; errors name the group, or the unit (its index in ``units``) and the row within it.
    """
    for groups in units:
        if not groups:
            raise InvalidRequest("a unit needs at least one group")
    rows = _TrajectoryRows([g for groups in units for g in groups], time.time())
    whole = rows.arrays()  # once, not per unit
    out: list[UnitTables] = []
    start = 0
    for groups in units:
        stop = start + sum(g.num_responses for g in groups)
        # strings built per unit: Arrow writes a sliced string array's data buffer from the slice's first
        # value to the buffer's end (the later units' ids in every file); the source dictionary is the unit's
        arrays = [*rows.string_arrays(start, stop), *(a.slice(start, stop - start) for a in whole)]
        schema = TRAJECTORY_SCHEMA
        if user_fields or any(g.user_fields for g in groups):
            arrays += _user_arrays(groups, user_fields)
            schema = pa.schema(
                [*TRAJECTORY_SCHEMA, *(pa.field(f.name, f.type, nullable=False) for f in user_fields)],
                metadata=TRAJECTORY_SCHEMA.metadata,
            )
        traj = pa.Table.from_arrays(arrays, schema=schema)
        media = build_media_table([m for ms in rows.media[start:stop] for m in ms])
        out.append(UnitTables(traj=traj, media=media))
        start = stop
    # checked on the numpy buffers the tables are views of; only rows that may fail a check go through the
    # Arrow checks, whose errors name the column, unit and row (media tables are built one row per hash)
    if not rows.plainly_valid() or _user_column_nulls(out):
        _check_rows(out)
    return out


def _user_column_nulls(units: list[UnitTables]) -> bool:
    """Whether any unit has a null in a user-field column (the numpy check sees the fixed columns only)."""
    fixed = len(TRAJECTORY_COLUMNS)
    return any(u.traj.column(c).null_count for u in units for c in u.traj.column_names[fixed:])


def _check_rows(units: list[UnitTables]) -> None:
    """The Arrow checks of the trajectory rows, unit by unit (a ``traj_id`` repeated across units is allowed);
    with several units the error names the unit as well as the column and row."""
    for k, u in enumerate(units):
        try:
            validate_trajectories(u.traj)
        except InvalidRequest as exc:
            if len(units) == 1:
                raise
            raise InvalidRequest(f"unit {k} (of {len(units)}): {exc}") from None


class _TrajectoryRows:
    """The fixed trajectory columns of groups as numpy buffers, gathered with one Python step per group
    (not per row); :meth:`arrays` gives them as Arrow arrays that are views of them."""

    def __init__(self, groups: Sequence[TrajectoryGroup], now: float) -> None:
        sizes = np.fromiter((g.num_responses for g in groups), dtype=np.int64, count=len(groups))
        starts = np.zeros(len(groups), dtype=np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        traj_ids: list[str] = []
        group_ids: list[str] = []
        sources: list[str] = []
        prompts: list[Any] = []
        responses: list[Any] = []
        logprobs: list[Any] = []
        masks: list[Any] = []
        self.media: list[tuple[Media, ...]] = []
        """Media of each row (the group's, then the row's own), in row order."""
        media_hashes: list[bytes] = []
        media_counts: list[int] = []
        for g in groups:
            n, gid = g.num_responses, g.group_id
            if g.traj_ids is not None:
                ids = list(g.traj_ids)
                if len(ids) != n:
                    raise InvalidRequest(f"group {gid!r}: traj_ids has the wrong number of entries")
                traj_ids += ids
            else:
                traj_ids += [f"{gid}.{i}" for i in range(n)]
            group_ids += [gid] * n
            sources += [g.source] * n
            if g.response_prompt_ids is not None:
                prompts += _per_row(g.response_prompt_ids, n, "response_prompt_ids", gid)
            else:
                prompts += [_to_numpy(g.prompt_ids, _INT32)] * n
            responses += g.response_ids
            logprobs += g.response_logprobs
            masks += [None] * n if g.loss_masks is None else _per_row(g.loss_masks, n, "loss_masks", gid)
            if g.response_media:
                for extra in _per_row(g.response_media, n, "response_media", gid):
                    row_media = (*g.media, *extra)
                    self.media.append(row_media)
                    media_hashes += [m.hash for m in row_media]
                    media_counts.append(len(row_media))
            else:  # every row uses the group's media (often none)
                shared = tuple(g.media)
                self.media += [shared] * n
                media_hashes += [m.hash for m in shared] * n
                media_counts += [len(shared)] * n
        reward = _gathered(groups, sizes, "rewards")
        given_adv = [g.advantages is not None for g in groups]
        advantage = _gathered(groups, sizes, "advantages", default=reward) if any(given_adv) else reward
        vs_all = _gathered(groups, sizes, "version_start")
        ve_all = _gathered(groups, sizes, "version_end", default=vs_all)
        vw_all = _gathered(groups, sizes, "version_weighted", default=(vs_all + ve_all) / 2)
        fin_all = _gathered(groups, sizes, "finished_at", default=np.full(len(reward), now))
        if not all(given_adv):  # GRPO: each group's rewards normalised by its own mean and std
            mean = np.add.reduceat(reward, starts) / sizes
            centred = reward - np.repeat(mean, sizes)
            std = np.sqrt(np.add.reduceat(centred * centred, starts) / sizes)
            grpo = centred / np.repeat(std + 1e-6, sizes)
            advantage = np.where(np.repeat(~np.asarray(given_adv), sizes), grpo, advantage)
        self.strings = (traj_ids, group_ids, sources)
        response_ids = _list_values(responses, _INT32)
        if all(m is None for m in masks):
            ones = _pooled(len(response_ids[0]), np.dtype(np.uint8))
            ones.fill(1)
            mask_values = (ones, response_ids[1])
        else:
            lengths = np.diff(response_ids[1])
            filled = [np.ones(int(k), np.uint8) if m is None else m for m, k in zip(masks, lengths, strict=True)]
            mask_values = _list_values(filled, np.dtype(np.uint8))
        self.lists = (
            _list_values(prompts, _INT32),
            response_ids,
            _list_values(logprobs, np.dtype(np.float32)),
            mask_values,
        )
        self.numbers = (
            reward.astype(np.float32),
            advantage.astype(np.float32),
            _int32_versions(vs_all, "version_start", groups, starts),
            _int32_versions(ve_all, "version_end", groups, starts),
            vw_all.astype(np.float32),
        )
        media_offsets = np.zeros(len(media_counts) + 1, dtype=np.int64)
        np.cumsum(media_counts, out=media_offsets[1:])
        self.media_refs = (media_hashes, media_offsets)
        self.finished = (fin_all * 1e6).astype("datetime64[us]")

    def plainly_valid(self) -> bool:
        """True when all rows pass :func:`validate_trajectories`'s checks of the fixed columns (no nulls, list
        lengths, token ids, mask values, versions, ``traj_id`` unique among all rows), checked on the numpy
        buffers; False when any might fail (or a ``traj_id`` repeats across units, which is allowed): the
        caller then runs the Arrow checks, which decide and name the row."""
        if any(None in column for column in self.strings):  # a null string
            return False
        (prompts, _), (responses, offsets), (_, lp_offsets), (mask, mask_offsets) = self.lists
        if not (np.array_equal(lp_offsets, offsets) and np.array_equal(mask_offsets, offsets)):
            return False
        if (len(prompts) and prompts.min() < 0) or (len(responses) and responses.min() < 0):
            return False
        if len(mask) and mask.max() > 1:
            return False
        vs, ve, vw = self.numbers[2:]
        if (ve < vs).any() or not ((vw >= vs - 1e-3) & (vw <= ve + 1e-3)).all():
            return False
        if np.isnat(self.finished).any():  # a NaN finish time: a null timestamp
            return False
        traj_ids = self.strings[0]
        return len(set(traj_ids)) == len(traj_ids)

    def string_arrays(self, start: int, stop: int) -> list[pa.Array]:
        """The string columns (``traj_id``, ``group_id``, ``source`` with its own dictionary) of rows
        ``[start, stop)``: the first three columns of :data:`TRAJECTORY_SCHEMA`."""
        traj_ids, group_ids, sources = self.strings
        return [
            pa.array(traj_ids[start:stop], type=pa.string()),
            pa.array(group_ids[start:stop], type=pa.string()),
            _dictionary(sources[start:stop]),
        ]

    def arrays(self) -> list[pa.Array]:
        """All rows of the columns after the :meth:`string_arrays`, in :data:`TRAJECTORY_SCHEMA` order (views of
        the buffers)."""
        lists = [_list_array(*v, t) for v, t in zip(self.lists, _LIST_VALUE_TYPES, strict=True)]
        numbers = [pa.array(x) for x in self.numbers]
        return [*lists, *numbers, _list_array(*self.media_refs, _HASH), pa.array(self.finished)]


def _dictionary(values: list[str]) -> pa.DictionaryArray:
    """``pa.array(values).dictionary_encode()`` (int32 indices, first-seen order), without the compute call."""
    codes: dict[str, int] = {}
    indices = [codes.setdefault(v, len(codes)) for v in values]
    return pa.DictionaryArray.from_arrays(
        pa.array(np.asarray(indices, dtype=np.int32)), pa.array(list(codes), type=pa.string())
    )


_LIST_VALUE_TYPES = (pa.int32(), pa.int32(), pa.float32(), pa.uint8())
"""Value types of ``prompt_ids``, ``response_ids``, ``response_logprobs`` and ``loss_mask``."""


def _list_array(values: np.ndarray | list[bytes], offsets: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """A list column as a ListArray over a view of ``values``."""
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=value_type))


def _row_values(value: Any, n: int, what: str, group_id: str, default: np.ndarray | None = None) -> np.ndarray:
    """One float64 per row: a scalar broadcast, or a sequence of ``n`` (None, whole or per entry, takes ``default``)."""
    if value is None and default is not None:
        return default
    seq = _per_row(as_numpy(value) if hasattr(value, "detach") else value, n, what, group_id)
    if default is not None and any(v is None for v in seq):
        seq = [d if v is None else v for v, d in zip(seq, default.tolist(), strict=True)]
    try:
        out = np.asarray(seq, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"group {group_id!r}: {what} must be numbers, one per response: {exc}") from None
    if out.shape != (n,):
        raise InvalidRequest(f"group {group_id!r}: {what} must be one number per response, got shape {out.shape}")
    return out


def _gathered(
    groups: Sequence[TrajectoryGroup], sizes: np.ndarray, what: str, default: np.ndarray | None = None
) -> np.ndarray:
    """Every group's ``what`` as one float64 per row, in row order: what :func:`_row_values` gives group by
    group (a missing value, with ``default``, takes the default's rows), in a few numpy calls for the usual
    inputs (every group a plain int or float; every group a 1-D numeric array of its size; every group
    None) instead of a few per group."""
    values = [getattr(g, what) for g in groups]
    kinds = {type(v) for v in values}
    if kinds <= {int, float}:
        return np.repeat(np.asarray(values, dtype=np.float64), sizes)
    if kinds == {type(None)} and default is not None:
        return default
    if (
        kinds == {np.ndarray}
        and all(v.ndim == 1 and v.dtype.kind in "biuf" for v in values)
        and np.array_equal(np.fromiter((v.shape[0] for v in values), np.int64, len(values)), sizes)
    ):
        return np.concatenate(values).astype(np.float64, copy=False)
    starts = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return np.concatenate(
        [
            _row_values(v, int(n), what, g.group_id, None if default is None else default[a:b])
            for v, g, n, a, b in zip(values, groups, sizes, starts[:-1], starts[1:], strict=True)
        ]
    )


def _int32_versions(values: np.ndarray, name: str, groups: Sequence[TrajectoryGroup], starts: np.ndarray) -> np.ndarray:
    """Versions as int32 (truncating, as ``astype``); a value that is no int32 is an error naming its group."""
    bad = ~(np.isfinite(values) & (values >= -(2**31)) & (values < 2**31))
    if bad.any():
        row = _first_bad(bad)
        k = int(np.searchsorted(starts, row, side="right")) - 1
        raise InvalidRequest(
            f"group {groups[k].group_id!r}: {name} {float(values[row])!r} of response {row - int(starts[k])} "
            "is not a 32-bit integer"
        )
    return values.astype(np.int32)


def _numeric_dtype(t: pa.DataType) -> np.dtype[Any]:
    """numpy dtype of a numeric or boolean Arrow type."""
    return np.dtype(np.bool_) if pa.types.is_boolean(t) else np.dtype(t.to_pandas_dtype())


def build_user_column(field: UserField, values: Sequence[Any]) -> pa.Array:
    """Arrow array of ``field.type`` from one value per row; errors name the field and row."""
    t = field.type
    try:
        if isinstance(t, pa.FixedShapeTensorType):
            dtype = _numeric_dtype(t.value_type)
            rows = [as_numpy(v) for v in values]
            for i, r in enumerate(rows):
                if tuple(r.shape) != tuple(t.shape):
                    raise InvalidRequest(
                        f"user field {field.name!r} row {i}: shape {tuple(r.shape)} != declared {tuple(t.shape)}"
                    )
            stacked = np.stack(rows).astype(dtype, copy=False) if rows else np.zeros((0, *t.shape), dtype)
            return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(stacked))
        if isinstance(t, pa.ListType | pa.LargeListType | pa.FixedSizeListType) and is_primitive_numeric(t.value_type):
            advice = f"declare user field {field.name!r} large_list<>" if pa.types.is_list(t) else None
            flat, offsets = _list_values(values, _numeric_dtype(t.value_type), advice)
            if pa.types.is_fixed_size_list(t):
                sizes = np.diff(offsets)
                if (sizes != t.list_size).any():
                    i = _first_bad(sizes != t.list_size)
                    raise InvalidRequest(
                        f"user field {field.name!r} row {i}: {sizes[i]} values != declared size {t.list_size}"
                    )
                return pa.FixedSizeListArray.from_arrays(pa.array(flat, t.value_type), t.list_size)
            if pa.types.is_large_list(t):
                return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, t.value_type))
            return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat, t.value_type))
        if is_primitive_numeric(t):
            arr = np.asarray([as_numpy(v).reshape(()) for v in values]) if values else np.zeros(0)
            return pa.array(arr.astype(_numeric_dtype(t), copy=False), type=t)
        return pa.array([v.tolist() if hasattr(v, "tolist") else v for v in values], type=t)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(
            f"user field {field.name!r} does not fit declared type {field.type_string}: {exc}"
        ) from None


def _user_arrays(groups: Sequence[TrajectoryGroup], user_fields: Sequence[UserField]) -> list[pa.Array]:
    """One Arrow array per declared user field, rows in group order; errors name group and field."""
    declared = {f.name for f in user_fields}
    per_field: dict[str, list[Any]] = {f.name: [] for f in user_fields}
    for g in groups:
        given = dict(g.user_fields or {})
        unknown = sorted(set(given) - declared)
        if unknown:
            raise InvalidRequest(
                f"group {g.group_id!r}: user fields {unknown} are not declared in the job spec "
                f"(declared: {sorted(declared)})"
            )
        missing = sorted(declared - set(given))
        if missing:
            raise InvalidRequest(f"group {g.group_id!r}: declared user fields {missing} are missing")
        n = g.num_responses
        for name, value in given.items():
            if name in g.shared_user_fields:
                per_field[name] += [value] * n
                continue
            rows = list(value)
            if len(rows) != n:
                raise InvalidRequest(
                    f"group {g.group_id!r}: user field {name!r} has {len(rows)} values for {n} responses"
                )
            per_field[name] += rows
    return [build_user_column(f, per_field[f.name]) for f in user_fields]
