"""Node-local unit store: pending units in temporaries, atomic seal, budget, spill, delete, rescan."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.ipc as ipc

from knittrans.errors import Conflict, InvalidRequest, NotFound, OverBudget, SchemaMismatch
from knittrans.names import check_name
from knittrans.schema import SCHEMA_VERSION, check_schema
from knittrans.store.budget import ByteBudget
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, SealedUnit, read_ticket
from knittrans.tickets import Ticket

__all__ = [
    "DEFAULT_ROOT",
    "PendingUnit",
    "SealSpec",
    "StoreConfig",
    "UnitStore",
    "writer_temp_name",
]

logger = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/dev/shm/knittrans")
"""Default store directory; units live under ``<root>/<job>/<unit>/``."""

_TMP, _DEL, _BAD = ".tmp-", ".del-", ".corrupt-"
_WRITER = "w"
"""Marks a writer's own temporary: ``.tmp-<unit>-w<hex>`` (the node's are ``.tmp-<unit>-<hex>``)."""


def writer_temp_name(unit_id: str) -> str:
    """A fresh name for a same-host writer's private temporary of ``unit_id`` in ``<root>/<job>/``
    (published by :meth:`UnitStore.publish_units`; dropped by the node's rescan when never published)."""
    return f"{_TMP}{unit_id}-{_WRITER}{secrets.token_hex(8)}"


def ipc_overhead(schema: pa.Schema) -> int:
    """Bytes an IPC file adds around its record batches: schema twice (header, footer), dictionaries."""
    return int(2 * schema.serialize().size + 4096)


Part = Literal["traj", "media"]
Abandoned = Callable[[], bool]
"""Polled while waiting for budget: True once the caller's call was cancelled."""


@dataclass(frozen=True, kw_only=True)
class SealSpec:
    """One unit of :meth:`UnitStore.seal_units` / :meth:`UnitStore.publish_units` and what its writer says it
    holds (None: not checked)."""

    unit_id: str
    """Unit to seal."""
    rows: int | None = None
    """Trajectory rows written."""
    media_rows: int | None = None
    """Media rows written."""
    num_bytes: int | None = None
    """Bytes of both IPC files."""


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where and how much a store node keeps."""

    root: Path = DEFAULT_ROOT
    """Store directory (tmpfs); jobs are subdirectories."""
    budget_bytes: int | None = None
    """Most bytes of units (sealed + being written) held in ``root``; None means unlimited. Units a
    same-host writer publishes (``publish_units``) are charged once written, so the directory may
    briefly hold a call's bytes above it."""
    spill_dir: Path | None = None
    """Disk directory that takes whole units when the budget is full; None means writers wait."""
    wait_timeout_s: float = 30.0
    """How long a writer waits for budget before OverBudget."""
    pending_ttl_s: float = 600.0
    """Pending (unsealed) units older than this are aborted when the next unit begins."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if self.spill_dir is not None:
            object.__setattr__(self, "spill_dir", Path(self.spill_dir))
            if Path(self.spill_dir).resolve() == Path(self.root).resolve():
                raise ValueError("spill_dir must differ from root")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive or None, not {self.budget_bytes}")
        if self.wait_timeout_s < 0 or self.pending_ttl_s <= 0:
            raise ValueError("wait_timeout_s must be >= 0 and pending_ttl_s > 0")


class PendingUnit:
    """A unit being written into a temporary directory; invisible to readers until sealed.

    Ownership rule (retries and races): each part (``traj``, ``media``) is written by one stream
    at a time. :meth:`claim` gives the stream a token; a second stream claiming a part that is
    being written gets :class:`Conflict`; a stream claiming a part that an earlier, finished or
    failed, stream wrote *replaces* it (the part starts empty again), so a retried upload never
    appends to a stale one. A failing stream resets only its own part, and only while it still
    owns it.
    """

    def __init__(self, store: UnitStore, job: str, unit_id: str) -> None:
        self.store, self.job, self.unit_id = store, job, unit_id
        self.created = time.monotonic()
        self.spilled = False
        self.reserved = 0
        self.dir: Path | None = None
        self.discarded = False
        self._writers: dict[str, tuple[pa.OSFile, ipc.RecordBatchFileWriter, pa.Schema]] = {}
        self._owners: dict[str, object] = {}
        self._part_reserved = {"traj": 0, "media": 0}
        self.received = {"traj": 0, "media": 0}
        """Payload bytes received per part (``RecordBatch.nbytes``), for the upload limit."""
        self.lock = threading.RLock()

    def charge(self, nbytes: int, timeout: float, abandoned: Abandoned | None) -> None:
        """Charge the unit's first ``nbytes`` to the budget (waiting up to ``timeout``), or mark it spilled when
        the budget is full and the store has a spill dir."""
        budget, spill = self.store.budget, self.store.config.spill_dir
        try:  # with a spill dir, a unit that does not fit now goes there instead of waiting
            budget.reserve(nbytes, timeout if spill is None else 0.0, abandoned=abandoned)
        except OverBudget:
            if spill is None:
                raise
            self.spilled = True
            logger.info(
                "budget full (%s/%s bytes): unit %s/%s goes to spill dir %s",
                budget.used,
                budget.limit,
                self.job,
                self.unit_id,
                spill,
            )
        else:
            self.reserved += nbytes

    def reserve(self, nbytes: int, abandoned: Abandoned | None = None) -> Path:
        """Reserve budget for ``nbytes`` more bytes; the first call picks memory or spill. Returns the dir."""
        wait = self.store.config.wait_timeout_s
        if self.dir is None:
            self.charge(nbytes, wait, abandoned)
            spill = self.store.config.spill_dir
            base = spill if self.spilled and spill is not None else self.store.config.root
            self.dir = base / self.job / f"{_TMP}{self.unit_id}-{secrets.token_hex(4)}"
            self.dir.mkdir(parents=True)
        elif not self.spilled:
            self.store.budget.reserve(nbytes, wait, abandoned=abandoned)
            self.reserved += nbytes
        return self.dir

    def claim(self, part: Part) -> object:
        """Make the calling stream the only writer of ``part``; an earlier stream's rows are dropped."""
        with self.lock:
            if self.discarded:
                raise Conflict(f"unit {self.unit_id!r} of job {self.job!r} was aborted; start it again")
            if part in self._owners:
                raise Conflict(
                    f"part {part!r} of unit {self.unit_id!r} (job {self.job!r}) is being "
                    "written by another stream; retry when that stream has ended"
                )
            if part in self._writers:
                logger.warning(
                    "unit %s/%s: a new stream replaces the %s bytes of part %r an earlier stream wrote",
                    self.job,
                    self.unit_id,
                    self.received[part],
                    part,
                )
                self._reset(part)
            token = object()
            self._owners[part] = token
            return token

    def release(self, part: Part, token: object, *, ok: bool) -> bool:
        """End the stream holding ``token``; a failed stream's rows of ``part`` are dropped. True when a failed
        stream leaves no stream writing and no rows kept (a failed first upload)."""
        with self.lock:
            if self._owners.get(part) is token:
                del self._owners[part]
                if not ok:
                    self._reset(part)
            return not ok and not self._owners and not self._writers

    def _reset(self, part: str) -> None:
        entry = self._writers.pop(part, None)
        if entry is not None:
            with contextlib.suppress(OSError, pa.ArrowException):
                entry[1].close()
            with contextlib.suppress(OSError, pa.ArrowException):
                entry[0].close()
        if self.dir is not None:
            with contextlib.suppress(OSError):
                (self.dir / (TRAJ_FILE if part == "traj" else MEDIA_FILE)).unlink()
        self.store.budget.release(self._part_reserved[part])
        self.reserved -= self._part_reserved[part]
        self._part_reserved[part] = 0
        self.received[part] = 0

    def write(
        self, part: Part, batch: pa.RecordBatch, *, token: object | None = None, abandoned: Abandoned | None = None
    ) -> None:
        """Append one record batch to ``traj`` or ``media`` (schema-checked, budget-reserved).

        With ``token`` (streams from :meth:`claim`) the write is refused once the stream lost the part.
        """
        with self.lock:
            if self.discarded:
                raise Conflict(f"unit {self.unit_id!r} of job {self.job!r} was aborted while being written")
            if token is not None and self._owners.get(part) is not token:
                raise Conflict(f"part {part!r} of unit {self.unit_id!r} is now written by another stream")
            entry = self._writers.get(part)
            if entry is None:
                check_schema(batch.schema, "trajectories" if part == "traj" else "media")
            elif not batch.schema.equals(entry[2]):
                raise SchemaMismatch(f"unit {self.unit_id!r}: batch schema changed within part {part!r}")
            extra = ipc_overhead(batch.schema) if entry is None else 0
            before = self.reserved
            path = self.reserve(ipc.get_record_batch_size(batch) + extra, abandoned)
            self._part_reserved[part] += self.reserved - before
            if entry is None:
                sink = pa.OSFile(str(path / (TRAJ_FILE if part == "traj" else MEDIA_FILE)), "wb")
                entry = (sink, ipc.new_file(sink, batch.schema), batch.schema)
                self._writers[part] = entry
            entry[1].write_batch(batch)
            self.received[part] += batch.nbytes

    def close_files(self) -> None:
        """Finish the IPC files (footers); idempotent."""
        for sink, writer, _ in self._writers.values():
            writer.close()
            sink.close()

    def discard(self) -> None:
        """Remove the temporary directory and give back the reservation."""
        with self.lock:
            self.discarded = True
            with contextlib.suppress(OSError, pa.ArrowException):
                self.close_files()
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
            self.store.budget.release(self.reserved)
            self.reserved = 0
            self._part_reserved = {"traj": 0, "media": 0}  # given back: a stream ending later must not again


def _file_size(path: Path) -> int:
    """Size of ``path`` in bytes; 0 when it does not exist (one ``stat``, not ``exists`` and then ``stat``)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _check_expected(unit: SealedUnit, spec: SealSpec) -> None:
    got = {"rows": unit.num_rows, "media_rows": unit.media.num_rows, "num_bytes": unit.num_bytes}
    bad = [f"{k} {n} (expected {v})" for k, n in got.items() if (v := getattr(spec, k)) is not None and v != n]
    if bad:
        raise Conflict(
            f"unit {unit.unit_id!r} of job {unit.job!r} does not hold what its writer sent: "
            f"{', '.join(bad)}; the unit was dropped, write it again"
        )


class UnitStore:
    """Units of every job on one node. Thread-safe; never imports ``pyarrow.flight``.

    API: ``begin(job, unit) -> PendingUnit`` (``DoPut`` writes into it); ``seal_units`` (all or none);
    ``publish_units`` (a same-host writer's own temporaries); ``abort``; ``delete``; ``get``; ``units(job)``;
    ``read(ticket) -> pa.Table``; ``stats()``.
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.budget = ByteBudget(config.budget_bytes)
        self._lock = threading.Lock()
        self._sealed: dict[tuple[str, str], SealedUnit] = {}
        self._pending: dict[tuple[str, str], PendingUnit] = {}
        self.recovered = 0
        self.quarantined = 0
        self._swept: dict[Path, float] = {}
        config.root.mkdir(parents=True, exist_ok=True)
        if config.spill_dir is not None:
            config.spill_dir.mkdir(parents=True, exist_ok=True)
        self._rescan()

    def _rescan(self) -> None:
        bases = [(self.config.root, False)]
        if self.config.spill_dir is not None:
            bases.append((self.config.spill_dir, True))
        for base, spilled in bases:
            for job_dir in sorted(p for p in base.iterdir() if p.is_dir()):
                try:
                    job = check_name(job_dir.name, "job")
                except InvalidRequest:
                    logger.warning("rescan: ignoring directory %s (not a job name)", job_dir)
                    continue
                for entry in sorted(job_dir.iterdir()):
                    if entry.name.startswith((_TMP, _DEL)):
                        logger.info("rescan: dropping unsealed temporary %s", entry)
                        shutil.rmtree(entry, ignore_errors=True)
                    elif not entry.name.startswith(_BAD):
                        self._recover(job, entry, spilled)

    def _recover(self, job: str, path: Path, spilled: bool) -> None:
        try:
            check_name(path.name, "unit_id")
            unit = SealedUnit.open(job, path.name, path, spilled=spilled)
        except (InvalidRequest, OSError) as exc:
            bad = path.with_name(f"{_BAD}{path.name}-{secrets.token_hex(4)}")
            logger.warning("rescan: quarantining %s as %s: %s", path, bad.name, exc)
            path.rename(bad)
            self.quarantined += 1
            return
        if not spilled:
            self.budget.force(unit.num_bytes)
        self._sealed[(job, unit.unit_id)] = unit
        self.recovered += 1
        logger.info(
            "rescan: recovered unit %s/%s (%s rows, %s bytes)", job, unit.unit_id, unit.num_rows, unit.num_bytes
        )

    def begin(self, job: str, unit_id: str, *, reuse: bool = False) -> PendingUnit:
        """Start a unit (its directory and budget come with its first write); Conflict when it exists (with
        ``reuse``, a pending unit of that id is returned instead)."""
        check_name(job, "job")
        check_name(unit_id, "unit_id")
        now = time.monotonic()
        with self._lock:
            if reuse and (job, unit_id) in self._pending:
                return self._pending[(job, unit_id)]
            for key, old in list(self._pending.items()):
                if now - old.created > self.config.pending_ttl_s:
                    logger.warning("aborting unit %s/%s: unsealed for %.0fs", *key, now - old.created)
                    del self._pending[key]
                    old.discard()
            if (job, unit_id) in self._sealed or (job, unit_id) in self._pending:
                raise Conflict(f"unit {unit_id!r} of job {job!r} already exists")
            pending = PendingUnit(self, job, unit_id)
            self._pending[(job, unit_id)] = pending
        return pending

    def abort(self, job: str, unit_id: str, *, only: PendingUnit | None = None) -> None:
        """Drop a pending unit and its temporary files; with ``only``, just when that is still the unit."""
        with self._lock:
            p = self._pending.get((job, unit_id))
            if p is None or (only is not None and p is not only):
                return
            del self._pending[(job, unit_id)]
        p.discard()

    def open_part(self, job: str, unit_id: str, part: Part) -> tuple[PendingUnit, object]:
        """The pending unit (begun if needed) and a claim on ``part`` for one upload stream."""
        while True:
            pending = self.begin(job, unit_id, reuse=True)  # one lookup under the store's lock: no race to begin
            try:
                return pending, pending.claim(part)
            except Conflict:
                if not pending.discarded:  # discarded: aborted in between, so begin afresh
                    raise

    def close_part(self, pending: PendingUnit, part: Part, token: object, *, ok: bool) -> None:
        """End an upload stream; a failed first upload that left nothing behind drops its pending unit."""
        if pending.release(part, token, ok=ok):
            self.abort(pending.job, pending.unit_id, only=pending)

    def _seal(self, job: str, spec: SealSpec) -> SealedUnit:
        """Validate the pending unit's files and publish them by an atomic directory rename.

        A unit without media has no ``media.arrow`` (readers take its absence as no media).
        The counts ``spec`` gives must match what was written; otherwise the unit is aborted with
        :class:`Conflict` and the writer starts over. A unit with a part still being written is
        refused (:class:`Conflict`) and left as is.
        """
        unit_id = spec.unit_id
        p = self._pending.get((job, unit_id))
        if p is None:
            raise NotFound(f"no unit {unit_id!r} of job {job!r} is being written")
        with p.lock:
            if p._owners:
                raise Conflict(
                    f"unit {unit_id!r} of job {job!r} cannot be sealed: parts "
                    f"{sorted(p._owners)} are still being written"
                )
            try:
                p.close_files()
                tmp = p.dir
                if tmp is None or not (tmp / TRAJ_FILE).exists():
                    raise InvalidRequest(f"unit {unit_id!r} has no trajectory rows; nothing to seal")
                unit = SealedUnit.open(job, unit_id, tmp, spilled=p.spilled)
                _check_expected(unit, spec)
                final = tmp.parent / unit_id
                os.rename(tmp, final)
            except BaseException:
                self.abort(job, unit_id, only=p)
                raise
        unit.path = final
        if not p.spilled:
            self.budget.force(unit.num_bytes)
            self.budget.release(p.reserved)
        with self._lock:
            self._pending.pop((job, unit_id), None)
            self._sealed[(job, unit_id)] = unit
        logger.debug("sealed unit %s/%s: %s rows, %s bytes", job, unit_id, unit.num_rows, unit.num_bytes)
        return unit

    def seal_units(self, job: str, units: Sequence[SealSpec]) -> list[SealedUnit]:
        """Seal each unit in order (validated, then renamed into place), all or none: when one fails, the units
        this call sealed before it are deleted and those after it aborted, then the error (naming the unit) is
        raised (the failing unit itself as :meth:`_seal` says: aborted, or left as is while a stream writes it)."""
        ids = [u.unit_id for u in units]
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"unit ids repeat within one seal: {sorted({u for u in ids if ids.count(u) > 1})}")
        sealed: list[SealedUnit] = []
        try:
            for u in units:
                sealed.append(self._seal(job, u))
        except BaseException:
            for unit in sealed:
                with contextlib.suppress(NotFound):
                    self.delete(job, unit.unit_id)
            for u in units[len(sealed) + 1 :]:
                self.abort(job, u.unit_id)
            raise
        return sealed

    def publish_units(
        self,
        job: str,
        units: Sequence[tuple[SealSpec, str | os.PathLike[str]]],
        *,
        timeout: float | None = None,
        abandoned: Abandoned | None = None,
    ) -> list[SealedUnit]:
        """Publish units a same-host writer wrote into its own temporaries, all or none (one round trip).

        Each ``(spec, dir)``: ``dir`` is a writer's temporary (:func:`writer_temp_name`) in ``<root>/<job>/``
        holding the unit's IPC files (no ``media.arrow``: no media). Per unit, in order, the budget is charged
        the files' size (waiting up to what is left of ``timeout``; with a spill dir the unit moves there
        instead), then :meth:`seal_units` seals them. When one unit fails, the units this call sealed are
        deleted and every temporary of the call is removed; the error names the unit.
        """
        check_name(job, "job")
        ids = [spec.unit_id for spec, _ in units]
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"unit ids repeat within one publish: {sorted({u for u in ids if ids.count(u) > 1})}")
        job_dir = (self.config.root / job).resolve()
        dirs = [self._writer_temp(job, job_dir, spec.unit_id, d) for spec, d in units]
        self._sweep_writer_temps(job_dir)
        wait = self.config.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        begun: list[PendingUnit] = []
        try:
            for (spec, _), tmp in zip(units, dirs, strict=True):
                p = self.begin(job, spec.unit_id)
                begun.append(p)
                size = _file_size(tmp / TRAJ_FILE) + _file_size(tmp / MEDIA_FILE)
                p.charge(size, max(0.0, deadline - time.monotonic()), abandoned)
                if p.spilled and self.config.spill_dir is not None:
                    moved = self.config.spill_dir / job / tmp.name
                    moved.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(tmp), str(moved))
                    tmp = moved
                p.dir = tmp
            return self.seal_units(job, [spec for spec, _ in units])
        except BaseException:  # what seal_units undid already is gone: aborting it again does nothing
            for p in begun:
                self.abort(job, p.unit_id, only=p)
            for tmp in dirs:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _writer_temp(self, job: str, job_dir: Path, unit_id: str, given: str | os.PathLike[str]) -> Path:
        """The writer's temporary ``given`` of ``unit_id``, checked to be a directory of this job here."""
        check_name(unit_id, "unit_id")
        path = Path(given)
        if (
            not path.name.startswith(f"{_TMP}{unit_id}-{_WRITER}")
            or path.is_symlink()
            or not path.is_dir()
            # job_dir is resolved: a parent spelled the same is it (resolving looks at every component)
            or (str(path.parent) != str(job_dir) and path.parent.resolve() != job_dir)
        ):
            raise Conflict(
                f"unit {unit_id!r} of job {job!r}: {str(path)!r} is not a writer's temporary in this node's "
                f"directory {job_dir} (a directory {_TMP}{unit_id}-{_WRITER}...): is the node on another host? "
                "(a writer there sends its units over DoPut)"
            )
        return job_dir / path.name

    def _sweep_writer_temps(self, job_dir: Path) -> None:
        """Remove writers' temporaries of this job older than ``pending_ttl_s`` (their writer died);
        looks at most once every tenth of that time."""
        now = time.monotonic()
        if now - self._swept.get(job_dir, -math.inf) < self.config.pending_ttl_s / 10:
            return
        self._swept[job_dir] = now
        horizon = time.time() - self.config.pending_ttl_s
        with contextlib.suppress(OSError):
            for entry in job_dir.iterdir():
                if entry.name.startswith(_TMP) and f"-{_WRITER}" in entry.name:
                    with contextlib.suppress(OSError):
                        if entry.stat().st_mtime < horizon:
                            logger.warning(
                                "removing writer temporary %s: unpublished for over %.0fs",
                                entry,
                                self.config.pending_ttl_s,
                            )
                            shutil.rmtree(entry, ignore_errors=True)

    def get(self, job: str, unit_id: str) -> SealedUnit:
        """A sealed unit; NotFound (naming job and unit) otherwise."""
        unit = self._sealed.get((job, unit_id))
        if unit is None:
            check_name(job, "job")
            check_name(unit_id, "unit_id")
            raise NotFound(f"unit {unit_id!r} of job {job!r} is not on this node")
        return unit

    def units(self, job: str | None = None) -> list[SealedUnit]:
        """Sealed units, of one job or all."""
        with self._lock:
            return [u for (j, _), u in self._sealed.items() if job is None or j == job]

    def delete(self, job: str, unit_id: str) -> None:
        """Delete a sealed unit (rename out of sight, then remove) or abort a pending one."""
        with self._lock:
            unit = self._sealed.pop((job, unit_id), None)
            pending = self._pending.pop((job, unit_id), None) if unit is None else None
        if pending is not None:
            pending.discard()
            return
        if unit is None:
            self.get(job, unit_id)  # raises NotFound naming the unit
            return
        doomed = unit.path.with_name(f"{_DEL}{unit_id}-{secrets.token_hex(4)}")
        os.rename(unit.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        if not unit.spilled:
            self.budget.release(unit.num_bytes)

    def read(self, ticket: Ticket) -> pa.Table:
        """Rows × columns (``rows`` ticket) or media rows (``media`` ticket) as zero-copy slices."""
        return read_ticket(ticket, self.get, self.units)

    def stats(self) -> dict[str, object]:
        """Counts and bytes for the ``stats`` action."""
        units = self.units()
        return {
            "schema_version": SCHEMA_VERSION,
            "units": len(units),
            "rows": sum(u.num_rows for u in units),
            "bytes_in_memory": sum(u.num_bytes for u in units if not u.spilled),
            "bytes_spilled": sum(u.num_bytes for u in units if u.spilled),
            "budget_bytes": self.budget.limit,
            "budget_used": self.budget.used,
            "pending": len(self._pending),
            "recovered": self.recovered,
            "quarantined": self.quarantined,
        }
