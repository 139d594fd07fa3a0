"""Bring your own data: write your own trajectory groups, with fields of your own, and train on them.

Everything runs on this machine: a control plane and one store node (``knittrans.local``), a writer,
and two trainer ranks (threads here; in real training, one per process). At the end the script checks
that every trajectory arrived exactly once with its fields intact.

    python examples/byo_data.py    # prints what each rank got; exits 1 if anything is off
"""

import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knittrans.local import ClusterConfig, LocalCluster
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import TrajectoryGroup
from knittrans.trainer.client import TrainerClient, TrainerConfig

JOB = "byo"
SOURCE = "mine"
NUM_GROUPS = 4
GROUP_SIZE = 4  # responses per prompt
WORLD_SIZE = 2  # trainer ranks

# Your own per-trajectory columns, declared once for the job: name -> Arrow type.
USER_FIELDS = {"ref_logprobs": "list<float32>", "prompt_uid": "string"}


@dataclass
class Received:
    """One trajectory as a trainer rank saw it."""

    rank: int
    group_id: str
    unit_id: str
    row: int
    reward: float
    response_length: int
    prompt_uid: str
    ref_logprobs: list[float]


def make_group(index: int) -> TrajectoryGroup:
    """Group ``g<index>``: one prompt, GROUP_SIZE responses of different lengths, reward ``index``.

    The user fields carry values the check can recognise: ``prompt_uid`` is ``p<index>`` (one value for the
    whole group) and every token's ``ref_logprobs`` is ``-index``.
    """
    rng = np.random.default_rng(index)
    responses = [rng.integers(0, 1000, size=3 + r).astype(np.int32) for r in range(GROUP_SIZE)]
    sampling_logprobs = [np.zeros(len(response), np.float32) for response in responses]
    ref_logprobs = [np.full(len(response), -index, np.float32) for response in responses]
    return TrajectoryGroup(
        group_id=f"g{index}",
        source=SOURCE,
        prompt_ids=np.arange(5, dtype=np.int32),
        response_ids=responses,
        response_logprobs=sampling_logprobs,
        rewards=np.full(GROUP_SIZE, float(index)),
        user_fields={"ref_logprobs": ref_logprobs, "prompt_uid": f"p{index}"},
        shared_user_fields=frozenset({"prompt_uid"}),  # one value per group, not one per response
    )


def create_job(cluster: LocalCluster) -> None:
    """One training step of one mini-batch that takes all NUM_GROUPS groups from our source."""
    spec = {
        "name": JOB,
        "group_size": GROUP_SIZE,
        "quotas": {SOURCE: NUM_GROUPS},
        "mini_batches_per_step": 1,
        "world_size": WORLD_SIZE,
        "micro_batch_size": 4,
        "total_steps": 1,
        "user_fields": USER_FIELDS,
    }
    with cluster.control() as control:
        control.create_job(spec)


def write_groups(cluster: LocalCluster, groups: list[TrajectoryGroup]) -> None:
    """Store each group as its own unit on the store node and register the units with the control plane."""
    store = cluster.stores[0]
    with cluster.control() as control:
        writer = TrajectoryWriter(
            job=JOB,
            node_id=store.node_id,
            endpoint=store.endpoint,
            control=control,
            user_fields=USER_FIELDS,
        )
        with writer:  # closing the writer waits until the units are registered
            writer.write_units([[group] for group in groups])


def train_rank(cluster: LocalCluster, rank: int, received: list[Received]) -> None:
    """Trainer rank ``rank``: read each mini-batch's micro-batches, record their rows, ack the mini-batch."""
    config = TrainerConfig(control_url=cluster.control_url, job=JOB, rank=rank, world_size=WORLD_SIZE)
    with TrainerClient(config) as client:
        for mini_batch in client.minibatches():
            for micro in mini_batch:
                batch = micro.batch
                # A list field arrives as flat values plus offsets: row j is values[offsets[j]:offsets[j + 1]].
                ref_values, ref_offsets = batch.user["ref_logprobs"]
                response_offsets = batch.response_cu_seqlens
                for j, plan_row in enumerate(micro.rows):
                    ref_logprobs = ref_values[ref_offsets[j] : ref_offsets[j + 1]]
                    received.append(
                        Received(
                            rank=rank,
                            group_id=plan_row.group_id,
                            unit_id=plan_row.unit_id,
                            row=plan_row.row,
                            reward=float(batch.rewards[j]),
                            response_length=int(response_offsets[j + 1] - response_offsets[j]),
                            prompt_uid=batch.user["prompt_uid"][j],
                            ref_logprobs=ref_logprobs.tolist(),
                        )
                    )
            # Here a real trainer takes its optimizer step; the ack tells the control plane it is done.
            mini_batch.ack()


def problems_in(received: list[Received]) -> list[str]:
    """What is wrong with what the ranks received (nothing: an empty list)."""
    problems = []
    per_group = Counter(trajectory.group_id for trajectory in received)
    for index in range(NUM_GROUPS):
        count = per_group[f"g{index}"]
        if count != GROUP_SIZE:
            problems.append(f"group g{index}: {count} trajectories arrived, expected {GROUP_SIZE}")
    rows = Counter((trajectory.unit_id, trajectory.row) for trajectory in received)
    for (unit_id, row), count in rows.items():
        if count > 1:
            problems.append(f"row {row} of unit {unit_id} arrived {count} times")
    for trajectory in received:
        index = int(trajectory.group_id.removeprefix("g"))
        expected_ref_logprobs = [float(-index)] * trajectory.response_length
        intact = (
            trajectory.reward == float(index)
            and trajectory.prompt_uid == f"p{index}"
            and trajectory.ref_logprobs == expected_ref_logprobs
        )
        if not intact:
            problems.append(f"a trajectory of {trajectory.group_id} arrived changed: {trajectory}")
    for rank in range(WORLD_SIZE):
        if not any(trajectory.rank == rank for trajectory in received):
            problems.append(f"rank {rank} received nothing")
    return problems


def main() -> int:
    groups = [make_group(index) for index in range(NUM_GROUPS)]
    received: list[Received] = []  # appended to by both rank threads (list.append is thread-safe)

    # The cluster's database, store data and process logs live in work_dir; all of it goes at the end.
    with tempfile.TemporaryDirectory() as work_dir:
        config = ClusterConfig(work_dir=Path(work_dir), num_stores=1)
        with LocalCluster(config) as cluster:
            create_job(cluster)
            write_groups(cluster, groups)
            ranks = [threading.Thread(target=train_rank, args=(cluster, r, received)) for r in range(WORLD_SIZE)]
            for thread in ranks:
                thread.start()
            for thread in ranks:
                thread.join()

    for rank in range(WORLD_SIZE):
        mine = [trajectory for trajectory in received if trajectory.rank == rank]
        seen = sorted({(t.reward, t.prompt_uid, t.ref_logprobs[0]) for t in mine})
        print(f"rank {rank}: {len(mine)} trajectories, (reward, prompt_uid, ref_logprob[0]): {seen}")

    problems = problems_in(received)
    for problem in problems:
        print("MISMATCH:", problem)
    if problems:
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
