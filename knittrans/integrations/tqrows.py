"""KnitTrans unit columns -> the rows of a TransferQueue field, packed the way SimpleStorage packs them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from knittrans.errors import InvalidRequest
from knittrans.integrations.tqcodec import NO_MEDIA, field_meta

__all__ = [
    "MediaRows",
    "RaggedRows",
    "assemble",
    "decode_field",
    "decode_media",
    "pack_rows",
    "row_list",
    "scatter",
]

MediaRows = Mapping[bytes, tuple[np.ndarray, str, tuple[int, ...]]]
"""Per content hash: the stored bytes (uint8 view), torch dtype name and shape."""


@dataclass(frozen=True)
class RaggedRows:
    """Rows ``values[offsets[i]:offsets[i+1]]`` of one dtype and one shape past their first dimension."""

    values: torch.Tensor
    lengths: np.ndarray


Rows = torch.Tensor | RaggedRows | list[Any]
"""A decoded part: rows of one shape and dtype as one tensor (``t[i]`` is row ``i``), ragged rows, or a list."""


def _tensor(data: np.ndarray, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``data`` (uint8 bytes this call owns: no copy)."""
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidRequest(f"unknown torch dtype {dtype!r} in a stored TransferQueue field")
    if data.size == 0:
        return torch.empty(tuple(shape), dtype=dt)
    return torch.from_numpy(data.reshape(-1)).view(dt).reshape(tuple(shape))


def _spans(offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat element indexes of the ranges ``offsets[i]:offsets[i+1]`` for ``i`` in ``idx``, and their lengths."""
    starts, lengths = offsets[idx], offsets[idx + 1] - offsets[idx]
    ends = np.cumsum(lengths)
    flat = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
    return flat, lengths


def _binary(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Value offsets (relative to the data) and data bytes of a (large_)binary array."""
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int64)[col.offset : col.offset + len(col) + 1]
    data = col.buffers()[2]
    return offsets, np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)


def decode_media(table: pa.Table) -> dict[bytes, tuple[np.ndarray, str, tuple[int, ...]]]:
    """Media rows (a ``media`` DoGet's answer) per content hash, as views of the answer's buffers."""
    offsets, raw = _binary(table.column("data").combine_chunks())
    rows = table.select(["media_hash", "dtype", "shape"]).to_pylist()
    return {
        r["media_hash"]: (raw[offsets[i] : offsets[i + 1]], r["dtype"], tuple(r["shape"])) for i, r in enumerate(rows)
    }


def _media_rows(hashes: list[bytes], media: MediaRows | None, field: str) -> Rows:
    if media is None:
        raise InvalidRequest(f"media field {field!r} needs its media rows")
    try:
        found = [media[h] for h in hashes]
    except KeyError as exc:
        raise InvalidRequest(f"media field {field!r}: hash {exc.args[0].hex()} is not in the media rows") from None
    kinds = {(dtype, shape) for _, dtype, shape in found}
    if len(kinds) == 1:  # one copy, straight into the batch's buffer
        dtype, shape = next(iter(kinds))
        return _tensor(np.stack([raw for raw, _, _ in found]), dtype, (len(found), *shape))
    return [_tensor(raw.copy(), dtype, shape) for raw, dtype, shape in found]


def _object_rows(
    table: pa.Table, name: str, meta: Mapping[str, Any], idx: np.ndarray, media: MediaRows | None
) -> list[Any]:
    from transfer_queue.utils.serial_utils import decode, unpack_from

    offsets, raw = _binary(table.column(name).combine_chunks())
    keys: list[str] = meta.get("media_keys", [])
    hashes = [table.column(f"{name}#m{k}").combine_chunks().to_pylist() for k in range(len(keys))]
    rows = []
    for i in idx.tolist():
        value = decode(unpack_from(bytearray(raw[offsets[i] : offsets[i + 1]])))  # own, writable memory
        for k, key in enumerate(keys):
            h = hashes[k][i]
            if h != NO_MEDIA:
                got = _media_rows([h], media, f"{name}.{key}")
                value[key] = row_list(got)[0]
        rows.append(value)
    return rows


def _tensor_rows(table: pa.Table, name: str, col: pa.Array, dtype: str, idx: np.ndarray) -> Rows:
    """Rows ``idx`` of a tensor column: one gather of their bytes, then one tensor viewed over them."""
    offsets, raw = _binary(col)
    flat, nbytes = _spans(offsets, idx)
    data = raw[flat]  # one copy, into memory of our own
    shapes_col = table.column(name + "#shape").combine_chunks()
    dim_off = shapes_col.offsets.to_numpy()
    dims_flat = shapes_col.values.to_numpy(zero_copy_only=False)
    ndims = np.diff(dim_off)
    k = len(idx)
    if k and len(ndims) and (ndims == ndims[0]).all():  # one rank: shapes as a [rows, rank] array
        d = int(ndims[0])
        shapes = dims_flat[dim_off[0] : dim_off[-1]].reshape(len(col), d)[idx]
        if d == 0:
            return _tensor(data, dtype, (k,))
        if (shapes == shapes[0]).all():
            return _tensor(data, dtype, (k, *shapes[0].tolist()))
        if (shapes[:, 1:] == shapes[0, 1:]).all():
            lengths = shapes[:, 0].astype(np.int64)
            return RaggedRows(_tensor(data, dtype, (int(lengths.sum()), *shapes[0, 1:].tolist())), lengths)
    rows_shapes = [tuple(dims_flat[dim_off[i] : dim_off[i + 1]].tolist()) for i in idx.tolist()]
    sizes = np.cumsum([0, *nbytes.tolist()])  # each row's bytes in ``data``
    return [_tensor(data[sizes[i] : sizes[i + 1]], dtype, s) for i, s in enumerate(rows_shapes)]


def decode_field(table: pa.Table, name: str, idx: np.ndarray, media: MediaRows | None = None) -> Rows:
    """Rows ``idx`` (positions in ``table``, a DoGet's answer) of the field stored in column ``name``."""
    col = table.column(name).combine_chunks()
    meta = field_meta(table.schema.field(name))
    kind = meta["kind"]
    if kind == "tensor":
        return _tensor_rows(table, name, col, meta["dtype"], idx)
    if kind == "media":
        hashes = col.to_pylist()
        return _media_rows([hashes[i] for i in idx.tolist()], media, name)
    if kind == "str":
        values = col.to_pylist()
        return [values[i] for i in idx.tolist()]
    if kind == "obj":
        return _object_rows(table, name, meta, idx, media)
    raise InvalidRequest(f"column {name!r} has unknown TransferQueue kind {kind!r}")


def pack_rows(values: list[Any]) -> Any:
    """SimpleStorage's packing of a field's rows (``AsyncSimpleStorageManager._pack_field_values``)."""
    from tensordict import NonTensorStack

    if values and all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(values, layout=layout)
            except (RuntimeError, TypeError):
                continue
    return NonTensorStack(*values)


def _as_ragged(rows: Rows) -> RaggedRows | None:
    if isinstance(rows, RaggedRows):
        return rows
    if isinstance(rows, torch.Tensor) and rows.dim() >= 2:
        return RaggedRows(rows.flatten(0, 1), np.full(rows.shape[0], rows.shape[1], np.int64))
    return None


def row_list(rows: Rows) -> list[Any]:
    """The rows of a decoded part, one value each (tensor rows as views of the part's buffer)."""
    if isinstance(rows, torch.Tensor):
        return list(rows.unbind(0))
    if isinstance(rows, RaggedRows):
        return list(torch.split(rows.values, rows.lengths.tolist()))
    return rows


def _jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The jagged nested tensor of ``values`` cut at ``offsets`` (ragged dimension 1), as
    ``torch.nested.nested_tensor_from_jagged`` makes it; built by the class itself where torch has it
    (the public function adds a view and a dispatch round that cost several times the construction)."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor

        return NestedTensor(values, offsets)
    except (ImportError, TypeError):  # pragma: no cover - a torch without that constructor
        return torch.nested.nested_tensor_from_jagged(values, offsets)


def assemble(parts: Sequence[tuple[Sequence[int], Rows]], n: int) -> Any:
    """One field's rows from several DoGets (``(batch positions, rows)`` each) as SimpleStorage returns them."""
    order = np.concatenate([np.asarray(p, dtype=np.int64) for p, _ in parts]) if parts else np.zeros(0, np.int64)
    identity = bool(np.array_equal(order, np.arange(n)))
    dense = [r for _, r in parts if isinstance(r, torch.Tensor)]
    same_kind = len(dense) == len(parts) and len({(r.dtype, r.shape[1:]) for r in dense}) == 1
    if same_kind and dense[0].dim() == 1:  # 0-d rows: stacked
        cat = dense[0] if len(dense) == 1 else torch.cat(dense)
        return cat if identity else cat[torch.from_numpy(np.argsort(order, kind="stable"))]
    ragged = [_as_ragged(r) for _, r in parts]
    kinds = {(r.values.dtype, r.values.shape[1:]) for r in ragged if r is not None}
    if parts and all(r is not None for r in ragged) and len(kinds) == 1:
        values = [r.values for r in ragged if r is not None]
        lengths = np.concatenate([r.lengths for r in ragged if r is not None])
        cat = values[0] if len(values) == 1 else torch.cat(values)
        if not identity:  # rows into batch order: one gather
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            perm = np.argsort(order, kind="stable")
            flat, lengths = _spans(offsets, perm)
            cat = cat[torch.from_numpy(flat)]
        offs = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offs[1:])
        return _jagged(cat, torch.from_numpy(offs))
    return pack_rows(scatter(parts, n))


def scatter(parts: Sequence[tuple[Sequence[int], Rows]], n: int) -> list[Any]:
    """The ``n`` rows of several DoGets (``(batch positions, rows)`` each), one value each, in batch order."""
    rows: list[Any] = [None] * n
    for positions, part in parts:
        for p, v in zip(positions, row_list(part), strict=True):
            rows[p] = v
    return rows
