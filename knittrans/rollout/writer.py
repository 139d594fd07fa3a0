"""``TrajectoryWriter``: write whole GRPO groups as sealed units and describe them (docs/explanation/rollout.md)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from knittrans.controlclient import ControlClient
from knittrans.descriptors import UnitDescriptor, checked_group
from knittrans.errors import Conflict, InvalidRequest, KnitTransError, NotFound
from knittrans.flight.client import StoreClient
from knittrans.names import check_name
from knittrans.rollout.registrar import Registrar
from knittrans.schema import SCHEMA_VERSION, TrajectoryGroup, UnitTables, build_units_tables
from knittrans.store.store import writer_temp_name
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, write_table
from knittrans.userfields import parse_user_fields

__all__ = ["TrajectoryWriter", "describe_unit", "write_units_across"]

logger = logging.getLogger(__name__)


def describe_unit(
    tables: UnitTables,
    groups: Sequence[TrajectoryGroup],
    *,
    unit_id: str,
    job: str,
    node_id: str,
    endpoint: str,
    num_bytes: int,
) -> UnitDescriptor:
    """Build the control-plane descriptor of a unit from its trajectory table (vectorised per column:
    per-group minima, maxima and sums are segment reductions over the group's rows).

    The tables are what :func:`build_units_tables` made and validated from ``groups``: the group records
    skip their per-field checks, which cannot fail for such rows; the unit's checks still run, and the
    control plane checks everything again on registration."""
    traj = tables.traj
    sizes = np.fromiter((g.num_responses for g in groups), dtype=np.int64, count=len(groups))
    starts = np.zeros(len(groups), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    cols = {c: _one_chunk(traj, c) for c in _DESCRIBED}
    plen = np.diff(cols["prompt_ids"].offsets.to_numpy())
    rlen = np.diff(cols["response_ids"].offsets.to_numpy())
    tokens = (plen.astype(np.int64) + rlen).tolist()
    vs = np.minimum.reduceat(cols["version_start"].to_numpy(), starts).tolist()
    ve = np.maximum.reduceat(cols["version_end"].to_numpy(), starts).tolist()
    vw = cols["version_weighted"].to_numpy().astype(np.float64)
    w = rlen.astype(np.float64)
    wsum = np.add.reduceat(w, starts)
    weighted = np.where(
        wsum > 0, np.add.reduceat(vw * w, starts) / np.where(wsum > 0, wsum, 1.0), np.add.reduceat(vw, starts) / sizes
    ).tolist()
    fin = (np.maximum.reduceat(cols["finished_at"].to_numpy().astype(np.int64), starts) / 1e6).tolist()
    media_refs = cols["media"]
    media = media_refs.to_pylist() if media_refs.offsets[-1].as_py() > media_refs.offsets[0].as_py() else None
    records, row = [], 0
    for k, g in enumerate(groups):
        n = g.num_responses
        hashes = () if media is None else tuple(dict.fromkeys(h.hex() for hs in media[row : row + n] for h in hs))
        record = {
            "group_id": g.group_id,
            "source": g.source,
            "row_start": row,
            "num_trajectories": n,
            "trajectory_tokens": tuple(tokens[row : row + n]),
            "version_start": vs[k],
            "version_end": ve[k],
            "version_weighted": weighted[k],
            "finished_at": fin[k],
            "media_hashes": hashes,
        }
        # the tables passed build_units_tables' checks: every field holds (a test compares with checked records)
        records.append(checked_group(record))
        row += n
    return UnitDescriptor(
        unit_id=unit_id,
        job=job,
        node_id=node_id,
        endpoint=endpoint,
        num_rows=traj.num_rows,
        num_bytes=num_bytes,
        schema_version=SCHEMA_VERSION,
        groups=tuple(records),
    )


_DESCRIBED = ("prompt_ids", "response_ids", "version_start", "version_end", "version_weighted", "finished_at", "media")
"""Trajectory columns a unit descriptor is computed from."""


def _one_chunk(table: pa.Table, name: str) -> Any:
    """Column ``name`` as one array (its only chunk, or the chunks combined)."""
    col = table.column(name)
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _new_senders() -> None:
    global _SENDERS
    _SENDERS = ThreadPoolExecutor(32, thread_name_prefix="knittrans-write")  # its threads start on first use


_SENDERS: ThreadPoolExecutor
"""The writers' shared sender threads (a forked child gets its own: the parent's threads are not in it)."""
_new_senders()
os.register_at_fork(after_in_child=_new_senders)


def _send_async(fn: Any, *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` in the writers' shared sender threads (kept for later puts).

    A new ``threading.Thread`` per node and put made the caller wait, in ``start()``, until the new
    thread had run, a scheduling delay on the critical path of a put on a busy host; handing work to
    a waiting thread does not wait. The tasks (a node's round trip) never wait on each other; more
    than 32 at once queue. Once the interpreter is shutting down (a put from an ``atexit`` hook), when
    executors take no more work, ``fn`` runs in the caller's thread."""
    try:
        return _SENDERS.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A writer's units ready to go to its node: built, names checked, and (same host) their IPC files
    already written into the writer's temporaries, so that what is left is the node's round trip."""

    ids: list[str]
    units: Sequence[Sequence[TrajectoryGroup]]
    tables: Sequence[UnitTables]
    entries: list[dict[str, Any]] | None
    """Same host: the ``publish_units`` entries of the temporaries written; None: nothing written yet."""


def write_units_across(
    batches: Sequence[tuple[TrajectoryWriter, Sequence[Sequence[TrajectoryGroup]]]],
) -> list[list[UnitDescriptor]]:
    """:meth:`TrajectoryWriter.write_units` on several store nodes at once, registered in one request.

    ``batches``: ``(writer, units)`` pairs, one writer per node, all of one job. The rows of all the
    units are built together (as one ``write_units`` call builds its units); then, node by node, a
    same-host writer's IPC files are written into its temporaries and the node's round trip (its
    ``publish_units`` call, or the ``DoPut`` upload) is handed to a sender thread (kept between calls),
    so that the nodes work at once while this thread writes the next node's files and then describes
    all the units; all the descriptors are registered in one request, in the background, by the first
    writer that has a control-plane client (none: not registered); descriptors per pair, in order.

    Storing is all or none across the nodes: when one writer fails, the units the others stored are
    removed and the first failure (in ``batches`` order) is raised. Registration is as in
    ``write_units``: its failure is raised by that writer's next call, ``flush`` or ``close`` and leaves
    the units sealed but unregistered (not consumable). An earlier registration failure of any of the
    writers is raised first, before anything is written.
    """
    if not batches:
        return []
    jobs = {w.job for w, _ in batches}
    if len(jobs) != 1:
        raise InvalidRequest(f"write_units_across: every writer must write the same job, not {sorted(jobs)}")
    if len({id(w) for w, _ in batches}) != len(batches):
        raise InvalidRequest("write_units_across: one pair per writer (give a writer all its units at once)")
    return _write([(w, units, [None] * len(units)) for w, units in batches])


def _write(
    batches: Sequence[tuple[TrajectoryWriter, Sequence[Sequence[TrajectoryGroup]], Sequence[str | None]]],
) -> list[list[UnitDescriptor]]:
    """:func:`write_units_across` of checked ``(writer, units, unit ids)`` triples (None: a fresh id); also
    every ``TrajectoryWriter`` write (one triple)."""
    for w, _, _ in batches:
        w.check()
    registrar = next((w._registrar for w, _, _ in batches if w._registrar is not None), None)
    built: list[Sequence[UnitTables] | None] = [None] * len(batches)
    fields = batches[0][0].user_fields
    if all(w.user_fields == fields for w, _, _ in batches):  # one build for every writer's units, then cut
        tables = build_units_tables([u for _, units, _ in batches for u in units], user_fields=fields)
        start = 0
        for k, (_, units, _) in enumerate(batches):
            built[k] = tables[start : start + len(units)]
            start += len(units)
    staged: list[_Staged] = []
    infos: list[list[dict[str, Any]] | None] = [None] * len(batches)
    answers: dict[int, Callable[[], list[dict[str, Any]]]] = {}
    failed: BaseException | None = None
    try:  # each node's round trip starts as soon as its files are written (the next node's overlap it)
        for k, ((writer, units, ids), tabs) in enumerate(zip(batches, built, strict=True)):
            staged.append(writer._stage(units, ids, tabs))
            if staged[k].ids:  # a writer without units this time has no round trip to start
                answers[k] = _send_async(writer._send, staged[k]).result  # waits for the node's infos
        drafts = [w._describe(st) for (w, _, _), st in zip(batches, staged, strict=True)]  # while the nodes store
    except BaseException as exc:
        failed = exc
    for k, answer in answers.items():  # every started node's answer read from its sender thread, in order
        try:
            infos[k] = answer()
        except BaseException as exc:  # the first failure is raised below
            failed = failed or exc
    if failed is not None:
        for (writer, _, _), st, info in zip(batches, staged, infos, strict=False):
            if info:
                writer._abort(st.ids)
        raise failed
    out = [  # each unit's byte count as its node reported it
        [dataclasses.replace(d, num_bytes=int(i["num_bytes"])) for d, i in zip(descs, info or [], strict=True)]
        for descs, info in zip(drafts, infos, strict=True)
    ]
    if registrar is not None:
        registrar.submit([d for descs in out for d in descs])
    return out


class TrajectoryWriter:
    """Writes units of one job to one store node (same host: shared directory; else ``DoPut``)."""

    def __init__(
        self,
        *,
        job: str,
        node_id: str,
        endpoint: str,
        store_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout_s: float = 30.0,
        user_fields: Mapping[str, str] | None = None,
        control: ControlClient | None = None,
    ) -> None:
        self.job = check_name(job, "job")
        self.user_fields = parse_user_fields(user_fields)
        """The job's declared user fields, parsed from ``{name: type}`` (``JobSpec.user_fields``); every group must give
        each."""
        self.node_id = check_name(node_id, "node_id")
        self.endpoint = endpoint
        self.store_dir = Path(store_dir).resolve() if store_dir is not None else None
        self.timeout_s = timeout_s
        self.client = StoreClient(endpoint, token=token)
        # with ``control`` every unit written is registered in the background (the caller keeps owning the client;
        # flush() waits for the registrations)
        self._registrar = Registrar(self.job, control.register_units, _send_async) if control is not None else None

    def new_unit_id(self) -> str:
        """A fresh unit id: ``<node_id>-<16 hex>`` (node ids are at most 128 chars; trimmed to fit)."""
        return f"{self.node_id[:100]}-{uuid.uuid4().hex[:16]}"

    def write_groups(self, groups: Sequence[TrajectoryGroup], *, unit_id: str | None = None) -> UnitDescriptor:
        """Build, validate, store and seal ``groups`` as one unit, registered in the background when the writer
        has a ``control`` client; return its descriptor."""
        return _write([(self, [groups], [unit_id])])[0][0]

    def write_units(self, units: Sequence[Sequence[TrajectoryGroup]]) -> list[UnitDescriptor]:
        """Write each group list as its own unit, then (with ``control``) have them all registered in one
        request, in the background; descriptors in the order of ``units``.

        The units are built together (one Arrow table for all rows, cut into one slice per unit),
        published in one round trip (same host; over ``DoPut`` one seal for all), and registered in
        one request. Storing is all or none: when one unit fails, none stays on the node.
        Registration is all or none too: its failure (raised by the next call, :meth:`flush` or
        :meth:`close`, see :mod:`knittrans.rollout.registrar`) leaves the units sealed but unregistered.
        An earlier registration failure is raised first, before anything is written.
        """
        return _write([(self, units, [None] * len(units))])[0]

    def check(self) -> None:
        """Raise the oldest background registration failure not raised yet (the next call does so too)."""
        if self._registrar is not None:
            self._registrar.check()

    def flush(self) -> None:
        """Wait until every unit this writer had registered so far is registered; raise a registration
        failure (as :meth:`check`)."""
        if self._registrar is not None:
            self._registrar.flush()

    def _stage(
        self,
        units: Sequence[Sequence[TrajectoryGroup]],
        unit_ids: Sequence[str | None],
        built: Sequence[UnitTables] | None,
    ) -> _Staged:
        """Check the names, build the tables (unless ``built``) and, same host, write the IPC files into
        temporaries (removed again on failure): all but the node's part of storing ``units``."""
        ids = [check_name(u or self.new_unit_id(), "unit_id") for u in unit_ids]
        for groups in units:
            for g in groups:
                check_name(g.group_id, "group_id")
                check_name(g.source, "source")
        tables = build_units_tables(units, user_fields=self.user_fields) if built is None else built
        entries = None
        if self.store_dir is not None and ids:
            entries = self._write_temps(list(zip(ids, tables, strict=True)))
        return _Staged(ids=ids, units=units, tables=tables, entries=entries)

    def _send(self, staged: _Staged) -> list[dict[str, Any]]:
        """The node's part of storing staged units (all or none); the node's infos, in order."""
        if staged.entries is None:
            return self.write_tables_many(list(zip(staged.ids, staged.tables, strict=True)))
        return self._publish_temps(staged.entries)

    def _describe(self, staged: _Staged) -> list[UnitDescriptor]:
        """Descriptors of staged units (``num_bytes`` 0: the node gives it)."""
        return [
            describe_unit(
                t,
                groups,
                unit_id=uid,
                job=self.job,
                node_id=self.node_id,
                endpoint=self.endpoint,
                num_bytes=0,
            )
            for uid, t, groups in zip(staged.ids, staged.tables, staged.units, strict=True)
        ]

    def write_tables(self, unit_id: str, tables: UnitTables) -> dict[str, Any]:
        """Store prepared tables as unit ``unit_id``; returns the node's info on the sealed unit."""
        return self.write_tables_many([(unit_id, tables)])[0]

    def write_tables_many(self, units: Sequence[tuple[str, UnitTables]]) -> list[dict[str, Any]]:
        """Store prepared tables as units ``(unit_id, tables)``, all or none; the node's infos, in order.

        Same host: the IPC files written into the writer's own temporaries, then one ``publish_units``
        round trip. Otherwise: ``DoPut`` calls per unit, then one ``seal_units``. A failure removes every
        unit of the call from the node.
        """
        if not units:
            return []
        if self.store_dir is not None:
            return self._publish_temps(self._write_temps(units))
        seals: list[dict[str, Any]] = []
        # the units this call holds on the node, to remove on failure: each one from its upload on, unless the
        # node refused it as a unit it already had (not this call's)
        owned: list[str] = []
        try:
            for uid, t in units:
                owned.append(uid)
                try:
                    self.client.put_unit(self.job, uid, t.traj, t.media, seal=False)
                except Conflict:
                    owned.pop()
                    raise
                seals.append({"unit": uid, "rows": t.traj.num_rows, "media_rows": t.media.num_rows})
            return self.client.seal_units(self.job, seals)
        except BaseException:
            self._abort(owned)
            raise

    def _write_temps(self, units: Sequence[tuple[str, UnitTables]]) -> list[dict[str, Any]]:
        """Write each unit into a private temporary of the node's directory; the ``publish_units``
        entries. A failure removes the temporaries written."""
        assert self.store_dir is not None
        job_dir = self.store_dir / self.job
        job_dir.mkdir(parents=True, exist_ok=True)
        entries: list[dict[str, Any]] = []
        try:
            for uid, t in units:
                tmp = job_dir / writer_temp_name(uid)
                entries.append({"unit": uid, "dir": str(tmp)})
                tmp.mkdir()
                size = write_table(tmp / TRAJ_FILE, t.traj)
                if t.media.num_rows:  # no media: no media file (the node reads its absence as none)
                    size += write_table(tmp / MEDIA_FILE, t.media)
                entries[-1].update(rows=t.traj.num_rows, media_rows=t.media.num_rows, num_bytes=size)
        except BaseException:
            for e in entries:
                shutil.rmtree(e["dir"], ignore_errors=True)
            raise
        return entries

    def _publish_temps(self, entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """One ``publish_units`` of the temporaries written by :meth:`_write_temps` (budget, validation,
        rename; all or none). A failure removes the temporaries and the units."""
        try:
            return self.client.publish_units(self.job, entries, timeout_s=self.timeout_s)
        except BaseException as exc:
            for e in entries:
                shutil.rmtree(e["dir"], ignore_errors=True)
            if not isinstance(exc, Conflict):
                # Conflict: the node refused, already holding a unit of one of these ids, which is not
                # this call's (another writer's, or one a crash left) and must not be deleted here. On any
                # refusal the node has undone what the call did; what an error in transit left is removed.
                self._abort([e["unit"] for e in entries])
            raise

    def _abort(self, unit_ids: Sequence[str]) -> None:
        """Remove units of a failed write from the node (sealed or pending; gone already is fine)."""
        for uid in unit_ids:
            try:
                self.client.delete(self.job, uid)
            except NotFound:
                pass
            except KnitTransError as exc:
                logger.warning("could not abort unit %s/%s: %s", self.job, uid, exc)

    def close(self) -> None:
        """Wait for the background registrations (:meth:`flush`, raising a failure), close the connection to
        the node."""
        try:
            self.flush()
        finally:
            self.client.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
