"""verl 0.9.1's own v1 code on the KnitTrans backend: trajectories put the way its agent loop puts them
(``list_of_dict_to_tensordict``, one trajectory per call, tags), read back by ``TrainerBase`` methods that
call ``.offsets()`` and ``to_padded_tensor`` on jagged fields, and written back as verl writes rewards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest
import torch
import transfer_queue as tq
from tq_support import ray_session, same, tq_conf, verl_rows
from transfer_queue.metadata import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

MEDIA = "multi_modal_inputs.pixel_values"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A TransferQueue on the KnitTrans backend (its bootstrap's store); the store's directory."""
    root = tmp_path_factory.mktemp("kt-verl")
    with ray_session(num_cpus=2):
        conf = tq.init(
            tq_conf({"storage_backend": "KnitTrans", "KnitTrans": {"store_root": str(root), "media_fields": [MEDIA]}})
        )
        try:
            yield Path(next(iter(conf.backend.KnitTrans.store_dirs.values())))
        finally:
            tq.close()


class _RewardModel:
    """Stands in for verl's RewardLoopManager: scores each response token by its id, records its input."""

    def __init__(self) -> None:
        self.seen: DataProto | None = None

    def compute_rm_score(self, data: DataProto) -> DataProto:
        self.seen = data
        return DataProto.from_dict(tensors={"rm_scores": data.batch["responses"].float() / 1000})


def test_reward_path_of_verl_trainer_reads_jagged_fields_and_writes_back(store_dir: Path) -> None:
    """PPOTrainer._compute_reward_colocate (verl's code, a stand-in reward model) reads prompts and responses
    put one trajectory per call, of different lengths: .offsets() gives their lengths, to_padded_tensor the
    padded batch, attention_mask the [prompts | responses] mask; its write-back of jagged rm_scores reads back."""
    rows = list(verl_rows(6))
    for key, td, tag in rows:
        tq.kv_batch_put(keys=[key], partition_id="train", fields=td, tags=[tag])
    batch = KVBatchMeta(keys=[k for k, _, _ in rows], tags=[t for _, _, t in rows], partition_id="train")
    rm = _RewardModel()
    trainer = SimpleNamespace(reward_loop_manager=rm, tokenizer=SimpleNamespace(pad_token_id=0))
    trainer._lengths_to_mask = PPOTrainer._lengths_to_mask
    PPOTrainer._compute_reward_colocate(trainer, batch)  # type: ignore[arg-type]
    assert rm.seen is not None
    prompts, responses = rm.seen.batch["prompts"], rm.seen.batch["responses"]
    for i, (_, td, _) in enumerate(rows):
        p, r = td["prompts"][0], td["responses"][0]
        assert torch.equal(prompts[i, : len(p)], p) and torch.equal(responses[i, : len(r)], r)
        mask = rm.seen.batch["attention_mask"][i]
        assert mask.sum() == len(p) + len(r) and mask[: len(p)].all() and mask[prompts.size(1) :][: len(r)].all()
    assert list(rm.seen.non_tensor_batch["raw_prompt"]) == [td["raw_prompt"][0] for _, td, _ in rows]
    scores = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["rm_scores"])["rm_scores"]
    assert scores.offsets().diff().tolist() == [len(td["responses"][0]) for _, td, _ in rows]
    same(list(scores.unbind()), [td["responses"][0].float() / 1000 for _, td, _ in rows])


def test_multi_modal_inputs_round_trip_and_pixel_values_are_stored_once_per_put(store_dir: Path) -> None:
    """A put of 4 trajectories whose multi_modal_inputs share 2 images keeps 2 media rows in its unit
    (multi_modal_inputs.pixel_values by field path) and returns every row's dict as it was put."""
    rows = list(verl_rows(4))
    fields = [dict(zip(td.keys(), (td.get(k) for k in td.keys()), strict=True)) for _, td, _ in rows]  # noqa: SIM118
    td = list_of_dict_to_tensordict([_row(f) for f in fields])
    before = {u.name for u in (store_dir / "transferqueue").iterdir()}
    tq.kv_batch_put(keys=[f"mm-{i}" for i in range(4)], partition_id="mm", fields=td)
    (unit,) = {u.name for u in (store_dir / "transferqueue").iterdir()} - before
    media = pa.ipc.open_file(pa.memory_map(str(store_dir / "transferqueue" / unit / "media.arrow"))).read_all()
    assert media.num_rows == 2
    got = tq.kv_batch_get(keys=[f"mm-{i}" for i in range(4)], partition_id="mm", select_fields=["multi_modal_inputs"])
    same(got.get("multi_modal_inputs").tolist(), td.get("multi_modal_inputs").tolist())


def _row(field: dict[str, Any]) -> dict[str, Any]:
    """One trajectory's fields (a one-row TensorDict's columns) as the dict verl's agent loop starts from."""
    return {k: (v[0] if isinstance(v, torch.Tensor) and not v.is_nested else v.tolist()[0]) for k, v in field.items()}
