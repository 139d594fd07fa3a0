"""One side of the checkpoint test, run as its own process: ``save`` puts verl-style rows through the KnitTrans
backend, saves a TransferQueue checkpoint and waits to be killed; ``restore`` starts a fresh TransferQueue,
loads the checkpoint and compares every row with what ``save`` read before it was killed."""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import torch
import transfer_queue as tq
from tensordict import TensorDict
from tq_support import ray_session, same, tq_conf, verl_rows

PARTITION = "train"


def _backend(stores: str) -> dict[str, object]:
    return {
        "storage_backend": "KnitTrans",
        "KnitTrans": {"store_root": stores, "host": "127.0.0.1", "media_fields": ["multi_modal_inputs.pixel_values"]},
    }


def save(work: Path) -> None:
    with ray_session(num_cpus=2):
        tq.init(tq_conf(_backend(str(work / "stores-before"))))
        keys = []
        for i, (key, td, tag) in enumerate(verl_rows(6)):
            tq.kv_batch_put(keys=[key], partition_id=PARTITION, fields=td, tags=[tag])
            keys.append(key)
            if i == 2:  # a later put of a new field to earlier keys (verl adds rewards, log probs, ...)
                extra = TensorDict({"old_log_probs": torch.randn(3, 5)}, batch_size=3)
                tq.kv_batch_put(keys=keys[:3], partition_id=PARTITION, fields=extra)
        answer = tq.kv_batch_get(keys=keys[::-1], partition_id=PARTITION, select_fields=["prompts", "responses",
                                 "multi_modal_inputs", "uid", "data_source", "raw_prompt", "rm_scores"])  # fmt: skip
        tq.save_checkpoint(work / "ckpt", metadata={"step": 7})
        (work / "answer.pkl").write_bytes(pickle.dumps((keys, answer)))
        (work / "saved").write_text(json.dumps({"keys": keys}))
        while True:  # the test kills this process (and its Ray) here
            time.sleep(1)


def restore(work: Path) -> None:
    keys, before = pickle.loads((work / "answer.pkl").read_bytes())
    with ray_session(num_cpus=2):
        tq.init(tq_conf(_backend(str(work / "stores-after"))))
        tq.load_checkpoint(work / "ckpt")
        listed = tq.kv_list(partition_id=PARTITION)[PARTITION]
        assert sorted(listed) == sorted(keys), (sorted(listed), sorted(keys))
        assert listed[keys[0]]["min_global_steps"] == 3, listed[keys[0]]  # tags restored with the controller
        after = tq.kv_batch_get(keys=keys[::-1], partition_id=PARTITION, select_fields=list(before.keys()))
        same(before, after, "before kill vs after restore")
        extra = tq.kv_batch_get(keys=keys[:3], partition_id=PARTITION, select_fields=["old_log_probs"])
        assert extra["old_log_probs"].is_nested and len(extra["old_log_probs"].unbind()) == 3
        tq.close()
    print("restored", len(keys), "rows")


if __name__ == "__main__":
    {"save": save, "restore": restore}[sys.argv[1]](Path(sys.argv[2]))
