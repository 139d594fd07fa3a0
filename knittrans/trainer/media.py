"""Per-rank, per-mini-batch media cache: fetch each unique media hash once, decode it once."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np
import torch

from knittrans.errors import InvalidRequest, NotFound, SchemaMismatch
from knittrans.names import is_content_hash

__all__ = [
    "MediaCache",
    "MediaCacheStats",
    "MediaRecord",
    "decode_media",
    "decode_media_copy",
]

logger = logging.getLogger(__name__)


_NUMPY_DTYPES = {
    "bytes": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bfloat16": np.dtype("<i2"),  # stored as its int16 bit pattern, viewed as bfloat16 after
}


class MediaRecord(NamedTuple):
    """One row of the media table (without its hash, which is the mapping key)."""

    kind: str
    """What it is, e.g. ``image``."""
    shape: Sequence[int]
    """Array shape; ``(len,)`` for dtype ``bytes``."""
    dtype: str
    """numpy/torch dtype name (little-endian), ``bfloat16``, or ``bytes`` for raw encoded bytes."""
    data: Any
    """The payload: ``bytes``, ``memoryview``, ``pyarrow.Buffer`` or anything with the buffer protocol."""


Fetch = Callable[[Sequence[str]], Mapping[str, MediaRecord]]
Decode = Callable[[str, MediaRecord], torch.Tensor]


def _nbytes(data: Any) -> int:
    return memoryview(data).nbytes


def decode_media(media_hash: str, record: MediaRecord) -> torch.Tensor:
    """Tensor of ``record.shape``/``record.dtype`` sharing ``record.data``'s memory (zero-copy).

    Raises:
        SchemaMismatch: unknown dtype, or a payload whose size does not match shape and dtype.
    """
    kind, shape, dtype, data = record
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise SchemaMismatch(f"media {media_hash}: unsupported dtype {dtype!r} (kind {kind!r})")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise SchemaMismatch(f"media {media_hash}: negative dimension in shape {list(dims)}")
    expected = int(np.prod(dims, dtype=np.int64)) * np_dtype.itemsize
    got = _nbytes(data)
    if got != expected:
        raise SchemaMismatch(
            f"media {media_hash}: payload has {got} bytes but shape {list(dims)} of {dtype} needs {expected}"
        )
    array = np.frombuffer(data, dtype=np_dtype).reshape(dims)
    with warnings.catch_warnings():
        # Arrow buffers are read-only; sharing them is the point (documented: no in-place writes).
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def decode_media_copy(media_hash: str, record: MediaRecord) -> torch.Tensor:
    """Like :func:`decode_media` but returns a writable copy that owns its memory."""
    return decode_media(media_hash, record).clone()


@dataclass(frozen=True, kw_only=True)
class MediaCacheStats:
    """Counters of a :class:`MediaCache` (one mini-batch, or the cache's lifetime)."""

    requests: int = 0
    """Hashes asked for, counting repeats (one per trajectory use)."""
    hits: int = 0
    """Requests served without fetching (already cached, or repeated within one ``get``)."""
    fetched: int = 0
    """Unique media fetched."""
    fetch_calls: int = 0
    """Calls to the fetch callable (at most one per ``get``)."""
    logical_bytes: int = 0
    """Payload bytes of every request, as if each trajectory had its own copy."""
    unique_bytes: int = 0
    """Payload bytes actually fetched."""

    def __add__(self, other: MediaCacheStats) -> MediaCacheStats:
        return MediaCacheStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / unique_bytes`` (1.0 when nothing was fetched)."""
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0


class MediaCache:
    """Fetches each unique media hash once per mini-batch and decodes it once; thread-safe.

    Args:
        fetch: ``fetch(hashes) -> {hash: MediaRecord}`` for a list of distinct lower-case hex
            hashes; must return every one of them (the data plane's media fetch).
        decode: ``decode(hash, record) -> Tensor``; default :func:`decode_media` (zero-copy).
    """

    def __init__(self, fetch: Fetch, *, decode: Decode = decode_media) -> None:
        self._fetch = fetch
        self._decode = decode
        self._lock = threading.Lock()
        self._cached: dict[str, tuple[torch.Tensor, int]] = {}  # hash -> decoded tensor, payload bytes
        self._stats = MediaCacheStats()

    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, media_hash: object) -> bool:
        return media_hash in self._cached

    @property
    def stats(self) -> MediaCacheStats:
        """Counters of the current mini-batch so far."""
        return self._stats

    def get(self, hashes: Sequence[str]) -> dict[str, torch.Tensor]:
        """Decoded tensors of ``hashes`` (each once in the result), fetching only the missing ones.

        Raises:
            InvalidRequest: a hash is not 64 lower-case hex characters.
            NotFound: the fetch did not return a requested hash.
            SchemaMismatch: a record's payload does not match its shape/dtype.
        """
        for media_hash in hashes:
            if not is_content_hash(media_hash):
                raise InvalidRequest(f"media hash must be 64 lower-case hex characters, got {media_hash!r}")
        with self._lock:
            missing = list(dict.fromkeys(h for h in hashes if h not in self._cached))
            if missing:
                records = self._fetch(missing)
                absent = [h for h in missing if h not in records]
                if absent:
                    raise NotFound(f"media fetch did not return {len(absent)} hash(es), first {absent[0]}")
                got = {h: MediaRecord(*records[h]) for h in missing}
                self._cached.update({h: (self._decode(h, r), _nbytes(r.data)) for h, r in got.items()})
            self._stats = self._stats + MediaCacheStats(
                requests=len(hashes),
                hits=len(hashes) - len(missing),
                fetched=len(missing),
                fetch_calls=1 if missing else 0,
                logical_bytes=sum(self._cached[h][1] for h in hashes),
                unique_bytes=sum(self._cached[h][1] for h in missing),
            )
            return {h: self._cached[h][0] for h in hashes}

    def clear(self) -> MediaCacheStats:
        """End the mini-batch: drop every tensor and return (and reset) this mini-batch's counters."""
        with self._lock:
            stats = self._stats
            self._stats = MediaCacheStats()
            self._cached.clear()
        logger.debug("media cache cleared: %s", stats)
        return stats
