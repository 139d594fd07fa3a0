"""The KnitTrans TransferQueue backend's life cycle: a checkpoint that survives its process being killed,
budget and spill keys, and ``tq.close()`` removing what the backend's stores kept."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transfer_queue as tq
from tensordict import TensorDict
from tq_support import ray_session, same, tq_conf

HERE = Path(__file__).parent


def _spawn(mode: str, work: Path) -> subprocess.Popen[bytes]:
    with (work / f"{mode}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, str(HERE / "tq_checkpoint_script.py"), mode, str(work)],
            cwd=HERE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ray's helpers go with it
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the process group the test started (gone already is fine), then reap the process."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_checkpoint_restores_every_row_after_its_process_is_killed(tmp_path: Path) -> None:
    """A process puts verl-style rows (one trajectory per put, media by field path), saves with
    tq.save_checkpoint and is killed (SIGKILL, its store directory then deleted); a fresh process and a fresh
    TransferQueue load the checkpoint and read every key, tag and row back equal (containers included)."""
    saver = _spawn("save", tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "saved").exists():
            assert saver.poll() is None, (tmp_path / "save.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        units = list((tmp_path / "ckpt" / "knittrans" / "tq-node-0").iterdir())
        assert units and all((u / "traj.arrow").stat().st_nlink == 2 for u in units)  # hard links of the store's files
    finally:
        _kill_group(saver)
    for d in (tmp_path / "stores-before").iterdir():  # nothing of the old stores is left to read
        shutil.rmtree(d)
    restorer = _spawn("restore", tmp_path)
    try:
        rc = restorer.wait(300)
    finally:
        _kill_group(restorer)
    log = (tmp_path / "restore.log").read_text()
    assert rc == 0 and "restored 6 rows" in log, log[-3000:]
    assert list((tmp_path / "stores-after").iterdir()) == []  # tq.close() removed the new stores' directories


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_budget_spills_and_close_removes_the_stores_directories(tmp_path: Path) -> None:
    """backend.KnitTrans.budget_bytes / spill_dir reach the bootstrap's store: puts past the budget land in the
    spill directory and still read back; tq.close() deletes the job's directories in both."""
    root, spill = tmp_path / "shm", tmp_path / "spill"
    section = {"store_root": str(root), "spill_dir": str(spill), "budget_bytes": 300_000, "host": "127.0.0.1"}
    backend = {"storage_backend": "KnitTrans", "KnitTrans": section}
    with ray_session(num_cpus=2):
        tq.init(tq_conf(backend))
        puts = [TensorDict({"x": torch.randn(4, 10_000) + i}, batch_size=4) for i in range(4)]  # 160 KB each
        for i, td in enumerate(puts):
            tq.kv_batch_put(keys=[f"k{i}-{j}" for j in range(4)], partition_id="p", fields=td)
        spilled = [p for p in spill.rglob("traj.arrow")]
        in_memory = [p for p in root.rglob("traj.arrow")]
        assert spilled and in_memory, (spilled, in_memory)
        got = tq.kv_batch_get(keys=[f"k{i}-{j}" for i in range(4) for j in range(4)], partition_id="p")
        same(list(got["x"].unbind()), [r for td in puts for r in td["x"].unbind(0)])
        tq.close()
    assert list(root.iterdir()) == [] and list(spill.iterdir()) == []
