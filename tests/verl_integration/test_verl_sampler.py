"""KnitTransQuotaSampler inside verl 0.9.1: loaded the way verl's trainer loads a custom sampler, over a real
TransferQueue on the KnitTrans backend holding prompts and trajectories tagged the way verl's agent loop tags them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict
from tq_support import ray_session, tq_conf
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.utils.import_utils import load_extern_type

N = 2  # trajectories per group


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One Ray and one TransferQueue on the KnitTrans backend for the module."""
    root = tmp_path_factory.mktemp("kt-sampler")
    with ray_session(num_cpus=2):
        tq.init(tq_conf({"storage_backend": "KnitTrans", "KnitTrans": {"store_root": str(root)}}))
        try:
            yield
        finally:
            tq.close()


@pytest.fixture()
def queue(session: None) -> Iterator[None]:
    """An empty ``train`` partition (the previous test's rows cleared)."""
    yield
    tq.get_client().clear_partition("train")


def _finish(uid: str, source: str, step: int, min_step: int | None = None) -> None:
    """What verl does when a prompt's group finished: trajectories with fields and tags, then the prompt tag."""
    keys = [f"{uid}_{i}_0" for i in range(N)]
    fields = TensorDict(
        {"data_source": NonTensorStack(*[source] * N), "responses": torch.arange(N * 3).view(N, 3)}, batch_size=N
    )
    tags = [
        {
            "status": "success",
            "global_steps": step,
            "min_global_steps": step if min_step is None else min_step,
            "max_global_steps": step,
        }
        for _ in range(N)
    ]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)
    tq.kv_batch_put(
        keys=[uid], partition_id="train", tags=[{"is_prompt": True, "status": "finished", "global_steps": step}]
    )


def _sampler(**sampler_kwargs: Any) -> Any:
    cls = load_extern_type("pkg://knittrans.integrations.verl", "KnitTransQuotaSampler")
    assert issubclass(cls, ReplayBufferAsync)
    # the constructor call of verl's TrainerBase._build_replay_buffer for a custom sampler
    return cls(
        trainer_mode="separate_async",
        trainer_config=OmegaConf.create({"parameter_sync_step": 2}),
        max_off_policy_threshold=3,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create(sampler_kwargs),
        refill_fn=lambda n: None,
    )


def _sources(batch: Any) -> Counter[str]:
    uids = {k.split("_")[0] for k in batch.keys}
    return Counter(u.split("-")[0] for u in uids)


def test_quotas_are_exact_per_train_batch_and_mini_batches_admit_early(queue: None) -> None:
    """quotas math:4 code:2, K=2 (verl's parameter_sync_step): a math-first finish order still gives every
    train batch exactly 4 math + 2 code groups, and the first mini-batch is admitted from math alone."""
    s = _sampler(quotas={"math": 4, "code": 2})
    for i in range(3):
        _finish(f"math-{i}", "math", step=1)
    first, _ = s.sample(global_steps=1, partition_id="train", batch_size=3)
    assert _sources(first) == {"math": 3} and len(first.keys) == 3 * N
    for i in range(3, 6):
        _finish(f"math-{i}", "math", step=1)
    for i in range(2):
        _finish(f"code-{i}", "code", step=1)
    second, _ = s.sample(global_steps=1, partition_id="train", batch_size=3)
    assert _sources(second) == {"math": 1, "code": 2}  # not the 3 oldest (math) groups: the quota binds
    for i in range(6, 8):
        _finish(f"math-{i}", "math", step=2)
    for i in range(2, 4):
        _finish(f"code-{i}", "code", step=2)
    third, _ = s.sample(global_steps=2, partition_id="train", batch_size=3)
    fourth, _ = s.sample(global_steps=2, partition_id="train", batch_size=3)
    assert _sources(third) + _sources(fourth) == {"math": 4, "code": 2}


def test_stale_groups_are_evicted_not_admitted(queue: None) -> None:
    """With max_staleness 1, a group that started 3 steps back is evicted from TransferQueue and never sampled."""
    s = _sampler(quotas={"math": 2}, mini_batches_per_step=1, max_staleness=1)
    _finish("math-old", "math", step=1, min_step=1)
    _finish("math-a", "math", step=4)
    _finish("math-b", "math", step=4)
    batch, metrics = s.sample(global_steps=4, partition_id="train", batch_size=2)
    assert {k.split("_")[0] for k in batch.keys} == {"math-a", "math-b"}
    assert "math-old" not in tq.kv_list("train").get("train", {})
    assert any("evicted" in k for k in metrics)


def test_a_batch_size_that_does_not_match_the_quotas_is_named(queue: None) -> None:
    """verl's batch size must be sum(quotas) / parameter_sync_step; otherwise the error says so."""
    s = _sampler(quotas={"math": 4, "code": 2})
    _finish("math-0", "math", step=1)
    with pytest.raises(ValueError, match="verl asked for 4 groups"):
        s.sample(global_steps=1, partition_id="train", batch_size=4)
