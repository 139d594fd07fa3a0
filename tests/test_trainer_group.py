"""Ranks that share the control plane: two real rank processes under torch.distributed (gloo), one manifest
request and one fetched and ack request per mini-batch for the whole trainer, the same answers on every rank."""

from __future__ import annotations

import json
import multiprocessing
import traceback
from pathlib import Path
from typing import Any

from knittrans.local import LocalCluster
from knittrans.procs import free_port
from tests.trainer_support import job_spec, mm_groups, write_and_register

WORLD = 2


def _rank(rank: int, port: int, control_url: str, job: str, out: str) -> None:
    """One rank process: join the gloo group, consume every mini-batch with the client's defaults, record it."""
    import datetime

    import torch.distributed as dist

    from knittrans.trainer.client import TrainerClient, TrainerConfig

    record: dict[str, Any] = {"rank": rank, "rows": [], "versions": [], "fetched": []}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )
        config = TrainerConfig(control_url=control_url, job=job, rank=rank, world_size=WORLD)
        with TrainerClient(config) as client:
            record["collective"] = client.collective is not None
            for mb in client.minibatches():
                record["rows"] += [f"{r.group_id}.{r.row}" for m in mb for r in m.rows]
                record["fetched"].append(mb.report_fetched())
                mb.ack(version=mb.policy_version + 1)
                record["versions"].append(mb.policy_version + 1)
            record["requests"] = client.feed.requests
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        record["error"] = traceback.format_exc()
    Path(out).write_text(json.dumps(record))


def test_ranks_share_one_request_per_mini_batch(cluster: LocalCluster, tmp_path: Path) -> None:
    """With torch.distributed running, rank 0 alone reads the manifests (rank 1 makes no request) and reports
    fetched and ack for both ranks: every row is trained exactly once, each rank's transfer figures reach the
    control plane from the one gathered ack, and the ack's version is the job's version."""
    job = "group"
    control = cluster.control()
    control.create_job(job_spec(job, groups=4, group_size=4, k=2, world_size=WORLD, micro_batch_size=2))
    descs = write_and_register(control, job, cluster.stores, mm_groups("grp", 4, group_size=4), groups_per_unit=2)
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, cluster.control_url, job, str(outs[r]))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    records = [json.loads(o.read_text()) for o in outs]
    for r in records:
        assert "error" not in r, r["error"]
        assert r["collective"] and r["fetched"] == [True, True] and r["versions"] == [1, 2]
    assert records[1]["requests"] == 0 and records[0]["requests"] >= 2
    expected = {f"{g.group_id}.{g.row_start + i}" for d in descs for g in d.groups for i in range(g.num_trajectories)}
    rows = records[0]["rows"] + records[1]["rows"]
    assert len(rows) == len(expected) == 16 and set(rows) == expected
    assert control.status(job)["state"] == "completed" and control.get_version(job) == 2
    ranks = {r["rank"]: r for r in control.overview()["jobs"][0]["ranks"]}
    assert [ranks[r]["mini_batches"] for r in range(WORLD)] == [2, 2]
    assert all(ranks[r]["row_bytes"] > 0 for r in range(WORLD))


def test_a_torch_distributed_world_other_than_the_jobs_is_not_used(tmp_path: Path) -> None:
    """``group="auto"`` uses ``torch.distributed`` only where its rank and world size are the job's: a process
    group of another shape (e.g. a trainer's tensor-parallel world) leaves each rank reading for itself."""
    import torch.distributed as dist

    from knittrans.trainer.client import TrainerConfig, _torch_collectives

    def config(world_size: int) -> TrainerConfig:
        return TrainerConfig(control_url="http://127.0.0.1:1", job="j", rank=0, world_size=world_size)

    assert _torch_collectives(config(1)) is None  # not initialised
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert _torch_collectives(config(2)) is None
        collectives = _torch_collectives(config(1))
        assert collectives is not None and all(c.rank == 0 and c.size == 1 for c in collectives)
    finally:
        dist.destroy_process_group()
