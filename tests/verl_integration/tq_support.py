"""Shared pieces of the TransferQueue backend tests: a TransferQueue session, clients of either backend,
and a comparison of two answers that checks containers as well as values."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transfer_queue.client import TransferQueueClient

from knittrans.integrations.transferqueue import register

SETUP_HOOK = "knittrans.integrations.transferqueue.register"


@contextmanager
def ray_session(num_cpus: int = 4) -> Iterator[None]:
    """Ray on loopback, the KnitTrans backend registered in every worker."""
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"worker_process_setup_hook": SETUP_HOOK},
    )
    register()
    try:
        yield
    finally:
        ray.shutdown()


def tq_conf(backend: Mapping[str, Any]) -> Any:
    """A TransferQueue configuration with ``backend`` (and the sequential sampler)."""
    return OmegaConf.create(
        {"controller": {"sampler": "SequentialSampler"}, "backend": dict(backend)}, flags={"allow_objects": True}
    )


def client_of(conf: Any, backend: str, backend_conf: Mapping[str, Any]) -> TransferQueueClient:
    """A TransferQueue client of the running controller whose storage manager is ``backend``."""
    client = TransferQueueClient(
        client_id=f"test-{backend}-{uuid.uuid4().hex[:6]}", controller_info=conf.controller.zmq_info
    )
    client.initialize_storage_manager(manager_type=backend, config=OmegaConf.create(dict(backend_conf)))
    return client


def kv_put(client: TransferQueueClient, keys: list[str], partition: str, fields: TensorDict) -> None:
    """``tq.kv_batch_put`` through ``client`` (the same two client calls)."""
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition, create=True)
    client.put(fields, meta)


def kv_get(client: TransferQueueClient, keys: list[str], partition: str, fields: list[str] | None = None) -> TensorDict:
    """``tq.kv_batch_get`` through ``client``."""
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if fields is not None:
        meta = meta.select_fields(fields)
    return client.get_data(meta)


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` are equal and of the same containers all the way down (NaN equals NaN)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.is_nested, a.layout, a.dtype) == (b.is_nested, b.layout, b.dtype), (
            f"{where}: {a.layout}/{a.dtype} nested={a.is_nested} vs {b.layout}/{b.dtype} nested={b.is_nested}"
        )
        if a.is_nested:
            rows_a, rows_b = a.unbind(), b.unbind()
            assert len(rows_a) == len(rows_b), f"{where}: {len(rows_a)} vs {len(rows_b)} rows"
            for i, (x, y) in enumerate(zip(rows_a, rows_b, strict=True)):
                same(x, y, f"{where}[{i}]")
            return
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # noqa: E731
        assert raw(a) == raw(b), f"{where}: bytes differ"
    elif isinstance(a, NonTensorStack | NonTensorData):
        same(a.tolist(), b.tolist(), f"{where}.tolist()")
    elif isinstance(a, TensorDict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
        for k in a.keys():  # noqa: SIM118 - a TensorDict iterates rows
            same(a.get(k), b.get(k), f"{where}/{k}")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}/{k!r}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{where}: nan vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def verl_rows(n: int, group: int = 2) -> Iterator[tuple[str, TensorDict, dict[str, Any]]]:
    """``n`` trajectories as verl 0.9.1's v1 agent loop puts them (``AgentLoopWorkerTQ._agent_loop_postprocess``):
    key ``{uid}_{session}_0``, one ``list_of_dict_to_tensordict([fields])`` per call, the tag it writes.
    Trajectories of a group share their image (``multi_modal_inputs``); prompt and response lengths differ."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    for i in range(n):
        uid, session = f"p{i // group}", i % group
        g = torch.Generator().manual_seed(i)
        prompts = torch.randint(0, 1000, (5 + i % 3,), generator=g)
        responses = torch.randint(0, 1000, (3 + i,), generator=g)
        input_ids = torch.cat([prompts, responses])
        pixels = torch.Generator().manual_seed(1000 + i // group)
        field = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": torch.ones_like(responses),
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(len(input_ids)),
            "rm_scores": torch.tensor(float(i) / 3),
            "multi_modal_inputs": {
                "pixel_values": torch.randn(16, 12, generator=pixels),
                "image_grid_thw": torch.tensor([[1, 4, 4]]),
            },
            "data_source": "geo3k" if i % 3 else "mathvista",
            "uid": uid,
            "raw_prompt": [{"role": "user", "content": f"<image>question {i}"}],
            "extra_fields": {"min_global_steps": 3, "max_global_steps": 3, "turn_scores": []},
            "num_turns": 2,
            "reward_score": float(i) / 3,
        }
        field["loss_mask"] = field["response_mask"]
        tag = {"status": "success", "prompt_len": len(prompts), "response_len": len(responses),
               "global_steps": 3, "min_global_steps": 3, "max_global_steps": 3}  # fmt: skip
        yield f"{uid}_{session}_0", list_of_dict_to_tensordict([field]), tag


def shm_dir() -> str | None:
    """``/dev/shm`` when this host has it (stores keep units on tmpfs), else None (the default tmp)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


__all__ = ["client_of", "kv_get", "kv_put", "ray_session", "same", "shm_dir", "tq", "tq_conf", "verl_rows"]
