"""A store node's reserve of empty files whose memory pages already exist, for same-host writers.

Writing a unit's IPC files into fresh pages of a memory filesystem costs the writer the kernel's
page allocation and zeroing, about twice the copy itself. Like Ray's plasma store, which maps its
memory once, the node pays that ahead: while idle it keeps up to ``files`` empty files in
``<root>/.reserve/``, each with pages allocated past its end (``fallocate`` with
``FALLOC_FL_KEEP_SIZE``), and a same-host writer moves one into its temporary (an atomic
``rename``: each file goes to one writer) and appends the IPC file to it.

Why no old unit's bytes can reach a reader: reserve files are created empty by the node and never
written by it; their pages come zero-filled from the kernel and lie past the end of the file,
where no read reaches (a reader sees a file's ``st_size`` bytes, all written by the unit's writer);
the node trims them (``truncate`` to the size) when it publishes the unit; a writer appends only to
a file it finds empty. The files of consumed units are not recycled: truncating a tmpfs file frees
its pages, so reuse would mean writing over an old unit's bytes in place, which this design avoids.

Budget: every reserve file's pages are charged to the node's :class:`ByteBudget` while the file is
in the reserve, a file is made only while a quarter of the budget stays free after it, and a unit
that does not fit takes the reserve's bytes back first (the budget's ``reclaim``). A file a writer
took is released from the reserve's charge at the next publish or refill (the unit is then charged
its own size). On restart the node removes the whole directory (:meth:`UnitStore` rescan).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import secrets
import shutil
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from knittrans.store.budget import ByteBudget

__all__ = ["RESERVE_DIR", "FileReserve", "claim_reserved", "reserved_names"]

logger = logging.getLogger(__name__)

RESERVE_DIR = ".reserve"
"""Directory of the reserve inside a store's root (not a job name: names start alphanumeric)."""

_READY, _NEW = "f-", "n-"
"""A file ready to be taken; a file being made (never taken)."""
_GRAIN = 64 * 1024
_KEEP_SIZE = 0x01
"""``FALLOC_FL_KEEP_SIZE``: allocate pages without changing the file's size."""


def _libc_fallocate() -> Any:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _libc_fallocate()


def preallocate_past_end(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of pages for the open file ``fd`` past its end, its size unchanged.

    Raises OSError (``EOPNOTSUPP`` where the platform or filesystem has no such call)."""
    if _FALLOCATE is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available here")
    if _FALLOCATE(fd, _KEEP_SIZE, 0, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def reserved_names(store_dir: Path) -> list[str]:
    """Names of the files ready in the reserve of the store at ``store_dir`` (none: no reserve there)."""
    try:
        return [n for n in os.listdir(store_dir / RESERVE_DIR) if n.startswith(_READY)]
    except OSError:
        return []


def claim_reserved(store_dir: Path, names: list[str], dest: Path) -> bool:
    """Move a reserve file (taken from the end of ``names``, which is consumed) to ``dest``; True when
    ``dest`` is now an empty file with pages past its end, False when none was left to take."""
    while names:
        src = store_dir / RESERVE_DIR / names.pop()
        try:
            os.rename(src, dest)  # atomic: another writer that took it first leaves ENOENT here
        except FileNotFoundError:
            continue
        if os.stat(dest).st_size == 0:
            return True
        os.unlink(dest)  # never made so by a node; written fresh instead
    return False


class FileReserve:
    """Keeps up to ``files`` preallocated empty files in ``<root>/.reserve/`` (see the module docstring).

    ``start()`` once (idempotent; starts the refilling thread); ``note(sizes)`` with the sizes of
    files just published (the reserve's files follow the largest of recent ones, rounded up to
    64 KiB, at most ``max_file_bytes``); ``wake()`` to refill; ``settle()`` to release the charge of
    files writers took; ``reclaim()`` to give every file back; ``close()``.
    """

    def __init__(self, root: Path, *, files: int, max_file_bytes: int, budget: ByteBudget) -> None:
        self.dir = Path(root) / RESERVE_DIR
        self.files = files
        self.max_file_bytes = max_file_bytes
        self.budget = budget
        self._held: dict[str, int] = {}
        """Files made and not yet seen taken, with the bytes charged for each."""
        self._recent: deque[int] = deque(maxlen=16)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.disabled = files == 0 or _FALLOCATE is None

    def start(self) -> None:
        """Create the directory and start refilling it (once; nothing when disabled)."""
        if self._thread is not None or self.disabled:
            return
        with self._lock:
            if self._thread is not None:
                return
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            self._thread = threading.Thread(target=self._run, name="knittrans-reserve", daemon=True)
            self._thread.start()

    def note(self, sizes: Iterable[int]) -> None:
        """Sizes of files just published: the size of the files made next follows them."""
        self._recent.extend(s for s in sizes if s > 0)

    def wake(self) -> None:
        """Refill now (in the reserve's thread)."""
        self._wake.set()

    def file_bytes(self) -> int:
        """Bytes of the next file made: the largest recent size rounded up to 64 KiB (1 MiB before any)."""
        largest = max(self._recent, default=1 << 20)
        return min(self.max_file_bytes, -(-largest // _GRAIN) * _GRAIN)

    @property
    def held_bytes(self) -> int:
        """Bytes charged to the budget for files in the reserve (as of the last settle)."""
        return sum(self._held.values())

    def settle(self) -> None:
        """Release the budget of files writers have taken out of the reserve."""
        with self._lock:
            known = list(self._held)  # files in place before the listing (a file is renamed, then held)
        if not known:
            return
        try:
            present = set(os.listdir(self.dir))
        except OSError:
            present = set()
        with self._lock:
            freed = sum(self._held.pop(n, 0) for n in known if n not in present)
        if freed:
            self.budget.release(freed)

    def reclaim(self) -> bool:
        """Remove every file of the reserve and give its bytes back to the budget; True when any was."""
        with self._lock:
            held, self._held = self._held, {}
        for name in held:
            with contextlib.suppress(OSError):
                os.unlink(self.dir / name)
        freed = sum(held.values())
        if freed:
            self.budget.release(freed)
        return bool(freed)

    def fill(self) -> int:
        """Make files until the reserve holds ``files`` of them, the budget allows no more or the
        filesystem is full; the number made."""
        self.settle()
        made = 0
        while not self._stop.is_set():
            with self._lock:
                if len(self._held) >= self.files:
                    return made
            size = self.file_bytes()
            limit = self.budget.limit
            if limit is not None and self.budget.used + size > limit * 3 // 4:
                return made
            if not self.budget.try_reserve(size, reclaim=False):
                return made
            name = secrets.token_hex(8)
            new, ready = self.dir / f"{_NEW}{name}", self.dir / f"{_READY}{name}"
            try:
                fd = os.open(new, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                try:
                    preallocate_past_end(fd, size)
                finally:
                    os.close(fd)
                with self._lock:
                    os.rename(new, ready)
                    self._held[ready.name] = size
            except OSError as exc:
                self.budget.release(size)
                with contextlib.suppress(OSError):
                    os.unlink(new)
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.info("store reserve off: %s cannot preallocate (%s)", self.dir, exc)
                    self.disabled = True
                else:
                    logger.debug("store reserve: could not make a file in %s: %s", self.dir, exc)
                return made
            made += 1
        return made

    def _run(self) -> None:
        while not self._stop.is_set():
            self.fill()
            self._wake.wait(timeout=5.0)
            self._wake.clear()

    def close(self) -> None:
        """Stop refilling, remove the reserve's files and give their bytes back."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.reclaim()
        shutil.rmtree(self.dir, ignore_errors=True)
