"""``TrainerClient``: one data-parallel rank's view of a job — plans in, torch micro-batches out.

::

    with TrainerClient(TrainerConfig(control_url=url, job="grpo", rank=r, world_size=w)) as client:
        for mini_batch in client.minibatches():          # long-polls the control plane
            for micro in mini_batch:                      # fetched on demand (``iter``: one ahead)
                loss = step(micro.batch, micro.media)     # MicroBatch + {hash: decoded tensor}
                loss.backward()
            optimizer.step()
            mini_batch.ack()                              # all ranks acked -> mini-batch consumed
            client.report_version(mini_batch.policy_version + 1)

In ``iter`` mode a background thread fetches and converts micro-batch ``i+1`` (up to
``prefetch_depth`` ahead) while the training thread computes ``i``; an error in that thread is
re-raised in the training thread at the micro-batch it belongs to. Every micro-batch records
``wait_s`` (time the training loop blocked on data: the *exposed* transfer time), ``fetch_s`` and
``convert_s``; :attr:`TrainerClient.timings` keeps them all.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pyarrow as pa
import torch

from knittrans.controlclient import ControlClient, JobFinished
from knittrans.errors import InvalidRequest, Unavailable
from knittrans.tickets import Ticket
from knittrans.trainer.convert import MicroBatch, to_micro_batch
from knittrans.trainer.fetch import Fetcher, FetchRead
from knittrans.trainer.media import MediaCache, MediaCacheStats, MediaRecord

__all__ = ["MicroTiming", "MiniBatch", "TrainMicroBatch", "TrainerClient", "TrainerConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How one rank talks to the control plane and the store nodes."""

    control_url: str
    """Base URL of the control plane, e.g. ``http://127.0.0.1:8000``."""
    job: str
    """Job name."""
    rank: int
    """This rank, ``0 <= rank < world_size``."""
    world_size: int
    """Data-parallel ranks of the job."""
    token: str | None = None
    """Worker bearer token of the control plane."""
    store_token: str | None = None
    """Bearer token of the store nodes."""
    fetch_mode: Literal["eager", "iter"] = "iter"
    """``eager``: fetch the whole share first; ``iter``: fetch micro-batch i+1 while i computes."""
    prefetch_depth: int = 2
    """Micro-batches fetched ahead in ``iter`` mode."""
    poll_timeout_s: float = 30.0
    """Long-poll timeout of one ``next`` request."""
    control_retry_s: float = 120.0
    """How long to keep retrying while the control plane is unreachable (e.g. restarting)."""
    local_dirs: Mapping[str, str] = field(default_factory=dict)
    """Store node id -> its store directory, for nodes on this host (memory-mapped reads)."""
    fetch_media: bool = True
    """Fetch and decode the media each micro-batch references (through a per-mini-batch cache)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.fetch_mode not in ("eager", "iter"):
            raise ValueError(f"fetch_mode must be 'eager' or 'iter', not {self.fetch_mode!r}")
        if self.prefetch_depth < 1:
            raise ValueError("prefetch_depth must be >= 1")


@dataclass(kw_only=True)
class MicroTiming:
    """Where one micro-batch's time went, in seconds."""

    global_index: int
    micro_index: int
    rows: int
    wait_s: float = 0.0
    """Time the training loop blocked waiting for this micro-batch (exposed transfer)."""
    fetch_s: float = 0.0
    """Flight/mmap time for rows and media."""
    convert_s: float = 0.0
    """Arrow -> torch conversion and media decoding."""
    bytes: int = 0
    """Bytes of the fetched trajectory rows."""


@dataclass(frozen=True, kw_only=True)
class TrainMicroBatch:
    """One micro-batch ready to train on."""

    index: int
    batch: MicroBatch
    """Tensors of the rows (see :class:`~knittrans.trainer.convert.MicroBatch`); ``num_rows`` may be 0."""
    media: dict[str, torch.Tensor]
    """Decoded media the rows use, by hex hash (each unique hash once)."""
    rows: list[dict[str, Any]]
    """The plan's row entries (group id, unit, node, row, tokens), in row order."""
    timing: MicroTiming


def _media_records(table: pa.Table) -> dict[str, MediaRecord]:
    hashes = table.column("media_hash").to_pylist()
    kinds = table.column("kind").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data").chunks
    out: dict[str, MediaRecord] = {}
    i = 0
    for chunk in data:
        for j in range(len(chunk)):
            buf = chunk[j].as_buffer()
            out[hashes[i].hex()] = MediaRecord(kinds[i], shapes[i], dtypes[i], buf)
            i += 1
    return out


class MiniBatch:
    """A rank's share of one admitted mini-batch; iterate it once for its micro-batches."""

    def __init__(self, client: TrainerClient, plan: dict[str, Any]) -> None:
        self._client = client
        self.plan = plan
        self.plan_id: str = plan["plan_id"]
        self.step: int = plan["step"]
        self.index: int = plan["mini_batch_index"]
        self.global_index: int = plan["global_index"]
        self.policy_version: int = plan["policy_version"]
        self.num_tokens: int = plan.get("num_tokens", 0)
        self.num_micro_batches = len(plan["micro_batches"])
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()
        self.acked = False
        self.consumed = False
        self._media_of: dict[str, dict[str, Any]] = {}
        for micro in plan["micro_batches"]:
            for m in micro.get("media", ()):
                self._media_of.setdefault(m["hash"], m)
        self._cache = MediaCache(self._fetch_media)

    @property
    def mini_batch_trajectories(self) -> int:
        """Trajectories of the whole mini-batch over all ranks (for a global loss normaliser)."""
        return int(self.plan.get("mini_batch_trajectories", sum(len(m["rows"]) for m in self.plan["micro_batches"])))

    def _fetch_media(self, hashes: Sequence[str]) -> dict[str, MediaRecord]:
        reads = []
        for h in hashes:
            entry = self._media_of.get(h)
            if entry is None:
                raise InvalidRequest(f"media hash {h} is not in plan {self.plan_id}")
            reads.append(FetchRead(node_id=entry["node_id"], endpoint=entry["endpoint"],
                                   ticket=Ticket.decode(entry["ticket"].encode())))
        return _media_records(self._client.fetcher.fetch(reads))

    def _load(self, i: int) -> TrainMicroBatch:
        micro = self.plan["micro_batches"][i]
        timing = MicroTiming(global_index=self.global_index, micro_index=i, rows=len(micro["rows"]))
        t0 = time.perf_counter()
        if micro["fetches"]:
            reads = [FetchRead(node_id=f["node_id"], endpoint=f["endpoint"],
                               ticket=Ticket.decode(f["ticket"].encode())) for f in micro["fetches"]]
            table = self._client.fetcher.fetch(reads)
        else:
            table = None
        t1 = time.perf_counter()
        batch = to_micro_batch(table) if table is not None else MicroBatch(num_rows=0)
        media: dict[str, torch.Tensor] = {}
        if self._client.config.fetch_media and micro.get("media"):
            media = self._cache.get([m["hash"] for m in micro["media"]])
        t2 = time.perf_counter()
        timing.fetch_s = t1 - t0
        timing.convert_s = t2 - t1
        timing.bytes = table.nbytes if table is not None else 0
        return TrainMicroBatch(index=i, batch=batch, media=media, rows=micro["rows"], timing=timing)

    def __iter__(self) -> Iterator[TrainMicroBatch]:
        if self.consumed:
            raise InvalidRequest(f"mini-batch {self.plan_id} was already iterated")
        self.consumed = True
        try:
            if self._client.config.fetch_mode == "eager":
                t0 = time.perf_counter()
                loaded = [self._load(i) for i in range(self.num_micro_batches)]
                wait = time.perf_counter() - t0
                for j, m in enumerate(loaded):
                    m.timing.wait_s = wait if j == 0 else 0.0
                    self.timings.append(m.timing)
                    yield m
            else:
                yield from self._iter_prefetch()
        finally:
            self.media_stats = self._cache.clear()

    def _iter_prefetch(self) -> Iterator[TrainMicroBatch]:
        q: queue.Queue[TrainMicroBatch | BaseException | None] = queue.Queue(self._client.config.prefetch_depth)
        stop = threading.Event()

        def produce() -> None:
            try:
                for i in range(self.num_micro_batches):
                    if stop.is_set():
                        return
                    item: TrainMicroBatch | BaseException = self._load(i)
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
            except BaseException as exc:  # re-raised in the training thread
                q.put(exc)
            else:
                q.put(None)

        worker = threading.Thread(target=produce, name=f"knittrans-prefetch-{self.global_index}", daemon=True)
        worker.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                wait = time.perf_counter() - t0
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                item.timing.wait_s = wait
                self.timings.append(item.timing)
                yield item
        finally:
            stop.set()
            worker.join(timeout=30)

    def ack(self) -> None:
        """Tell the control plane this rank finished the mini-batch (after its optimizer step)."""
        if not self.acked:
            self._client.control.ack(self._client.config.job, self._client.config.rank, self.plan_id)
            self.acked = True


class TrainerClient:
    """One rank: long-polls plans, fetches rows and media on demand, acks, reports versions."""

    def __init__(self, config: TrainerConfig, *, control: ControlClient | None = None) -> None:
        self.config = config
        self.control = control or ControlClient(config.control_url, token=config.token)
        self.fetcher = Fetcher(token=config.store_token, local_dirs=dict(config.local_dirs))
        self.timings: list[MicroTiming] = []
        self.media_stats = MediaCacheStats()

    def _next_plan(self) -> dict[str, Any] | None:
        """The next plan; None when the job is finished. Retries while the control plane is away."""
        deadline = time.monotonic() + self.config.control_retry_s
        delay = 0.2
        while True:
            try:
                plan = self.control.next_plan(self.config.job, self.config.rank, self.config.poll_timeout_s)
            except JobFinished:
                return None
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                logger.warning("control plane unavailable; retrying in %.1f s", delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if plan is not None:
                return plan
            deadline = time.monotonic() + self.config.control_retry_s

    def minibatches(self) -> Iterator[MiniBatch]:
        """Yield this rank's mini-batches until the job is finished.

        A mini-batch that was fully iterated but not acked is acked before the next one is
        requested; one that was not fully iterated raises, since acking it would lose rows.
        """
        while True:
            plan = self._next_plan()
            if plan is None:
                return
            mb = MiniBatch(self, plan)
            yield mb
            self.timings.extend(mb.timings)
            self.media_stats = self.media_stats + mb.media_stats
            if not mb.acked:
                if not mb.consumed:
                    raise InvalidRequest(f"mini-batch {mb.plan_id} was neither iterated nor acked")
                mb.ack()

    def report_version(self, version: int) -> None:
        """Report the policy version after an optimizer step (rank 0 is enough)."""
        self.control.report_version(self.config.job, version, self.config.rank)

    def timings_dicts(self) -> list[dict[str, Any]]:
        """Recorded per-micro-batch timings as plain dicts (for JSON export)."""
        return [asdict(t) for t in self.timings]

    def close(self) -> None:
        """Close the fetcher and the control-plane client."""
        self.fetcher.close()
        self.control.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
