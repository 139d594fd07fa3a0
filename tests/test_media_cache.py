"""MediaCache: one fetch per unique hash per mini-batch, zero-copy decode, honest byte counts."""

from __future__ import annotations

import gc
import hashlib
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from knittrans.errors import InvalidRequest, NotFound, SchemaMismatch
from knittrans.trainer.media import MediaCache, MediaCacheStats, MediaRecord, decode_media, decode_media_copy


class MediaTable:
    """A real media Arrow table (media_hash fixed_size_binary(32), kind, shape, dtype, data) and its fetch."""

    def __init__(self, items: Sequence[tuple[str, np.ndarray]]) -> None:
        hashes, kinds, shapes, dtypes, payloads = [], [], [], [], []
        for kind, array in items:
            payload = np.ascontiguousarray(array).tobytes()
            hashes.append(hashlib.sha256(f"{kind}|{array.dtype}|{list(array.shape)}\n".encode() + payload).digest())
            kinds.append(kind)
            shapes.append([int(d) for d in array.shape])
            dtypes.append(str(array.dtype))
            payloads.append(payload)
        self.table = pa.table(
            {
                "media_hash": pa.array(hashes, pa.binary(32)),
                "kind": pa.array(kinds, pa.string()),
                "shape": pa.array(shapes, pa.list_(pa.int32())),
                "dtype": pa.array(dtypes, pa.string()),
                "data": pa.array(payloads, pa.large_binary()),
            }
        )
        self.hex = [h.hex() for h in hashes]
        self.arrays = dict(zip(self.hex, (a for _, a in items), strict=True))
        self.calls: list[list[str]] = []

    def fetch(self, wanted: Sequence[str]) -> dict[str, MediaRecord]:
        """Rows whose hash is in ``wanted``, as zero-copy slices; ``data`` is the Arrow buffer itself."""
        self.calls.append(list(wanted))
        keys = pa.array([bytes.fromhex(h) for h in wanted], pa.binary(32))
        rows = pc.indices_nonzero(pc.is_in(self.table["media_hash"], value_set=keys)).to_pylist()
        data = self.table["data"].chunk(0)
        offsets = np.frombuffer(data.buffers()[1], dtype=np.int64)[data.offset :]
        out = {}
        for i in rows:
            start, end = int(offsets[i]), int(offsets[i + 1])
            out[self.hex[i]] = MediaRecord(
                kind=self.table["kind"][i].as_py(),
                shape=self.table["shape"][i].as_py(),
                dtype=self.table["dtype"][i].as_py(),
                data=data.buffers()[2].slice(start, end - start),
            )
        return out


@pytest.fixture
def media() -> MediaTable:
    rng = np.random.default_rng(3)
    return MediaTable(
        [
            ("image", rng.integers(0, 256, (3, 8, 8), dtype=np.uint8)),
            ("image", rng.integers(0, 256, (3, 4, 6), dtype=np.uint8)),
            ("audio", rng.standard_normal((2, 5)).astype(np.float32)),
        ]
    )


def test_counts_and_single_fetch_per_hash(media: MediaTable) -> None:
    """Only missing hashes are fetched, in one call per get(); logical bytes count every request."""
    a, b, c = media.hex
    size = {h: arr.nbytes for h, arr in media.arrays.items()}
    cache = MediaCache(media.fetch)
    first = cache.get([a, a, b])
    assert media.calls == [[a, b]]
    second = cache.get([b, c, a, c])
    assert media.calls == [[a, b], [c]]
    cache.get([a, b])
    assert len(media.calls) == 2  # everything cached: no fetch call
    assert first[a] is second[a]  # decoded once
    assert cache.stats == MediaCacheStats(
        requests=9,
        hits=6,
        fetched=3,
        fetch_calls=2,
        logical_bytes=4 * size[a] + 3 * size[b] + 2 * size[c],
        unique_bytes=size[a] + size[b] + size[c],
    )
    assert cache.stats.dedup_ratio == pytest.approx(cache.stats.logical_bytes / cache.stats.unique_bytes)


def test_decode_matches_arrays_without_copy(media: MediaTable) -> None:
    """Decoded tensors equal the stored arrays and share the Arrow buffer's memory."""
    cache = MediaCache(media.fetch)
    got = cache.get(media.hex)
    data = media.table["data"].chunk(0)
    base = data.buffers()[2].address
    end = base + data.buffers()[2].size
    for h, tensor in got.items():
        np.testing.assert_array_equal(tensor.numpy(), media.arrays[h])
        assert base <= tensor.data_ptr() < end, "decode copied the payload"


def test_clear_frees_and_refetches(media: MediaTable) -> None:
    """clear() drops the tensors, returns the mini-batch's counters and the next get() fetches again."""
    a = media.hex[0]
    cache = MediaCache(media.fetch)
    ref = weakref.ref(cache.get([a, a])[a])
    gc.collect()
    assert ref() is not None and a in cache and len(cache) == 1
    stats = cache.clear()
    gc.collect()
    assert ref() is None and len(cache) == 0
    assert stats.requests == 2 and stats.fetched == 1 and cache.stats == MediaCacheStats()
    cache.get([a])
    assert media.calls == [[a], [a]] and cache.stats.fetched == 1 and cache.stats.requests == 1


def test_concurrent_gets_fetch_each_hash_once(media: MediaTable) -> None:
    """A prefetch thread and the training thread asking at once still fetch each hash once."""
    cache = MediaCache(media.fetch)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            for _ in range(20):
                cache.get(media.hex)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(h for call in media.calls for h in call) == sorted(media.hex)
    assert cache.stats.requests == 4 * 20 * 3 and cache.stats.fetched == 3


def test_bad_input_raises_named_errors(media: MediaTable) -> None:
    """Malformed hashes, hashes the fetch did not return, and inconsistent records raise clear errors."""
    cache = MediaCache(media.fetch)
    with pytest.raises(InvalidRequest, match="64 lower-case hex"):
        cache.get(["ABC"])
    with pytest.raises(NotFound, match="0" * 64):
        cache.get([media.hex[0], "0" * 64])
    with pytest.raises(SchemaMismatch, match=r"payload has 5 bytes but shape \[2, 3\] of uint8 needs 6"):
        decode_media("f" * 64, MediaRecord("image", [2, 3], "uint8", b"12345"))
    with pytest.raises(SchemaMismatch, match="unsupported dtype 'complex64'"):
        decode_media("f" * 64, MediaRecord("image", [1], "complex64", b"12345678"))
    with pytest.raises(SchemaMismatch, match=r"negative dimension in shape \[-2, -3\]"):
        decode_media("f" * 64, MediaRecord("image", [-2, -3], "uint8", b"123456"))  # the sizes would match


def test_bfloat16_bytes_and_copy_decoders() -> None:
    """bfloat16 payloads (int16 bit patterns) and raw bytes decode; decode_media_copy is writable."""
    values = torch.tensor([[1.5, -2.0], [0.25, 8.0]], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().tobytes()
    out = decode_media("a" * 64, MediaRecord("audio", [2, 2], "bfloat16", raw))
    assert out.dtype == torch.bfloat16 and torch.equal(out, values)
    png = b"\x89PNG\r\n\x1a\n"
    as_bytes = decode_media("b" * 64, MediaRecord("image", [len(png)], "bytes", png))
    assert as_bytes.dtype == torch.uint8 and bytes(as_bytes.numpy()) == png
    copy = decode_media_copy("c" * 64, MediaRecord("image", [2, 2], "uint8", b"\x01\x02\x03\x04"))
    copy += 1
    assert copy.tolist() == [[2, 3], [4, 5]]
