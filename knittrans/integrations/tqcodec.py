"""TransferQueue puts -> KnitTrans units: every TensorDict column SimpleStorage takes, as user columns."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from knittrans.errors import InvalidRequest
from knittrans.schema import MEDIA_SCHEMA, TRAJECTORY_SCHEMA, Media, UnitTables

__all__ = ["COLUMN_PREFIX", "NO_MEDIA", "column_name", "encode_put", "field_meta", "layout_columns", "raw_bytes"]

COLUMN_PREFIX = "tq."
"""User columns of TransferQueue fields are ``tq.<field>``."""
NO_MEDIA = bytes(32)
"""Hash column value of a dict row whose media key holds no tensor (the row keeps its own value)."""
_META = b"knittrans.tq"
_HASH = pa.binary(32)
_SAFE = re.compile(r"[A-Za-z0-9_.-]")
_MAX_COLUMN = 120  # the store's user column names have at most 128 characters; suffixes need the rest


@functools.lru_cache(maxsize=4096)
def column_name(field: str) -> str:
    """User column of a TransferQueue field (refused when too long once escaped)."""
    escaped = "".join(c if _SAFE.fullmatch(c) else "".join(f":{b:02x}" for b in c.encode()) for c in field)
    if not field or len(escaped) > _MAX_COLUMN:
        raise InvalidRequest(f"TransferQueue field name {field!r} is empty or too long for a KnitTrans column")
    return COLUMN_PREFIX + escaped


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a dense CPU tensor, C order, as a flat uint8 array (no copy when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _field(name: str, type_: pa.DataType, meta: Mapping[str, Any]) -> pa.Field:
    return pa.field(name, type_, nullable=False, metadata={_META: json.dumps(dict(meta)).encode()})


def field_meta(f: pa.Field) -> dict[str, Any]:
    """The codec's description of a column (kind, dtype, shape, media keys); do not modify it (cached)."""
    raw = (f.metadata or {}).get(_META)
    if raw is None:
        raise InvalidRequest(f"column {f.name!r} is not a TransferQueue field column")
    return _parse_meta(raw)


@functools.lru_cache(maxsize=4096)
def _parse_meta(raw: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(raw)
    return meta


class TensorMedia(Media):
    """A media row of any torch dtype: hashed over its bytes in place, payload copied only when stored."""

    @cached_property
    def _raw(self) -> np.ndarray:
        return raw_bytes(self.data)

    @cached_property
    def hash(self) -> bytes:
        """SHA-256 over ``kind|dtype|shape`` and the bytes (as :class:`Media`), without copying them."""
        h = hashlib.sha256(f"{self.kind}|{_dtype_name(self.data)}|{list(self.data.shape)}\n".encode())
        h.update(self._raw.data)
        return h.digest()


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat uint8 arrays hold the same bytes (compared 8 bytes at a time when they can be)."""
    if a.size != b.size:
        return False
    if a.size % 8 == 0:
        return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))
    return bool(np.array_equal(a, b))


def media_table(items: Iterable[TensorMedia]) -> pa.Table:
    """The media table of ``items`` (unique hashes), one record batch per item over the tensor's own bytes:
    written to the unit file straight from the put's tensors, no copy before."""
    batches = []
    for m in items:
        raw = m._raw
        data = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), 1, [None, pa.py_buffer(np.array([0, raw.size], np.int64)), pa.py_buffer(raw)]
        )
        shape = pa.array([list(m.data.shape)], type=MEDIA_SCHEMA.field("shape").type)
        columns = [pa.array([m.hash], _HASH), pa.array([m.kind]), shape, pa.array([_dtype_name(m.data)]), data]
        batches.append(pa.RecordBatch.from_arrays(columns, schema=MEDIA_SCHEMA))
    return pa.Table.from_batches(batches, schema=MEDIA_SCHEMA)


class _MediaRows:
    """Media of one put, once per content hash: a row equal to an earlier one (same tensor, or the previous
    row's bytes) is hashed once."""

    def __init__(self) -> None:
        self.items: dict[bytes, TensorMedia] = {}
        self._seen: dict[tuple[Any, ...], TensorMedia] = {}
        self._last: TensorMedia | None = None

    def add(self, kind: str, t: torch.Tensor) -> bytes:
        t = t.detach().cpu()
        key = (kind, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        m = self._seen.get(key)
        if m is None:
            last = self._last
            if (
                last is not None
                and last.kind == kind
                and last.data.dtype == t.dtype
                and last.data.shape == t.shape
                and _same_bytes(last._raw, raw_bytes(t))
            ):
                m = last
            else:
                m = TensorMedia(kind=kind, data=t)
                m = self.items.setdefault(m.hash, m)  # equal bytes seen before, not in the previous row
            self._seen[key] = m
        self._last = m
        return m.hash


def _tensor_column(name: str, t: torch.Tensor, n: int) -> tuple[list[pa.Field], list[pa.Array]]:
    """Row bytes (``large_binary``) and row shapes (``list<int64>``) of a dense or nested tensor column."""
    # a jagged tensor's attributes dispatch through Python: its own buffers are read with that off
    with torch._C.DisableTorchFunctionSubclass():
        nested = t.is_nested
        njt: Any = t  # a jagged tensor's fields (torch.nested._internal.nested_tensor.NestedTensor)
        jagged = nested and t.layout == torch.jagged and njt._ragged_idx == 1 and njt._lengths is None
        if not nested:  # rows are t[i]: their bytes are slices of the tensor's own (no copy)
            data = raw_bytes(t)
            byte_offsets = np.arange(n + 1, dtype=np.int64) * (data.size // n if n else 0)
            tail = list(t.shape[1:])
            shapes = np.tile(np.asarray(tail, dtype=np.int64), n)
            dims = np.full(n, len(tail), dtype=np.int64)
        elif jagged:
            values: torch.Tensor = njt._values
            offsets = njt._offsets.cpu().numpy().astype(np.int64)
            tail = list(values.shape[1:])
            per_row = int(np.prod(tail, dtype=np.int64)) * t.dtype.itemsize
            data = raw_bytes(values)[int(offsets[0]) * per_row : int(offsets[-1]) * per_row]
            byte_offsets = (offsets - offsets[0]) * per_row
            table = np.empty((n, 1 + len(tail)), dtype=np.int64)
            table[:, 0] = np.diff(offsets)
            table[:, 1:] = tail
            shapes = table.reshape(-1)
            dims = np.full(n, 1 + len(tail), dtype=np.int64)
    if nested and not jagged:  # strided, or jagged with holes: row by row
        rows = list(t.unbind())
        parts = [raw_bytes(r) for r in rows]
        data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        byte_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([p.size for p in parts], out=byte_offsets[1:])
        shapes = np.array([d for r in rows for d in r.shape], dtype=np.int64)
        dims = np.array([r.dim() for r in rows], dtype=np.int64)
    arr = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(byte_offsets), pa.py_buffer(data)])
    dim_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(dims, out=dim_offsets[1:])
    shape_arr = pa.ListArray.from_arrays(pa.array(dim_offsets), pa.array(shapes, type=pa.int64()))
    meta = {"kind": "tensor", "dtype": _dtype_name(t)}
    return (
        [_field(name, arr.type, meta), _field(name + "#shape", shape_arr.type, {"kind": "shape"})],
        [arr, shape_arr],
    )


def _media_column(name: str, field: str, t: torch.Tensor, media: _MediaRows) -> tuple[list[pa.Field], list[pa.Array]]:
    rows = list(t.unbind()) if t.is_nested else list(t.unbind(0))
    hashes = [media.add(field, r) for r in rows]
    return [_field(name, _HASH, {"kind": "media"})], [pa.array(hashes, type=_HASH)]


def _rows_of(field: str, value: Any, n: int) -> list[Any]:
    """Row values of a non-tensor column (NonTensorStack, NonTensorData, a TensorDict, a list)."""
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    if isinstance(value, NonTensorStack | NonTensorData):
        rows = value.tolist()
        return list(rows) if isinstance(rows, list) else [rows] * n
    if isinstance(value, TensorDictBase):
        return list(value.unbind(0))
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise InvalidRequest(f"TransferQueue field {field!r}: cannot take rows of a {type(value).__name__}")


def _objects(
    name: str, field: str, rows: list[Any], keys: Sequence[str], media: _MediaRows
) -> tuple[list[pa.Field], list[pa.Array]]:
    """Row values through TransferQueue's own serializer; tensors under media ``keys`` of dict rows apart."""
    if not keys and all(type(v) is str for v in rows):
        return [_field(name, pa.string(), {"kind": "str"})], [pa.array(rows, type=pa.string())]
    from transfer_queue.utils.serial_utils import batch_encode_into

    hashes: dict[str, list[bytes]] = {k: [] for k in keys}
    values = []
    for v in rows:
        for k in keys:
            if isinstance(v, dict) and isinstance(v.get(k), torch.Tensor):
                hashes[k].append(media.add(f"{field}.{k}", v[k]))
                v = {**v, k: None}
            else:
                hashes[k].append(NO_MEDIA)
        values.append(v)
    encoded, _ = batch_encode_into(values, lambda sizes: [bytearray(size) for size in sizes])
    fields = [_field(name, pa.large_binary(), {"kind": "obj", "media_keys": list(keys)})]
    arrays: list[pa.Array] = [pa.array(encoded, type=pa.large_binary())]
    for i, k in enumerate(keys):
        fields.append(_field(f"{name}#m{i}", _HASH, {"kind": "media_key", "key": k}))
        arrays.append(pa.array(hashes[k], type=_HASH))
    return fields, arrays


def encode_put(
    data: Mapping[str, Any], n: int, *, global_indexes: Sequence[int], partition: str, media_fields: Sequence[str] = ()
) -> tuple[UnitTables, dict[str, str]]:
    """The unit tables of one TransferQueue put of ``n`` rows (``data``: field -> column), and per field
    its layout (:func:`layout_columns` names its columns from it)."""
    if len(global_indexes) != n:
        raise InvalidRequest(f"{len(global_indexes)} global indexes for {n} rows")
    fields: list[pa.Field] = []
    arrays: list[pa.Array] = []
    columns: dict[str, str] = {}
    media = _MediaRows()
    for field in sorted(data):
        value, name = data[field], column_name(field)
        if isinstance(value, torch.Tensor) and field in media_fields:
            fs, arrs = _media_column(name, field, value, media)
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.size(0) != n:
                raise InvalidRequest(f"TransferQueue field {field!r} has shape {tuple(value.shape)}, not {n} rows")
            fs, arrs = _tensor_column(name, value, n)
        else:
            keys = [m[len(field) + 1 :] for m in media_fields if m.startswith(field + ".") and m not in data]
            fs, arrs = _objects(name, field, _rows_of(field, value, n), keys, media)
        if len(arrs[0]) != n:
            raise InvalidRequest(f"TransferQueue field {field!r} has {len(arrs[0])} rows, expected {n}")
        fields += fs
        arrays += arrs
        columns[field] = _layout(fs)
    # per row, the media hashes its columns hold (the fixed ``media`` column)
    media_cols = [a.to_pylist() for a, f in zip(arrays, fields, strict=True) if f.type == _HASH]
    per_row = zip(*media_cols, strict=True) if media_cols else [()] * n
    hashes = [[h for h in row if h != NO_MEDIA] for row in per_row]
    fixed = _fixed_columns(n, global_indexes, partition, hashes)
    schema = pa.schema([*TRAJECTORY_SCHEMA, *fields], metadata=TRAJECTORY_SCHEMA.metadata)
    traj = pa.Table.from_arrays([*fixed, *arrays], schema=schema)
    tables = UnitTables(traj=traj, media=media_table(media.items.values()))
    return tables, columns


def _layout(fields: Sequence[pa.Field]) -> str:
    """A field's layout: a digest of its columns' types and metadata, then their suffixes past ``tq.<field>``
    (``"3fa2c1d0|#shape"``). Puts of one layout are read in one DoGet; rows of a dense field keep their shape
    per row, so puts whose widths differ share a layout."""
    digest = hashlib.sha1(usedforsecurity=False)
    for f in fields:
        digest.update(f"{f.type}|{(f.metadata or {}).get(_META, b'').decode()}\n".encode())
    return "|".join([digest.hexdigest()[:8], *(f.name[len(fields[0].name) :] for f in fields[1:])])


def layout_columns(field: str, layout: str) -> list[str]:
    """The columns of ``field`` stored with ``layout``."""
    name = column_name(field)
    return [name, *(name + s for s in layout.split("|")[1:])]


def _fixed_columns(
    n: int, global_indexes: Sequence[int], partition: str, row_hashes: list[list[bytes]]
) -> list[pa.Array]:
    """The fixed trajectory columns of a TransferQueue unit: ids from the global index, the partition as
    group and source, the rows' media hashes; every other column (tokens, rewards, versions) empty or zero."""
    part = pa.array([partition] * n, type=pa.string())
    given = {
        "traj_id": pa.array([str(g) for g in global_indexes], type=pa.string()),
        "group_id": part,
        "source": part.dictionary_encode(),
        "media": pa.array(row_hashes, type=pa.list_(_HASH)),
        "finished_at": pa.array(np.full(n, int(time.time() * 1e6)).astype("datetime64[us]")),
    }
    return [
        given[f.name] if f.name in given else pa.repeat(pa.scalar([] if pa.types.is_list(f.type) else 0, f.type), n)
        for f in TRAJECTORY_SCHEMA
    ]
