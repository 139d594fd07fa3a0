"""Bring your own data: a control plane and a store on this host, your groups with your own fields, 2 ranks.

python examples/byo_data.py          # prints what each rank got, exits 1 if anything is off
"""

import tempfile
import threading
from pathlib import Path

import numpy as np

from knittrans.local import ClusterConfig, LocalCluster
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TrajectoryGroup
from knittrans.trainer.client import TrainerClient, TrainerConfig

FIELDS = {"ref_logprobs": "list<float32>", "prompt_uid": "string"}  # your own per-trajectory values
GROUPS, SIZE = 4, 4


def my_group(i: int) -> TrajectoryGroup:
    resp = [np.random.default_rng(i).integers(0, 1000, 3 + r).astype(np.int32) for r in range(SIZE)]
    mine = {"ref_logprobs": [np.full(len(r), -i, np.float32) for r in resp], "prompt_uid": f"p{i}"}
    kw = dict(response_logprobs=[np.zeros(len(r), np.float32) for r in resp], rewards=np.full(SIZE, float(i)))
    kw["prompt_ids"], kw["shared_user_fields"] = np.arange(5, dtype=np.int32), frozenset({"prompt_uid"})
    return TrajectoryGroup(  # prompt_uid: one value for the whole group
        group_id=f"g{i}", source="mine", response_ids=resp, user_fields=mine, **kw
    )


with tempfile.TemporaryDirectory() as tmp, LocalCluster(ClusterConfig(work_dir=Path(tmp), num_stores=1)) as cluster:
    control, store = cluster.control(), cluster.stores[0]
    spec = dict(name="byo", group_size=SIZE, quotas={"mine": GROUPS}, mini_batches_per_step=1, world_size=2)
    control.create_job({**spec, "micro_batch_size": 4, "total_steps": 1, "user_fields": FIELDS})
    where = dict(job="byo", node_id=store.node_id, endpoint=store.endpoint, control=control, user_fields=FIELDS)
    with TrajectoryWriter(**where) as writer:  # write -> seal -> register, one call per batch of units
        writer.write_units([[my_group(i)] for i in range(GROUPS)])
    got: dict[int, list[tuple[float, str, float]]] = {0: [], 1: []}

    def rank(r: int) -> None:
        with TrainerClient(TrainerConfig(control_url=cluster.control_url, job="byo", rank=r, world_size=2)) as client:
            for mini_batch in client.minibatches():
                for micro in mini_batch:
                    lp, cu = micro.batch.user["ref_logprobs"]  # flat values + offsets, torch tensors
                    uids, rewards = micro.batch.user["prompt_uid"], micro.batch.rewards
                    got[r] += [(float(rewards[j]), uids[j], float(lp[cu[j]])) for j in range(len(uids))]
                mini_batch.ack()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads], [t.join() for t in threads]
    control.close()
for r, rows in got.items():
    print(f"rank {r}: {len(rows)} trajectories, (reward, prompt_uid, ref_logprob[0]):", sorted(set(rows)))
rows = got[0] + got[1]
ok = len(rows) == GROUPS * SIZE and all(uid == f"p{int(w)}" and lp == -w for w, uid, lp in rows) and all(got.values())
print("OK" if ok else "MISMATCH")
raise SystemExit(0 if ok else 1)
