"""The runner interface every system implements, the shared consumer loop and the tiny training step.

A system plugs into the harness with a module exposing ``VARIANTS`` (names) and
``make_runner(variant) -> SystemRunner``.  The runner decides *how* its consumer ranks run
(Ray actors, subprocesses, ...), but every rank drives :func:`rank_loop`, so waits, compute and
digests are measured by the same code for every system.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from benchmarks.vs_baselines.workload import TrainBatch, Workload, WorkloadSpec, microbatch_digest, row_digests

__all__ = ["RunnerOptions", "SystemRunner", "TinyPolicy", "rank_loop", "warm_up"]


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """Knobs shared by all runners."""

    loopback: str = "127.0.0.1"
    """Address every server binds and every client dials; all traffic stays on loopback."""
    logical_cpus: int = 8
    """Logical CPUs a Ray-based system declares (its actors reserve 1 each; the host has fewer cores)."""
    compute_hidden: int = 64
    """Hidden size of the tiny policy used as per-micro-batch compute."""

    def __post_init__(self) -> None:
        if self.logical_cpus <= 0 or self.compute_hidden <= 0:
            raise ValueError("logical_cpus and compute_hidden must be positive")


class SystemRunner(Protocol):
    """One system under test, driven by ``driver.py`` inside its own process tree.

    Call order: ``setup`` once (timed as start-up), then per repetition and mode ``put`` ->
    ``consume`` -> ``clear``, then ``teardown``.  ``tag`` names one stored copy of the workload.
    """

    name: str

    def setup(self, spec: WorkloadSpec, options: RunnerOptions) -> None:
        """Start the system's services and its consumer ranks; return when ready to accept a put."""

    def put(self, workload: Workload, tag: str) -> dict[str, float]:
        """Store the whole mini-batch as rollout producers would (``spec.put_batches()``); return timings in s."""

    def consume(self, tag: str, compute: bool) -> list[dict[str, Any]]:
        """Run all ranks concurrently through :func:`rank_loop`; return their results, rank order."""

    def clear(self, tag: str) -> None:
        """Drop the stored copy ``tag``."""

    def teardown(self) -> None:
        """Stop everything ``setup`` started."""


class TinyPolicy(nn.Module):
    """A small stand-in for a policy model: token embedding + MLP, plus a strided conv image encoder."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.encoder = nn.Sequential(nn.Conv2d(1, 8, kernel_size=8, stride=8), nn.ReLU())
        self.project = nn.Linear(8, hidden)

    def loss(self, batch: TrainBatch) -> torch.Tensor:
        """A PPO-shaped scalar: per-token values regressed on logprobs, weighted by reward."""
        h = self.embed(batch.response_ids.long())
        lengths = batch.response_cu.diff()
        if batch.images is not None and batch.image_index is not None:
            # Encoder sees exactly the images the system delivered: unique ones if deduplicated.
            feats = self.encoder(batch.images.unsqueeze(1).float() / 255.0).mean(dim=(2, 3))
            per_row = self.project(feats)[batch.image_index]
            h = h + per_row.repeat_interleave(lengths, dim=0)
        values = self.mlp(h).squeeze(-1)
        weights = batch.reward.repeat_interleave(lengths)
        loss: torch.Tensor = ((values - batch.response_logprobs) ** 2 * weights).mean()
        return loss


def warm_up(spec: WorkloadSpec, hidden: int) -> None:
    """Pay one-off import/initialisation costs (torch.optim, kernels) at start-up, not in the first step."""
    torch.set_num_threads(1)
    model = TinyPolicy(spec.vocab_size, hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    n = 2
    batch = TrainBatch(
        traj_index=torch.arange(n),
        prompt_ids=torch.zeros(n, dtype=torch.int32),
        prompt_cu=torch.arange(n + 1),
        response_ids=torch.zeros(n, dtype=torch.int32),
        response_cu=torch.arange(n + 1),
        response_logprobs=torch.zeros(n),
        reward=torch.ones(n),
        version_start=torch.zeros(n, dtype=torch.int32),
        version_end=torch.zeros(n, dtype=torch.int32),
        images=torch.zeros(1, 16, 16, dtype=torch.uint8),
        image_index=torch.zeros(n, dtype=torch.int64),
    )
    model.loss(batch).backward()  # type: ignore[no-untyped-call]
    optimizer.step()


def rank_loop(
    rank: int, spec: WorkloadSpec, batches: Iterator[TrainBatch], *, compute: bool, hidden: int = 64
) -> dict[str, Any]:
    """Consume one rank's micro-batches, timing the wait for each and (optionally) a forward/backward.

    ``wait_s`` is the time ``next(batches)`` blocks: the fetch latency without compute, the *exposed*
    transfer time with compute (a system that prefetches hides part of it behind the previous step).
    Rows are digested after the timed loop (the batches are kept until then), so the verification's
    CPU work neither counts in nor competes with any rank's timings.
    """
    torch.set_num_threads(1)
    torch.manual_seed(1234 + rank)
    model = TinyPolicy(spec.vocab_size, hidden) if compute else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if model is not None else None
    micro: list[dict[str, Any]] = []
    received: list[TrainBatch] = []
    cpu_start = time.process_time()  # every thread of this rank's process: its loader, transport, compute
    t_start = time.perf_counter()
    for m in range(spec.micro_batches):
        t0 = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            raise RuntimeError(f"rank {rank}: source ended after {m} of {spec.micro_batches} micro-batches") from None
        t1 = time.perf_counter()
        if model is not None:
            model.loss(batch).backward()  # type: ignore[no-untyped-call]
        t2 = time.perf_counter()
        received.append(batch)
        micro.append({"micro_batch": m, "wait_s": t1 - t0, "compute_s": t2 - t1})
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - t_start
    cpu = time.process_time() - cpu_start
    t3 = time.perf_counter()
    for rec, batch in zip(micro, received, strict=True):
        digests = row_digests(batch)
        rec.update(
            {
                "nbytes": batch.nbytes(),
                "rows": sorted(digests),
                "digest": microbatch_digest(digests),
                "row_digests": {str(k): v.hex() for k, v in digests.items()},
            }
        )
    return {
        "rank": rank,
        "pid": os.getpid(),
        "train_s": wall,
        "process_cpu_s": cpu,
        "digest_s": time.perf_counter() - t3,
        "micro": micro,
    }
