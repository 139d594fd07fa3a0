"""The state thread's cheaper paths: acks recorded in SQLite as one record per mini-batch (rank runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api_support import app_client, job_spec, single_group_units

from knittrans.api.records import Kind, index_key


def _rows(c: Any, kind: Kind) -> list[tuple[str, Any]]:
    """The committed records of ``kind``, read through the running app's own connection (the database is
    opened in exclusive locking mode, so a second connection cannot read it meanwhile)."""
    return [(key, value) for _, key, value in c.app.state.service.store.load(kind)]


def _report(c: Any, what: str, n: int, ranks: list[int] | None) -> dict[str, Any]:
    r = c.post(f"/v1/jobs/job1/minibatches/{n}/{what}", json={"attempt": 0, "ranks": ranks})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def test_acks_are_recorded_and_a_consumed_mini_batch_leaves_no_ack_or_fetch_record(tmp_path: Path) -> None:
    """An ack is in SQLite (one record per mini-batch: its attempt and acked rank runs) before its answer; the
    last ack consumes the mini-batch and its ack and fetch records go in the same commit; a restart sees the
    same acks and positions."""
    db = tmp_path / "cp.db"
    spec = job_spec(quotas={"math": 1, "code": 1}, mini_batches_per_step=2, world_size=2, micro_batch_size=1)
    with app_client(db) as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:9100"})
        units = single_group_units(["math", "code", "math", "code"])
        assert c.post("/v1/jobs/job1/units", json={"units": units}).status_code == 200
        assert _report(c, "fetched", 0, [1])["fetched_ranks"] == 1
        assert not _report(c, "ack", 0, [0])["consumed"]
        assert _rows(c, Kind.ACK) == [(index_key(0), {"attempt": 0, "ranks": [[0, 1]]})]
        assert _rows(c, Kind.FETCHED) == [(index_key(0), {"attempt": 0, "ranks": [[1, 2]]})]
        assert not _report(c, "ack", 1, [0])["consumed"]  # rank 0 goes on to mini-batch 1 before rank 1 acks 0
        assert _report(c, "ack", 0, [1])["consumed"]
        assert _rows(c, Kind.ACK) == [(index_key(1), {"attempt": 0, "ranks": [[0, 1]]})]  # mini-batch 1's ack stays
        assert _rows(c, Kind.FETCHED) == []
        assert _report(c, "ack", 0, [1])["duplicate"]
    with app_client(db) as c:
        job = c.app.state.service.jobs["job1"]  # type: ignore[attr-defined]
        assert job.position == 1 and job.minibatches[1].acks == {0}
        assert [job.rank_cursor(rank) for rank in range(2)] == [2, 1]
