"""Writes tests/data/state_v1.sql and state_v1_status.json: a control-plane database with every record kind.

Run with the code whose on-disk records the files pin (they were written at commit 5262092, before the
persistence schema got its own module): ``PYTHONPATH=<checkout> python tests/data/make_state_v1.py``.
tests/test_api_records.py restores the database with today's code and compares.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from api_support import group, job_spec, unit

from knittrans.api import Settings, create_app

HERE = Path(__file__).resolve().parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "cp.db")
        spec = job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=2, max_staleness=0)
        with TestClient(create_app(Settings(db_path=db))) as c:
            assert c.post("/v1/jobs", json=spec).status_code == 201
            for node in ("n0", "n1", "n2"):
                assert c.post("/v1/nodes", json={"node_id": node, "endpoint": "grpc://127.0.0.1:1"}).status_code == 200
            supply = {"started": {"math": 1}, "group_ids": {"math": ["s0", "s1"]}, "request_id": "req-1"}
            assert c.post("/v1/jobs/job1/supply", json=supply).status_code == 200
            # mini-batch 0: consumed by both ranks
            assert c.post("/v1/jobs/job1/units", json={"units": [unit("u0", [group("g0", "math")])]}).json()[
                "admitted"
            ] == [0]
            for rank in (0, 1):
                plan = c.get(f"/v1/jobs/job1/ranks/{rank}/next", params={"timeout_s": 0}).json()
                assert c.post(f"/v1/jobs/job1/ranks/{rank}/ack", json={"plan_id": plan["plan_id"]}).status_code == 200
            assert c.post("/v1/jobs/job1/versions", json={"rank": 0, "version": 1}).status_code == 200
            # a group past the staleness bound: expired, offered for regeneration
            late = unit("u-late", [group("late", "math", version=0)])
            assert c.post("/v1/jobs/job1/units", json={"units": [late]}).json()["admitted"] == []
            # mini-batch 1 on n1: rank 0 fetched and acked, rank 1 fetched
            u1 = unit("u1", [group("g1", "math", version=1)], node="n1")
            assert c.post("/v1/jobs/job1/units", json={"units": [u1]}).json()["admitted"] == [1]
            for rank in (0, 1):
                plan = c.get(f"/v1/jobs/job1/ranks/{rank}/next", params={"timeout_s": 0}).json()
                assert (
                    c.post(f"/v1/jobs/job1/ranks/{rank}/fetched", json={"plan_id": plan["plan_id"]}).status_code == 200
                )
            plan = c.get("/v1/jobs/job1/ranks/0/next", params={"timeout_s": 0}).json()
            assert c.post("/v1/jobs/job1/ranks/0/ack", json={"plan_id": plan["plan_id"]}).status_code == 200
            # mini-batch 2 on n2, withdrawn when n2 is lost: its group becomes lost
            u2 = unit("u2", [group("g2", "math", version=2), group("g3", "math", version=2)], node="n2")
            r = c.post("/v1/jobs/job1/units", json={"units": [u2]}).json()
            assert r["admitted"] == [2], r
            lost = c.post("/v1/nodes/n2/lost", json={"reason": "gone"}).json()
            assert lost["withdrawn"] == {"job1": [2]}, lost
            status = c.get("/v1/jobs/job1/status").json()
        with sqlite3.connect(db) as conn:
            dump = "\n".join(conn.iterdump())
    (HERE / "state_v1.sql").write_text(dump + "\n")
    (HERE / "state_v1_status.json").write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
