"""Receive buffers of the data lane's client, reused from read to read once nothing references them."""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import pyarrow as pa

__all__ = ["DEFAULT_IDLE_BYTES", "ReceivePool", "default_pool", "size_class"]

DEFAULT_IDLE_BYTES = 512 << 20
"""Idle receive buffers a process keeps by default (512 MiB of mappings, resident once used)."""
DEFAULT_MIN_BYTES = 1 << 20
"""Reads smaller than this take a buffer from Arrow's pool (small blocks are cheap to get there)."""


def size_class(nbytes: int) -> int:
    """Bytes of the region a read of ``nbytes`` gets: ``nbytes`` rounded up to 1/16 of its power of two (>= a page)."""
    if nbytes <= mmap.PAGESIZE:
        return mmap.PAGESIZE
    step = max(mmap.PAGESIZE, (1 << (nbytes - 1).bit_length()) // 16)
    return -(-nbytes // step) * step


class ReceivePool:
    """Reusable anonymous-memory regions for lane answers, at most ``idle_bytes`` of idle ones kept; thread-safe."""

    def __init__(self, *, idle_bytes: int = DEFAULT_IDLE_BYTES, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        if idle_bytes < 0 or min_bytes < 0:
            raise ValueError(f"idle_bytes and min_bytes must be >= 0, not {idle_bytes} and {min_bytes}")
        self.idle_bytes_max, self.min_bytes = idle_bytes, min_bytes
        self._lock = threading.RLock()  # a finalizer may run inside a pool call of the same thread (GC)
        self._idle: list[mmap.mmap] = []  # least recently returned first
        self._idle_bytes = 0
        self.mapped = 0
        """Regions mapped so far (a read that found no idle region of its class)."""
        self.reused = 0
        """Reads served from an idle region."""

    @property
    def idle_bytes(self) -> int:
        """Bytes of the regions idle in the pool now."""
        with self._lock:
            return self._idle_bytes

    def buffer(self, nbytes: int) -> tuple[memoryview, pa.Buffer]:
        """A writable view of ``nbytes`` bytes to receive into and the ``pa.Buffer`` over the same bytes.

        Fill the view, drop it, and hand the ``pa.Buffer`` to Arrow: the memory is reused only after
        the buffer and everything made from it are gone.
        """
        if nbytes < self.min_bytes:
            buf = pa.allocate_buffer(nbytes, resizable=False)
            return memoryview(buf), buf
        region = self._take(size_class(nbytes))
        view = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        weakref.finalize(view, self._give_back, region).atexit = False
        return view.data, pa.py_buffer(view)

    def _take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if len(self._idle[i]) == nbytes:
                    self._idle_bytes -= nbytes
                    self.reused += 1
                    return self._idle.pop(i)
            self.mapped += 1
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def _give_back(self, region: mmap.mmap) -> None:
        n = len(region)
        with self._lock:
            if n > self.idle_bytes_max:
                return  # dropped: unmapped when the last reference goes
            while self._idle and self._idle_bytes + n > self.idle_bytes_max:
                self._idle_bytes -= len(self._idle.pop(0))
            self._idle.append(region)
            self._idle_bytes += n


_DEFAULT = ReceivePool()  # cheap: it maps nothing until a read needs a region


def default_pool() -> ReceivePool:
    """The process's shared pool (:class:`~knittrans.flight.StoreClient`'s default)."""
    return _DEFAULT
