"""A sealed storage unit on disk: memory-mapped tables, row/column selection, media lookup."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from knittrans.errors import InvalidRequest, NotFound, SchemaMismatch
from knittrans.names import check_name
from knittrans.schema import EMPTY_MEDIA, check_schema
from knittrans.tickets import Ticket, UnitRead

__all__ = ["MEDIA_FILE", "TRAJ_FILE", "LocalReader", "SealedUnit", "read_ticket", "write_table"]

TRAJ_FILE = "traj.arrow"
"""Trajectory IPC file inside a unit directory."""
MEDIA_FILE = "media.arrow"
"""Media IPC file inside a unit directory."""


def write_table(path: Path, table: pa.Table) -> int:
    """Write ``table`` as an Arrow IPC file (no fsync: tmpfs) and return its size in bytes.

    Through a 64 KiB buffer: the IPC writer writes each buffer of each column and its padding apart."""
    with pa.OSFile(str(path), "wb") as raw, pa.BufferedOutputStream(raw, buffer_size=_WRITE_BUFFER) as sink:
        with ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return int(sink.tell())


_WRITE_BUFFER = 64 << 10


_MAGIC = b"ARROW1"
_HEAD = 8  # magic + 2 bytes of padding
_TAIL = 10  # int32 footer length + magic


def _stream_part(buf: pa.Buffer) -> pa.Buffer:
    """The stream that an Arrow IPC file wraps: its bytes between the header and the footer.

    Reading it with ``ipc.open_stream`` gives the same table as ``ipc.open_file`` at half the
    fixed cost per file (no footer parse, no per-batch seek), which is most of a small unit's
    publish; the magic at both ends and the footer length are checked so that a cut or foreign
    file is still refused.
    """
    size = buf.size
    if size < _HEAD + _TAIL:
        raise ValueError(f"{size} bytes is too short")
    if buf.slice(0, 6).to_pybytes() != _MAGIC or buf.slice(size - 6, 6).to_pybytes() != _MAGIC:
        raise ValueError("no Arrow file magic at its start and end")
    footer = int.from_bytes(buf.slice(size - _TAIL, 4).to_pybytes(), "little", signed=True)
    if footer <= 0 or footer > size - _HEAD - _TAIL:
        raise ValueError(f"footer length {footer} does not fit a {size}-byte file")
    return buf.slice(_HEAD, size - _HEAD - _TAIL - footer)


def _open_table(path: Path, kind: str) -> pa.Table:
    try:
        buf = pa.memory_map(str(path), "r").read_buffer()
        table = ipc.open_stream(_stream_part(buf)).read_all()
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise SchemaMismatch(f"{path} is not a readable Arrow IPC file: {exc}") from None
    check_schema(table.schema, kind)  # type: ignore[arg-type]
    return table


@dataclass(kw_only=True)
class SealedUnit:
    """An immutable, memory-mapped unit: trajectory table plus its media table."""

    job: str
    """Job the unit belongs to."""
    unit_id: str
    """Unit id."""
    path: Path
    """Unit directory."""
    traj: pa.Table
    """Trajectory rows (memory-mapped)."""
    media: pa.Table
    """Unique media rows (memory-mapped)."""
    num_bytes: int
    """Bytes of both files on disk."""
    spilled: bool = False
    """True when the unit lives in the spill directory instead of memory."""
    inode: int = field(default=0)
    """Inode of the trajectory file (detects a replaced unit in caches)."""

    @classmethod
    def open(cls, job: str, unit_id: str, path: Path, *, spilled: bool = False) -> SealedUnit:
        """Memory-map a unit directory; raise SchemaMismatch when a file is unreadable or not ours."""
        traj_path = path / TRAJ_FILE
        traj = _open_table(traj_path, "trajectories")
        st = traj_path.stat()
        size = st.st_size
        media_path = path / MEDIA_FILE
        try:
            size += media_path.stat().st_size
        except FileNotFoundError:  # a unit without media may have no media file
            media = EMPTY_MEDIA
        else:
            media = _open_table(media_path, "media")
        return cls(
            job=job,
            unit_id=unit_id,
            path=path,
            traj=traj,
            media=media,
            num_bytes=size,
            spilled=spilled,
            inode=st.st_ino,
        )

    @property
    def num_rows(self) -> int:
        """Trajectory rows."""
        return int(self.traj.num_rows)

    @cached_property
    def media_index(self) -> dict[bytes, int]:
        """Media hash -> row in :attr:`media`."""
        return {h: i for i, h in enumerate(self.media.column("media_hash").to_pylist())}

    def info(self) -> dict[str, object]:
        """JSON-able summary."""
        return {
            "job": self.job,
            "unit_id": self.unit_id,
            "num_rows": self.num_rows,
            "num_bytes": self.num_bytes,
            "media_rows": self.media.num_rows,
            "spilled": self.spilled,
        }


def _project(table: pa.Table, columns: Sequence[str] | None, unit_id: str) -> pa.Table:
    if columns is None:
        return table
    unknown = [c for c in columns if c not in table.schema.names]
    if unknown:
        raise InvalidRequest(f"unit {unit_id!r} has no columns {unknown}; columns are {table.schema.names}")
    return table.select(list(columns))


def read_ticket(
    ticket: Ticket, lookup: Callable[[str, str], SealedUnit], job_units: Callable[[str], Sequence[SealedUnit]]
) -> pa.Table:
    """What a store's ``DoGet`` answers for ``ticket``, as zero-copy slices: rows × columns in read order, or the
    media rows it names (``lookup(job, unit_id)``: a sealed unit; ``job_units(job)``: all of a media ticket's job
    when it names no units)."""
    if ticket.kind == "media":
        units = [lookup(ticket.job, r.unit_id) for r in ticket.reads] or job_units(ticket.job)
        return _read_media(units, ticket.media_hashes)
    return _read_rows(lookup, ticket.job, ticket.reads, ticket.columns)


def _read_rows(
    lookup: Callable[[str, str], SealedUnit], job: str, reads: Iterable[UnitRead], columns: Sequence[str] | None
) -> pa.Table:
    pieces: list[pa.Table] = []
    for read in reads:
        unit = lookup(job, read.unit_id)
        table = _project(unit.traj, columns, read.unit_id)
        if not read.row_ranges:
            pieces.append(table)
        for start, stop in read.row_ranges:
            if stop > unit.num_rows:
                raise InvalidRequest(
                    f"unit {read.unit_id!r} has {unit.num_rows} rows; row range [{start}, {stop}) is out of range"
                )
            pieces.append(table.slice(start, stop - start))
    return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)


def _read_media(units: Sequence[SealedUnit], hashes: Iterable[str]) -> pa.Table:
    """Rows of the media tables for ``hashes`` (each once, in first-seen order)."""
    pieces: list[pa.Table] = []
    for hex_hash in dict.fromkeys(hashes):
        key = bytes.fromhex(hex_hash)
        for unit in units:
            row = unit.media_index.get(key)
            if row is not None:
                pieces.append(unit.media.slice(row, 1))
                break
        else:
            names = [u.unit_id for u in units]
            raise NotFound(f"media hash {hex_hash} is in none of the units {names}")
    return pa.concat_tables(pieces) if pieces else EMPTY_MEDIA


class LocalReader:
    """Same-host short-circuit: serve a :class:`Ticket` from store directories without a server.

    ``roots`` are the store's directory and, if it has one, its spill directory; opened units
    are cached and re-validated by inode, so a deleted unit is never served from the cache.
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        self.roots = [Path(r) for r in roots]
        self._cache: dict[tuple[str, str], SealedUnit] = {}

    def unit(self, job: str, unit_id: str) -> SealedUnit:
        """Open (or reuse) a sealed unit; NotFound when no root holds it."""
        check_name(job, "job")
        check_name(unit_id, "unit_id")
        for i, root in enumerate(self.roots):
            path = root / job / unit_id
            try:
                inode = os.stat(path / TRAJ_FILE).st_ino
            except FileNotFoundError:
                continue
            cached = self._cache.get((job, unit_id))
            if cached is not None and cached.inode == inode:
                return cached
            unit = SealedUnit.open(job, unit_id, path, spilled=i > 0)
            self._cache[(job, unit_id)] = unit
            return unit
        self._cache.pop((job, unit_id), None)
        raise NotFound(f"unit {unit_id!r} of job {job!r} is not in {[str(r) for r in self.roots]}")

    def read(self, ticket: Ticket) -> pa.Table:
        """Exactly what the store server's ``DoGet`` returns for ``ticket``."""
        return read_ticket(ticket, self.unit, self._job_units)

    def _job_units(self, job: str) -> list[SealedUnit]:
        names = {p.name for root in self.roots if (root / job).is_dir() for p in (root / job).iterdir()}
        return [self.unit(job, u) for u in sorted(names) if not u.startswith(".")]
