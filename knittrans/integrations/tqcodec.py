"""TransferQueue fields <-> KnitTrans units: any TensorDict column as user columns of a unit, and back.

A TransferQueue put is a ``TensorDict`` of ``n`` rows whose columns are dense tensors, nested
(jagged) tensors or non-tensor stacks. :func:`encode_put` turns one put into the two tables of a
storage unit: the fixed trajectory columns (cheap placeholders: ``traj_id`` is the global index,
token lists are empty) followed by one user column per field, named ``tq.<field>``:

=============================  ==============================================  ===========================
TransferQueue column           Arrow user column(s)                            row comes back as
=============================  ==============================================  ===========================
dense ``[n]``                  primitive                                       0-d tensor
dense ``[n, *s]``              ``fixed_shape_tensor<T>[s]``                    tensor of shape ``s``
nested ``[n, j, ...]``         ``large_list<T>`` + ``tq.<field>#shape``        tensor of its own shape
media field (config)           ``binary(32)`` content hash; payload once in    tensor (copied from the
                               the unit's media table                          fetched media row)
non-tensor, all ``str``        ``string``                                      ``str``
non-tensor, JSON values        ``string`` holding JSON (exact round trip only)  the value
=============================  ==============================================  ===========================

``bfloat16`` is stored as its ``int16`` bits and ``bool`` as ``uint8``; the torch dtype travels in
the field metadata (``knittrans.tq``), so every row comes back with its dtype, shape and bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from knittrans.errors import InvalidRequest
from knittrans.schema import MEDIA_SCHEMA, TRAJECTORY_SCHEMA, Media, UnitTables, build_media_table

__all__ = ["COLUMN_PREFIX", "column_name", "decode_column", "decode_media", "encode_put", "field_columns"]

COLUMN_PREFIX = "tq."
"""User columns of TransferQueue fields are ``tq.<field>``."""
_META = b"knittrans.tq"
_HASH = pa.binary(32)
_STORAGE_DTYPES: dict[str, np.dtype[Any]] = {"bfloat16": np.dtype(np.int16), "bool": np.dtype(np.uint8)}
_SPECIAL = {torch.bfloat16: (np.dtype(np.int16), "bfloat16"), torch.bool: (np.dtype(np.uint8), "bool")}


def column_name(field: str) -> str:
    """User column of a TransferQueue field."""
    return COLUMN_PREFIX + field


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"unknown torch dtype {name!r} in a stored TransferQueue field")
    return dtype


def _np_view(t: torch.Tensor, field: str) -> tuple[np.ndarray, str]:
    """numpy view of a CPU tensor's bytes and the torch dtype name to restore it."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _SPECIAL:
        np_dtype, name = _SPECIAL[t.dtype]
        view = torch.int16 if np_dtype == np.int16 else torch.uint8
        return t.view(view).numpy(), name
    try:
        return t.numpy(), str(t.dtype).removeprefix("torch.")
    except TypeError as exc:
        raise InvalidRequest(f"TransferQueue field {field!r}: dtype {t.dtype} cannot be stored ({exc})") from None


def _restore(arr: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Tensor of ``dtype_name`` from a numpy array of its storage bytes (copies once to own memory)."""
    t = torch.from_numpy(np.array(arr, copy=True))
    if dtype_name == "bfloat16":
        return t.view(torch.bfloat16)
    if dtype_name == "bool":
        return t.view(torch.bool)
    return t


def _field(name: str, type_: pa.DataType, kind: str, dtype: str | None = None) -> pa.Field:
    meta = {"kind": kind} | ({"dtype": dtype} if dtype else {})
    return pa.field(name, type_, nullable=False, metadata={_META: json.dumps(meta).encode()})


def _field_meta(f: pa.Field) -> dict[str, str]:
    raw = (f.metadata or {}).get(_META)
    if raw is None:
        raise InvalidRequest(f"column {f.name!r} is not a TransferQueue field column")
    meta: dict[str, str] = json.loads(raw)
    return meta


def _encode_tensor(field: str, value: torch.Tensor, n: int) -> tuple[list[pa.Field], list[pa.Array]]:
    name = column_name(field)
    if value.is_nested:
        rows = list(value.unbind())
        parts = [_np_view(r, field) for r in rows]
        dtype = parts[0][1] if parts else "float32"
        flat = [p[0].reshape(-1) for p in parts]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([f.shape[0] for f in flat], out=offsets[1:])
        values = np.concatenate(flat) if flat else np.zeros(0, np.float32)
        arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        shapes = pa.array([list(r.shape) for r in rows], type=pa.list_(pa.int32()))
        return ([_field(name, arr.type, "jagged", dtype), _field(name + "#shape", shapes.type, "shape")], [arr, shapes])
    data, dtype = _np_view(value, field)
    if data.ndim == 1:
        arr1 = pa.array(data)
        return [_field(name, arr1.type, "scalar", dtype)], [arr1]
    tensor = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(data))
    return [_field(name, tensor.type, "dense", dtype)], [tensor]


def _encode_objects(field: str, values: list[Any]) -> tuple[pa.Field, pa.Array]:
    name = column_name(field)
    if all(isinstance(v, str) for v in values):
        return _field(name, pa.string(), "str"), pa.array(values, type=pa.string())
    encoded = []
    for i, v in enumerate(values):
        try:
            text = json.dumps(v)
        except (TypeError, ValueError):
            text = None
        if text is None or json.loads(text) != v or type(json.loads(text)) is not type(v):
            raise InvalidRequest(
                f"TransferQueue field {field!r} row {i}: a {type(v).__name__} value that JSON does not round-trip "
                "exactly; store tensors, strings or JSON-compatible values (dict/list/int/float/bool/None)"
            )
        encoded.append(text)
    return _field(name, pa.string(), "json"), pa.array(encoded, type=pa.string())


def _rows_of(value: Any) -> list[Any]:
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):
        return list(value.tolist())  # NonTensorStack / NonTensorData
    return list(value)


def encode_put(
    data: Mapping[str, Any], n: int, *, global_indexes: Sequence[int], partition: str, media_fields: Sequence[str] = ()
) -> UnitTables:
    """The unit tables of one TransferQueue put of ``n`` rows (``data``: field -> column)."""
    if len(global_indexes) != n:
        raise InvalidRequest(f"{len(global_indexes)} global indexes for {n} rows")
    fields: list[pa.Field] = []
    arrays: list[pa.Array] = []
    media: list[Media] = []
    row_hashes: list[list[bytes]] = [[] for _ in range(n)]
    for field in sorted(data):
        value = data[field]
        if not field or "#" in field:
            raise InvalidRequest(f"TransferQueue field name {field!r} is empty or contains '#'")
        if field in media_fields:
            if not isinstance(value, torch.Tensor):
                raise InvalidRequest(f"media field {field!r} must be a tensor column, got {type(value).__name__}")
            rows = list(value.unbind()) if value.is_nested else list(value.unbind(0))
            items = [Media(kind=field, data=r) for r in rows]
            media += items
            for i, m in enumerate(items):
                row_hashes[i].append(m.hash)
            fields.append(_field(column_name(field), _HASH, "media"))
            arrays.append(pa.array([m.hash for m in items], type=_HASH))
        elif isinstance(value, torch.Tensor):
            fs, arrs = _encode_tensor(field, value, n)
            fields += fs
            arrays += arrs
        else:
            f, arr = _encode_objects(field, _rows_of(value))
            fields.append(f)
            arrays.append(arr)
        if len(arrays[-1]) != n:
            raise InvalidRequest(f"TransferQueue field {field!r} has {len(arrays[-1])} rows, expected {n}")
    fixed = _fixed_columns(n, global_indexes, partition, row_hashes)
    schema = pa.schema([*TRAJECTORY_SCHEMA, *fields], metadata=TRAJECTORY_SCHEMA.metadata)
    traj = pa.Table.from_arrays([*fixed, *arrays], schema=schema)
    return UnitTables(traj=traj, media=build_media_table(media) if media else MEDIA_SCHEMA.empty_table())


def _fixed_columns(
    n: int, global_indexes: Sequence[int], partition: str, row_hashes: list[list[bytes]]
) -> list[pa.Array]:
    """The fixed trajectory columns of a TransferQueue unit: ids from the global index, empty tokens."""
    empty = pa.array(np.zeros(n + 1, np.int32))
    zeros_f = pa.array(np.zeros(n, np.float32))
    zeros_i = pa.array(np.zeros(n, np.int32))
    return [
        pa.array([str(g) for g in global_indexes], type=pa.string()),
        pa.array([partition] * n, type=pa.string()),
        pa.array([partition] * n, type=pa.string()).dictionary_encode(),
        pa.ListArray.from_arrays(empty, pa.array([], pa.int32())),
        pa.ListArray.from_arrays(empty, pa.array([], pa.int32())),
        pa.ListArray.from_arrays(empty, pa.array([], pa.float32())),
        pa.ListArray.from_arrays(empty, pa.array([], pa.uint8())),
        zeros_f,
        zeros_f,
        zeros_i,
        zeros_i,
        zeros_f,
        pa.array(row_hashes, type=pa.list_(_HASH)),
        pa.array(np.full(n, int(time.time() * 1e6)).astype("datetime64[us]")),
    ]


def decode_media(table: pa.Table) -> dict[bytes, tuple[np.ndarray, str]]:
    """Media rows (as a ``media`` DoGet returns them) -> per content hash, a read-only numpy view of its
    storage bytes (no copy: the view keeps the DoGet's buffer alive) and its torch dtype name."""
    out: dict[bytes, tuple[np.ndarray, str]] = {}
    hashes = table.column("media_hash").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data")
    for i, h in enumerate(hashes):
        name = dtypes[i]
        np_dtype = _STORAGE_DTYPES.get(name) or np.dtype(name)
        out[h] = (np.frombuffer(data[i].as_buffer(), dtype=np_dtype).reshape(shapes[i]), name)
    return out


def _as_torch(arr: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Tensor of ``dtype_name`` over ``arr`` (which must own writable memory): no copy."""
    t = torch.from_numpy(arr)
    if dtype_name == "bfloat16":
        return t.view(torch.bfloat16)
    if dtype_name == "bool":
        return t.view(torch.bool)
    return t


def _decode_media_rows(
    hashes: list[bytes], media: Mapping[bytes, tuple[np.ndarray, str]], field: str
) -> torch.Tensor | list[torch.Tensor]:
    """Rows of a media column: one memcpy per row straight from the media buffers into the result."""
    try:
        unique = {h: media[h] for h in dict.fromkeys(hashes)}
    except KeyError as exc:
        raise InvalidRequest(f"media field {field!r}: hash {exc.args[0].hex()} is not in the media rows") from None
    kinds = {(a.shape, a.dtype, name) for a, name in unique.values()}
    if len(kinds) == 1:
        shape, np_dtype, name = next(iter(kinds))
        out = np.empty((len(hashes), *shape), dtype=np_dtype)
        for i, h in enumerate(hashes):
            out[i] = unique[h][0]
        return _as_torch(out, name)
    return [_restore(unique[h][0], unique[h][1]) for h in hashes]


def _decode_jagged(col: pa.Array, shapes: list[list[int]], dtype: str) -> torch.Tensor | list[torch.Tensor]:
    """A jagged column: one jagged nested tensor when every row is 1-D (values copied once), else one
    tensor per row."""
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    if len(col) and all(len(s) == 1 for s in shapes):
        base = int(offsets[0])
        flat = _as_torch(np.array(values[base : int(offsets[-1])], copy=True), dtype)
        offs = torch.from_numpy(offsets.astype(np.int64) - base)
        return torch.nested.nested_tensor_from_jagged(flat, offs)
    return [_restore(values[offsets[i] : offsets[i + 1]], dtype).reshape(shapes[i]) for i in range(len(col))]


def decode_column(
    table: pa.Table, field: str, media: Mapping[bytes, tuple[np.ndarray, str]] | None = None
) -> torch.Tensor | list[Any]:
    """Values of ``field`` for every row of ``table`` (a DoGet result holding its column(s)).

    A batched tensor ``[rows, ...]`` when every row has one shape and dtype (scalar, dense and
    uniform media fields), a jagged nested tensor for a jagged field of 1-D rows, else a list with
    one value per row.
    """
    name = column_name(field)
    col = table.column(name).combine_chunks()
    meta = _field_meta(table.schema.field(name))
    kind, dtype = meta["kind"], meta.get("dtype", "")
    if kind == "scalar":
        return _restore(col.to_numpy(zero_copy_only=False), dtype)
    if kind == "dense":
        return _restore(col.to_numpy_ndarray(), dtype)
    if kind == "jagged":
        return _decode_jagged(col, table.column(name + "#shape").to_pylist(), dtype)
    if kind == "media":
        if media is None:
            raise InvalidRequest(f"media field {field!r} needs its media rows")
        return _decode_media_rows(col.to_pylist(), media, field)
    if kind == "str":
        return list(col.to_pylist())
    if kind == "json":
        return [json.loads(v) for v in col.to_pylist()]
    raise InvalidRequest(f"column {name!r} has unknown TransferQueue kind {kind!r}")


def field_columns(names: Collection[str], field: str) -> list[str]:
    """The column names a field occupies in a unit (``tq.<field>`` and, for jagged, its shapes)."""
    name = column_name(field)
    return [name, name + "#shape"] if name + "#shape" in names else [name]
