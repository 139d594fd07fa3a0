"""``TrainerConfig``: how one trainer rank talks to the control plane and the store nodes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from knittrans.retry import RetryPolicy

__all__ = ["TrainerConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How one rank talks to the control plane and the store nodes."""

    control_url: str
    """Base URL of the control plane, e.g. ``http://127.0.0.1:8700`` (``knittrans control-plane``'s default port)."""
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
    poll_timeout_s: float = 2.0
    """Longest single manifest long-poll (the control plane answers as soon as the mini-batch is admitted;
    a closed client's feed stops within this)."""
    group: Literal["auto", "none"] = "auto"
    """How the ranks share the control plane. ``auto``: when ``torch.distributed`` is initialised with this
    rank and world size, rank 0 reads each manifest and broadcasts it (each rank cuts its share), and
    gathers ``fetched`` and ``ack`` into one request each, over two gloo groups of the client's own (so
    every rank must build its client, at the same point); otherwise as ``none``. ``none``: each rank
    reads every manifest and reports for itself (``W`` requests per mini-batch and call)."""
    control_retry_s: float = 120.0
    """How long to keep retrying while the control plane is unreachable (e.g. restarting)."""
    local_dirs: Mapping[str, str] = field(default_factory=dict)
    """Store node id -> its store directory, for nodes on this host (memory-mapped reads)."""
    fetch_media: bool = True
    """Fetch and decode the media each micro-batch references (through a per-mini-batch cache)."""
    fetch_timeout_s: float | None = 30.0
    """Timeout of one Flight call to a store node (a dead host raises instead of blocking); None: none."""
    data_lane: bool = True
    """Read remote store nodes over their bulk data lane (a store opens one unless TLS or ``--no-data-lane``;
    one length-prefixed Arrow IPC stream per call received into a reused buffer, :mod:`knittrans.flight.lane`)
    instead of Flight ``DoGet``; nodes without a lane, or whose lane cannot be reached, are read through
    ``DoGet``. False: ``DoGet`` only."""
    replan_wait_s: float = 60.0
    """After an abandoned mini-batch: how long to wait for its re-plan before retrying the same plan."""
    torch_threads: int | None = None
    """When set, the client calls ``torch.set_num_threads`` with it at start. Several ranks (or a rank and
    its rollout) on one host each using every core slow each other down badly: give each rank its share
    (1 on a small machine; also set ``OMP_NUM_THREADS`` before Python starts). None: leave torch as is."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.fetch_mode not in ("eager", "iter"):
            raise ValueError(f"fetch_mode must be 'eager' or 'iter', not {self.fetch_mode!r}")
        if self.prefetch_depth < 1:
            raise ValueError("prefetch_depth must be >= 1")
        if self.fetch_timeout_s is not None and self.fetch_timeout_s <= 0:
            raise ValueError("fetch_timeout_s must be > 0 (or None)")
        if self.replan_wait_s < 0:
            raise ValueError("replan_wait_s must be >= 0")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1 (or None)")
        if self.group not in ("auto", "none"):
            raise ValueError(f"group must be 'auto' or 'none', not {self.group!r}")
        if self.poll_timeout_s <= 0 or self.control_retry_s < 0:
            raise ValueError("poll_timeout_s must be > 0 and control_retry_s >= 0")

    def retry_policy(self) -> RetryPolicy:
        """The one retry rule of this rank's control-plane calls: keep retrying an unreachable control plane
        (connection errors, 503) for ``control_retry_s``, pausing 0.2 s doubling to 5 s."""
        return RetryPolicy(budget_s=self.control_retry_s, first_backoff_s=0.2, max_backoff_s=5.0)
