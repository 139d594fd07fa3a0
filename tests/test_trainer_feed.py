"""ManifestFeed, Progress and the rank collectives without a cluster: a scripted stand-in answers for the control
plane, so the feed's start, end and failure paths run deterministically."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest

from knittrans.controlclient import JobFinished
from knittrans.errors import DataLost, KnitTransError, Unavailable
from knittrans.procs import free_port
from knittrans.trainer.client import TrainerConfig, _torch_collectives
from knittrans.trainer.feed import ManifestFeed, Progress, TorchCollective


class _Control:
    """The control-plane calls a feed and Progress make: ``progress`` answers (or raises) ``start``; ``manifest``
    raises ``manifest_error`` or waits out its long-poll with nothing admitted; ``fetched`` raises DataLost."""

    def __init__(self, start: dict[str, Any] | BaseException, manifest_error: BaseException | None = None) -> None:
        self.start, self.manifest_error = start, manifest_error
        self.fetched_calls = 0

    def progress(self, job: str) -> dict[str, Any]:
        if isinstance(self.start, BaseException):
            raise self.start
        return self.start

    def manifest(self, job: str, n: int, timeout_s: float = 30.0, *, etag: str | None = None) -> None:
        if self.manifest_error is not None:
            raise self.manifest_error
        time.sleep(0.02)

    def fetched(self, job: str, n: int, attempt: int, ranks: Any = None) -> dict[str, Any]:
        self.fetched_calls += 1
        raise DataLost(f"mini-batch {n} attempt {attempt} was withdrawn")


def _feed(control: _Control, rank: int = 0, world_size: int = 2) -> ManifestFeed:
    return ManifestFeed(control, "j", rank, world_size, collective=None, poll_s=0.1)  # type: ignore[arg-type]


def test_a_restarted_rank_resumes_after_the_mini_batches_it_acked() -> None:
    """The first share is the first mini-batch this rank has not acked: in-flight ones its rank acked are skipped
    (each rank by its own acks); a mini-batch the job will never have is None."""
    progress = {
        "position": 2,
        "in_flight": [{"global_index": 2, "acked_ranks": [[0, 2]]}, {"global_index": 3, "acked_ranks": [[1, 2]]}],
    }
    for rank, first in ((0, 3), (1, 4)):
        feed = _feed(_Control(progress, manifest_error=JobFinished("drained")), rank)
        try:
            assert feed.start() == first and feed.share(first) is None
        finally:
            feed.close()


def test_a_feed_that_cannot_start_or_ask_raises_in_the_loop() -> None:
    """An unreachable control plane at start, or a failing manifest request, ends the feed: the loop's
    ``start``/``share`` raise that error."""
    feed = _feed(_Control(Unavailable("control plane down")))
    with pytest.raises(Unavailable, match="control plane down"):
        feed.start()
    with pytest.raises(Unavailable, match="control plane down"):
        feed.share(0)
    feed.close()
    feed = _feed(_Control({"position": 0, "in_flight": []}, manifest_error=RuntimeError("broken transport")))
    with pytest.raises(RuntimeError, match="broken transport"):
        feed.share(0)
    feed.close()


def test_a_closed_feed_refuses_the_shares_it_never_got() -> None:
    """close() while a mini-batch is not admitted yet: asking for its share raises instead of waiting."""
    feed = _feed(_Control({"position": 5, "in_flight": []}))
    assert feed.start() == 5
    feed.close()
    with pytest.raises(KnitTransError, match="client is closed"):
        feed.share(5)


def test_progress_reports_a_withdrawn_or_failed_fetch_as_false() -> None:
    """fetched() is False when the control plane withdrew the mini-batch (DataLost), and without asking it when
    this rank's own fetch failed."""
    control = _Control({})
    progress = Progress(control, "j", 0, None)  # type: ignore[arg-type]
    assert progress.fetched(7, 1) is False and control.fetched_calls == 1
    assert progress.fetched(7, 1, ok=False) is False and control.fetched_calls == 1


class _Group:
    rank, size = 1, 2


def test_collectives_must_be_the_clients_own() -> None:
    """A feed refuses a collective of another rank or size, and TorchCollective needs torch.distributed."""
    with pytest.raises(KnitTransError, match="rank 1 of 2 is not this client's rank 0"):
        ManifestFeed(_Control({}), "j", 0, 2, collective=_Group(), poll_s=0.1)  # type: ignore[arg-type]
    with pytest.raises(KnitTransError, match=r"needs torch\.distributed initialised"):
        TorchCollective()


def test_group_auto_is_each_rank_for_itself_outside_this_jobs_world() -> None:
    """group='auto' under a torch.distributed world that is not the job's (another size): no collectives, each
    rank reads manifests itself; the job's own world gets its two gloo collectives."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        config = TrainerConfig(control_url="http://127.0.0.1:1", job="j", rank=0, world_size=2)
        assert _torch_collectives(config) is None
        own = _torch_collectives(TrainerConfig(control_url="http://127.0.0.1:1", job="j", rank=0, world_size=1))
        assert own is not None and [(c.rank, c.size) for c in own] == [(0, 1), (0, 1)]
        assert own[0].broadcast("x") == "x" and own[1].gather(3) == [3]
    finally:
        dist.destroy_process_group()
