"""Per-job user fields: extra trajectory columns beyond the fixed schema (docs/getting-started/your-own-data.md)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from knittrans.columns import TRAJECTORY_COLUMNS
from knittrans.errors import InvalidJobSpec, InvalidRequest

__all__ = [
    "USER_FIELD_NAME_RE",
    "UserField",
    "parse_arrow_type",
    "parse_user_fields",
    "user_column_to_torch",
]

USER_FIELD_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:#-]{0,127}$")
"""A user column name: starts with a letter or ``_``; letters, digits, ``_ . : # -``; 1-128 chars."""

_PRIMITIVES: dict[str, pa.DataType] = {
    name: pa.type_for_alias(name)
    for name in (
        "bool",
        *(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)),
        *(f"float{bits}" for bits in (16, 32, 64)),
        *("string", "large_string", "binary", "large_binary"),
    )
}


def _split_bracket(text: str, what: str) -> tuple[str, str]:
    """``list<...>rest`` -> (inner, rest) with balanced angle brackets."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
            if depth == 0:
                return text[1:i], text[i + 1 :]
    raise InvalidJobSpec(f"{what}: unbalanced '<' in type {text!r}")


def _dims(rest: str, what: str, full: str) -> list[int]:
    m = re.fullmatch(r"\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]", rest)
    if not m:
        raise InvalidJobSpec(f"{what}: type {full!r} needs a size like [4] or a shape like [2,3]")
    dims = [int(x) for x in m.group(1).split(",")]
    if any(d <= 0 for d in dims):
        raise InvalidJobSpec(f"{what}: type {full!r} has a non-positive dimension")
    return dims


def parse_arrow_type(text: str, what: str = "type") -> pa.DataType:
    """Parse a type string (docs/getting-started/your-own-data.md); :class:`InvalidJobSpec` names what is wrong."""
    if not isinstance(text, str):
        raise InvalidJobSpec(f"{what}: type must be a string such as 'list<float32>', not {text!r}")
    s = text.strip()
    if s in _PRIMITIVES:
        return _PRIMITIVES[s]
    for prefix in ("large_list", "list", "fixed_size_list", "tensor"):
        if s.startswith(prefix + "<"):
            inner_s, rest = _split_bracket(s[len(prefix) :], what)
            inner = parse_arrow_type(inner_s, what)
            if prefix == "list" and not rest:
                return pa.list_(inner)
            if prefix == "large_list" and not rest:
                return pa.large_list(inner)
            if prefix == "fixed_size_list":
                dims = _dims(rest, what, s)
                if len(dims) != 1:
                    raise InvalidJobSpec(f"{what}: fixed_size_list takes one size, got {dims}")
                return pa.list_(inner, dims[0])
            if prefix == "tensor":
                if not is_primitive_numeric(inner):
                    raise InvalidJobSpec(f"{what}: tensor elements must be numeric or bool, not {inner}")
                return pa.fixed_shape_tensor(inner, _dims(rest, what, s))
            raise InvalidJobSpec(f"{what}: unexpected {rest!r} after {prefix}<...> in {s!r}")
    known = ", ".join(sorted(_PRIMITIVES))
    raise InvalidJobSpec(
        f"{what}: unknown type {text!r}; use one of {known}, list<T>, large_list<T>, "
        "fixed_size_list<T>[n] or tensor<T>[d0,d1,...]"
    )


@dataclass(frozen=True, kw_only=True)
class UserField:
    """One declared user column."""

    name: str
    """Column name; must not be a fixed trajectory column."""
    type_string: str = field(compare=False)
    """The type as the job spec writes it (docs/getting-started/your-own-data.md, "Field types and rules")."""
    type: pa.DataType = field(init=False)
    """Arrow type of the column, parsed from :attr:`type_string`."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not USER_FIELD_NAME_RE.match(self.name):
            raise InvalidJobSpec(
                f"user_fields: name {self.name!r} is not valid: start with a letter or '_', then letters, "
                "digits, '_', '.', ':', '#' or '-' (at most 128)"
            )
        if self.name in TRAJECTORY_COLUMNS:
            raise InvalidJobSpec(
                f"user_fields: {self.name!r} is a fixed trajectory column; pick another name "
                f"(fixed columns: {list(TRAJECTORY_COLUMNS)})"
            )
        object.__setattr__(self, "type", parse_arrow_type(self.type_string, f"user_fields.{self.name}"))


def parse_user_fields(spec: Mapping[str, str] | None) -> tuple[UserField, ...]:
    """Declared user fields from ``{name: type string}``, in the given order."""
    if spec is None:
        return ()
    if not isinstance(spec, Mapping):
        raise InvalidJobSpec("user_fields must be an object {name: type}, e.g. {'values': 'list<float32>'}")
    return tuple(UserField(name=k, type_string=v) for k, v in spec.items())


def is_primitive_numeric(t: pa.DataType) -> bool:
    """Whether ``t`` is an integer, floating-point or boolean type."""
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _from_numpy(arr: np.ndarray) -> Any:
    """torch view of a (possibly read-only, memory-mapped) numpy array; the caller must not write to it."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable arrays: a read-only view on purpose
        return torch.from_numpy(arr)


def user_column_to_torch(col: pa.ChunkedArray | pa.Array) -> Any:
    """Torch form of a user column.

    * numeric primitive -> tensor ``[rows]``;
    * ``fixed_size_list`` of numbers -> tensor ``[rows, n]``; ``tensor<T>[shape]`` -> ``[rows, *shape]``;
    * ``list`` / ``large_list`` of numbers -> ``(flat values, cu_seqlens)`` (int64 cu_seqlens);
    * anything else (strings, binary, nested lists) -> a Python list, one value per row.
    """
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        raise InvalidRequest(f"user column of type {arr.type} has {arr.null_count} null rows; cannot convert")
    t = arr.type
    if isinstance(t, pa.FixedShapeTensorType):
        return _from_numpy(np.ascontiguousarray(arr.to_numpy_ndarray()))
    if pa.types.is_fixed_size_list(t) and is_primitive_numeric(t.value_type):
        flat = arr.flatten().to_numpy(zero_copy_only=False)
        return _from_numpy(np.ascontiguousarray(flat).reshape(len(arr), t.list_size))
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and is_primitive_numeric(t.value_type):
        offsets = arr.offsets.to_numpy().astype(np.int64)
        values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy(zero_copy_only=False)
        return _from_numpy(np.ascontiguousarray(values)), _from_numpy(offsets - offsets[0])
    if is_primitive_numeric(t):
        return _from_numpy(np.ascontiguousarray(arr.to_numpy(zero_copy_only=False)))
    return arr.to_pylist()
