"""``TrajectoryWriter``: write whole GRPO groups as one sealed storage unit and describe it.

API::

    writer = TrajectoryWriter(job="j", node_id="node-0", endpoint="grpc://127.0.0.1:8815",
                              store_dir="/dev/shm/knittrans")     # None -> always DoPut
    desc: UnitDescriptor = writer.write_groups([TrajectoryGroup(...), ...])

    # with a control-plane client the writer registers what it writes (write -> seal -> register):
    writer = TrajectoryWriter(job="j", node_id="node-0", endpoint="grpc://...", control=ControlClient(url))
    writer.write_groups(groups)                          # one unit, registered
    writer.write_units([groups_a, groups_b, ...])        # one unit each, one registration call for all

Same host (``store_dir`` given): the node reserves budget (``reserve`` action, waiting for space
or choosing the spill dir) and hands out a temporary directory; the writer writes the two IPC
files there itself and asks the node to ``seal`` (atomic rename). Otherwise the unit goes over
``DoPut`` (two puts and a ``seal``). Media are deduplicated by content hash within the unit by
:func:`knittrans.schema.build_unit_tables`.

Versions in the descriptor, per group: ``version_start`` = min over its trajectories,
``version_end`` = max, ``version_weighted`` = mean of the trajectories' ``version_weighted``
weighted by response tokens (each trajectory's own value defaults to the mean of its start and
end; pass ``TrajectoryGroup.version_weighted`` for the exact token-weighted value).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from knittrans.controlclient import ControlClient
from knittrans.descriptors import GroupRecord, UnitDescriptor
from knittrans.errors import Conflict, KnitTransError
from knittrans.flight.client import StoreClient
from knittrans.names import check_name
from knittrans.schema import SCHEMA_VERSION, TrajectoryGroup, UnitTables, build_unit_tables
from knittrans.store.store import estimate_unit_bytes
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, write_table
from knittrans.userfields import UserField, parse_user_fields

__all__ = ["TrajectoryWriter", "describe_unit"]

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
    """Build the control-plane descriptor of a unit from its trajectory table (vectorised per column)."""
    traj = tables.traj
    plen = pc.list_value_length(traj.column("prompt_ids")).to_numpy()
    rlen = pc.list_value_length(traj.column("response_ids")).to_numpy()
    vs = traj.column("version_start").to_numpy()
    ve = traj.column("version_end").to_numpy()
    vw = traj.column("version_weighted").to_numpy().astype(np.float64)
    fin = traj.column("finished_at").cast("int64").to_numpy() / 1e6
    media = traj.column("media").to_pylist()
    records, row = [], 0
    for g in groups:
        n = g.num_responses
        sl = slice(row, row + n)
        w = rlen[sl].astype(np.float64)
        weighted = float((vw[sl] * w).sum() / w.sum()) if w.sum() > 0 else float(vw[sl].mean())
        hashes = list(dict.fromkeys(h.hex() for hs in media[sl] for h in hs))
        records.append(
            GroupRecord(
                group_id=g.group_id,
                source=g.source,
                row_start=row,
                num_trajectories=n,
                trajectory_tokens=tuple(int(x) for x in plen[sl] + rlen[sl]),
                version_start=int(vs[sl].min()),
                version_end=int(ve[sl].max()),
                version_weighted=weighted,
                finished_at=float(fin[sl].max()),
                media_hashes=tuple(hashes),
            )
        )
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
        user_fields: Sequence[UserField] | Mapping[str, str] = (),
        control: ControlClient | None = None,
    ) -> None:
        self.job = check_name(job, "job")
        self.user_fields: tuple[UserField, ...] = (
            parse_user_fields(user_fields) if isinstance(user_fields, Mapping) else tuple(user_fields)
        )
        """The job's declared user fields (``JobSpec.user_fields``); every group must give each."""
        self.node_id = check_name(node_id, "node_id")
        self.endpoint = endpoint
        self.store_dir = Path(store_dir).resolve() if store_dir is not None else None
        self.timeout_s = timeout_s
        self.client = StoreClient(endpoint, token=token)
        self.control = control
        """When given, every unit written is registered with it (the caller keeps owning the client)."""

    def new_unit_id(self) -> str:
        """A fresh unit id: ``<node_id>-<16 hex>`` (node ids are at most 128 chars; trimmed to fit)."""
        return f"{self.node_id[:100]}-{uuid.uuid4().hex[:16]}"

    def write_groups(self, groups: Sequence[TrajectoryGroup], *, unit_id: str | None = None) -> UnitDescriptor:
        """Build, validate, store and seal ``groups`` as one unit, register it when the writer has a
        ``control`` client; return its descriptor."""
        desc = self._write(groups, unit_id)
        if self.control is not None:
            self.control.register_units(self.job, [desc])
        return desc

    def write_units(self, units: Sequence[Sequence[TrajectoryGroup]]) -> list[UnitDescriptor]:
        """Write each group list as its own unit, then register them all in one call (with ``control``);
        descriptors in the order of ``units``.

        Registration is all or none: a failure leaves the written units sealed but unregistered (a
        retry of the registration with the returned descriptors is a no-op for those that made it).
        """
        # One unit after the other: writing them from a thread pool was measured slower (put_path.py: the
        # build is Python and holds the GIL; the node round trips it would overlap are short).
        descs = [self._write(groups, None) for groups in units]
        if self.control is not None and descs:
            self.control.register_units(self.job, descs)
        return descs

    def _write(self, groups: Sequence[TrajectoryGroup], unit_id: str | None) -> UnitDescriptor:
        unit_id = check_name(unit_id or self.new_unit_id(), "unit_id")
        for g in groups:
            check_name(g.group_id, "group_id")
            check_name(g.source, "source")
        tables = build_unit_tables(groups, user_fields=self.user_fields)
        info = self.write_tables(unit_id, tables)
        return describe_unit(
            tables,
            groups,
            unit_id=unit_id,
            job=self.job,
            node_id=self.node_id,
            endpoint=self.endpoint,
            num_bytes=int(info["num_bytes"]),
        )

    def write_tables(self, unit_id: str, tables: UnitTables) -> dict[str, Any]:
        """Store prepared tables as unit ``unit_id``; returns the node's info on the sealed unit."""
        if self.store_dir is None:
            return self.client.put_unit(self.job, unit_id, tables.traj, tables.media)
        need = estimate_unit_bytes(tables.traj, tables.media)
        grant = self.client.reserve(self.job, unit_id, need, timeout_s=self.timeout_s)
        tmp = Path(grant["dir"]).resolve()
        try:
            if not grant["spilled"] and self.store_dir not in tmp.parents:
                raise Conflict(
                    f"store node {self.endpoint} writes to {tmp}, not under this writer's "
                    f"store_dir {self.store_dir}: is the node on another host?"
                )
            write_table(tmp / TRAJ_FILE, tables.traj)
            write_table(tmp / MEDIA_FILE, tables.media)
            size = (tmp / TRAJ_FILE).stat().st_size + (tmp / MEDIA_FILE).stat().st_size
            return self.client.seal(
                self.job, unit_id, rows=tables.traj.num_rows, media_rows=tables.media.num_rows, num_bytes=size
            )
        except BaseException:
            try:
                self.client.delete(self.job, unit_id)
            except KnitTransError as exc:
                logger.warning("could not abort unit %s/%s: %s", self.job, unit_id, exc)
            raise

    def close(self) -> None:
        """Close the connection to the node."""
        self.client.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
