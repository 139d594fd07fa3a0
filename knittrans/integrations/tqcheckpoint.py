"""Checkpoint and restore of the KnitTrans TransferQueue backend's units (``tq.save_checkpoint`` / ``load``)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from knittrans.errors import InvalidRequest, NotFound
from knittrans.integrations.tqstore import TQStoreCore
from knittrans.schema import MEDIA_SCHEMA, UnitTables
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, SealedUnit, write_table
from knittrans.tickets import Ticket, UnitRead

__all__ = ["CHECKPOINT_SUBDIR", "MANIFEST", "load_units", "save_units"]

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "knittrans"
"""Directory of the backend's files inside a TransferQueue checkpoint."""
MANIFEST = "manifest.json"
"""The list of saved units, inside :data:`CHECKPOINT_SUBDIR`."""
_FORMAT = 1


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(src, dst)


def _read_unit(core: TQStoreCore, node: str, unit_id: str) -> UnitTables:
    """A whole unit through its node (all rows and columns, then the media its rows name)."""
    client = core.client(node)
    job = core.config.job
    traj = client.get(Ticket(job=job, reads=(UnitRead(unit_id=unit_id),)))
    hashes = sorted({h.hex() for row in traj.column("media").to_pylist() for h in row})
    media = (
        client.get(Ticket(job=job, kind="media", reads=(UnitRead(unit_id=unit_id),), media_hashes=tuple(hashes)))
        if hashes
        else MEDIA_SCHEMA.empty_table()
    )
    return UnitTables(traj=traj, media=media)


def save_units(core: TQStoreCore, checkpoint_dir: str | Path) -> dict[str, Any]:
    """Save every unit of the job into ``checkpoint_dir``; returns the manifest written."""
    root = Path(checkpoint_dir) / CHECKPOINT_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    job = core.config.job
    units: list[dict[str, Any]] = []
    for node in sorted(core.config.stores):
        local = core.local_dirs(node)
        for info in core.client(node).list_units(job):
            unit_id = str(info["unit_id"])
            dest = root / node / unit_id
            dest.mkdir(parents=True, exist_ok=True)
            src = next((d / job / unit_id for d in local if (d / job / unit_id / TRAJ_FILE).is_file()), None)
            try:
                if src is not None:
                    files = [f for f in (TRAJ_FILE, MEDIA_FILE) if (src / f).is_file()]
                    for f in files:
                        _link_or_copy(src / f, dest / f)
                else:  # another host: through the node
                    tables = _read_unit(core, node, unit_id)
                    write_table(dest / TRAJ_FILE, tables.traj)
                    write_table(dest / MEDIA_FILE, tables.media)
                    files = [TRAJ_FILE, MEDIA_FILE]
            except (FileNotFoundError, NotFound):  # cleared while saving: nothing left to restore
                shutil.rmtree(dest, ignore_errors=True)
                logger.info("unit %s of %s was deleted while saving; not in the checkpoint", unit_id, node)
                continue
            units.append({"node": node, "unit_id": unit_id, "rows": int(info["num_rows"]), "files": files})
    manifest = {"format": _FORMAT, "job": job, "units": units}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    logger.info("saved %d KnitTrans units of job %s to %s", len(units), job, root)
    return manifest


def load_units(core: TQStoreCore, checkpoint_dir: str | Path) -> int:
    """Write every unit of the checkpoint's manifest back to its node; returns how many were written."""
    root = Path(checkpoint_dir) / CHECKPOINT_SUBDIR
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"KnitTrans checkpoint manifest not found: {path}")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != _FORMAT:
        raise InvalidRequest(f"{path}: unknown KnitTrans checkpoint format {manifest.get('format')!r}")
    if manifest["job"] != core.config.job:
        raise InvalidRequest(
            f"{path} holds units of job {manifest['job']!r}; backend.KnitTrans.job is {core.config.job!r}"
        )
    missing = sorted({u["node"] for u in manifest["units"]} - set(core.config.stores))
    if missing:
        raise InvalidRequest(
            f"the checkpoint has units on store nodes {missing}, which backend.KnitTrans.stores "
            f"{sorted(core.config.stores)} lacks; restore with the same nodes"
        )
    present = {
        node: {str(i["unit_id"]) for i in core.client(node).list_units(core.config.job)}
        for node in {u["node"] for u in manifest["units"]}
    }
    written = 0
    for unit in manifest["units"]:
        node, unit_id = unit["node"], unit["unit_id"]
        if unit_id in present[node]:
            continue
        saved = SealedUnit.open(core.config.job, unit_id, root / node / unit_id)  # memory-mapped, schema checked
        core.writer(node).write_tables(unit_id, UnitTables(traj=saved.traj, media=saved.media))
        written += 1
    logger.info("restored %d KnitTrans units of job %s from %s", written, core.config.job, root)
    return written
