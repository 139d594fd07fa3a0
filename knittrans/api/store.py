"""Persistence of control-plane state: a narrow store of JSON records over SQLite in WAL mode."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from typing import Any, Literal

from knittrans.api.records import Kind
from knittrans.errors import StateError, Unavailable

__all__ = ["CHECKPOINT_BYTES", "RecordStore", "StateError", "Txn"]

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL,
    job  TEXT NOT NULL,
    key  TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (kind, job, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

STORE_FORMAT = "1"
"""Version of the record layout; a database written with another version is refused."""

CHECKPOINT_BYTES = 4 << 20
"""Record bytes committed after which :meth:`RecordStore.checkpoint_if_due` copies the WAL into the database
(SQLite's own automatic checkpoint, off here, runs at about 1,000 pages of 4 KiB)."""


class Txn:
    """Buffered writes of one state change; applied atomically by :meth:`RecordStore.commit`."""

    def __init__(self) -> None:
        self.puts: dict[tuple[str, str, str], Any] = {}
        self.deletes: set[tuple[str, str, str]] = set()

    def put(self, kind: Kind, job: str, key: str, value: Any) -> None:
        """Insert or replace the record ``(kind, job, key)`` with the JSON-able ``value``."""
        address = (kind.value, job, key)
        self.deletes.discard(address)
        self.puts[address] = value

    def delete(self, kind: Kind, job: str, key: str) -> None:
        """Remove the record ``(kind, job, key)`` if present."""
        address = (kind.value, job, key)
        self.puts.pop(address, None)
        self.deletes.add(address)

    def __len__(self) -> int:
        return len(self.puts) + len(self.deletes)


class RecordStore:
    """SQLite (WAL) record store; one connection, serialised by a lock."""

    def __init__(self, path: str, *, synchronous: Literal["NORMAL", "FULL"] = "NORMAL", init: bool = False) -> None:
        """Open the database at ``path``, creating it when the file does not exist.

        An existing file that is empty (0 bytes) or not a KnitTrans state database is refused with
        :class:`StateError` (a silent reset would forget every job) unless ``init`` is True.
        """
        self.path = path
        self.synchronous = synchronous
        self._closed = False
        self._unchecked = 0
        """Record bytes committed since the last checkpoint."""
        self._lock = threading.Lock()
        existed = path != ":memory:" and os.path.exists(path)
        if existed and os.path.getsize(path) == 0 and not init:
            raise StateError(
                f"{path}: the state file is empty (0 bytes); refusing to start as an empty "
                "control plane; pass --init to initialise it on purpose"
            )
        try:
            self._conn = _connect(path)
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if existed and not init and os.path.getsize(path) > 0 and "meta" not in tables:
                raise StateError(
                    f"{path}: not a KnitTrans state database (tables {sorted(tables)}); pass --init to use it anyway"
                )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(f"PRAGMA synchronous={synchronous}")
            self._conn.executescript(_SCHEMA)
            row = self._conn.execute("SELECT value FROM meta WHERE name='format'").fetchone()
        except sqlite3.Error as exc:
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self._conn.close()
            held = " (another process holds it: one control plane per state file)" if "locked" in str(exc) else ""
            raise StateError(f"{path}: cannot open the state database: {_cause(exc, path)}{held}") from exc
        if row is None:
            self._conn.execute("INSERT INTO meta(name, value) VALUES ('format', ?)", (STORE_FORMAT,))
        elif row[0] != STORE_FORMAT:
            raise StateError(f"{path}: state format {row[0]!r}, this version reads {STORE_FORMAT!r}")

    def commit(self, txn: Txn) -> None:
        """Write ``txn`` in one SQLite transaction (nothing when it is empty)."""
        if not len(txn):
            return
        puts = [(k, j, key, json.dumps(v, separators=(",", ":"))) for (k, j, key), v in txn.puts.items()]
        with self._lock:
            cur = self._conn.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE")
                try:
                    if txn.deletes:
                        cur.executemany("DELETE FROM records WHERE kind=? AND job=? AND key=?", list(txn.deletes))
                    if puts:
                        cur.executemany("INSERT OR REPLACE INTO records(kind, job, key, body) VALUES (?,?,?,?)", puts)
                    cur.execute("COMMIT")
                    self._unchecked += sum(len(p[3]) for p in puts) + 64 * len(txn)
                except BaseException:
                    if self._conn.in_transaction:  # SQLite may have rolled back already (disk full)
                        with contextlib.suppress(sqlite3.Error):
                            cur.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise Unavailable(f"state database {self.path} refused the write: {_cause(exc, self.path)}") from exc

    def checkpoint_if_due(self) -> bool:
        """Copy the WAL into the database once :data:`CHECKPOINT_BYTES` were committed since the last copy;
        returns whether it did.

        The service calls this after a change is published, so the copy (tens of milliseconds when the page
        cache is busy) is not inside the commit of an admission that a rank waits for, as SQLite's automatic
        checkpoint would be. A refused copy is logged and retried after the next change: the WAL only grows.
        """
        if self._unchecked < CHECKPOINT_BYTES:
            return False
        with self._lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as exc:
                logger.warning("state database %s: WAL checkpoint refused: %s", self.path, _cause(exc, self.path))
                return False
            self._unchecked = 0
        return True

    def load(self, kind: Kind) -> list[tuple[str, str, Any]]:
        """Every ``(job, key, value)`` of ``kind``, ordered by job then key."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT job, key, body FROM records WHERE kind=? ORDER BY job, key", (kind.value,)
            ).fetchall()
        return [(job, key, json.loads(body)) for job, key, body in rows]

    def close(self) -> None:
        """Close the connection (:meth:`reopen` connects again, e.g. when an app is started twice)."""
        with self._lock:
            self._conn.close()
            self._closed = True

    def reopen(self) -> None:
        """Connect again after :meth:`close`; a no-op while open."""
        with self._lock:
            if self._closed:
                self._conn = _connect(self.path)
                self._conn.execute(f"PRAGMA synchronous={self.synchronous}")
                self._closed = False


def _connect(path: str) -> sqlite3.Connection:
    """A connection to ``path`` in exclusive locking mode, set before its first read.

    In WAL mode SQLite otherwise keeps its WAL index in a ``-shm`` file mapped into memory and shared with
    other processes; a write to that mapping that the file system refuses (the file made immutable, its
    disk gone) is a SIGBUS that kills the process without a word. Exclusive mode keeps the index in the
    process's own memory (no ``-shm`` file), so such a fault is an I/O error: a 503 naming the cause, and
    the next write after the fault is repaired succeeds. It also holds the file for this process alone:
    a second control plane on the same state file is refused at start-up.
    """
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("PRAGMA wal_autocheckpoint=0")  # RecordStore.checkpoint_if_due, outside the commits
    return conn


def _cause(exc: sqlite3.Error, path: str) -> str:
    """What SQLite said, its error code, and which of the state's files cannot be written (if any)."""
    code = getattr(exc, "sqlite_errorname", None)
    text = f"{exc} ({code})" if code else str(exc)
    blocked = [p for p in (path, path + "-wal") if os.path.exists(p) and not os.access(p, os.W_OK)]
    if blocked:
        text += f"; not writable (read-only or immutable): {', '.join(blocked)}"
    return text
