"""ManifestFeed, Progress and the rank collectives against a real control plane (``knittrans control-plane`` in a
subprocess, the real ControlClient): the feed's start, end and failure paths."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_support import ServerProcess, job_spec, manifest, server, single_group_units

from knittrans.controlclient import ControlClient
from knittrans.errors import KnitTransError, NotFound, Unavailable
from knittrans.procs import free_port
from knittrans.retry import RetryPolicy
from knittrans.trainer.client import TrainerConfig, _torch_collectives
from knittrans.trainer.feed import ManifestFeed, Progress, TorchCollective, leader_call

JOB = "job1"


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ServerProcess]:
    """A control plane with job ``job1`` (two ranks, K=3) and its first step's six groups on node ``n0``: the
    step's three mini-batches are admitted."""
    with server(tmp_path / "cp.db") as proc, httpx.Client(base_url=proc.url) as c:
        assert c.post("/v1/jobs", json=job_spec()).status_code == 201
        assert c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"}).status_code == 200
        units = single_group_units(["math", "math", "code", "math", "math", "code"])
        assert c.post(f"/v1/jobs/{JOB}/units", json={"units": units}).status_code == 200
        yield proc


def _control(url: str) -> ControlClient:
    return ControlClient(url, retry=RetryPolicy(budget_s=0))


def _feed(control: ControlClient, rank: int = 0, world_size: int = 2) -> ManifestFeed:
    return ManifestFeed(control, JOB, rank, world_size, collective=None, poll_s=0.1)


def test_a_restarted_rank_resumes_after_the_mini_batches_it_acked(cp: ServerProcess) -> None:
    """The first share is the first mini-batch this rank has not acked: each rank starts after its own acks (rank
    0 acked mini-batches 0-1, rank 1 only 0), and its manifest, admitted already, comes at once; once the loop
    is past it the feed forgets it."""
    with httpx.Client(base_url=cp.url) as c:
        for n, ranks in ((0, [0]), (0, [1]), (1, [0])):
            m = manifest(c, JOB, n)
            assert m is not None
            body = {"attempt": m.attempt, "ranks": ranks}
            assert c.post(f"/v1/jobs/{JOB}/minibatches/{n}/ack", json=body).status_code == 200
    for rank, first in ((0, 2), (1, 1)):
        with _control(cp.url) as control:
            feed = _feed(control, rank)
            try:
                assert feed.start() == first
                assert feed.share(first) is not None  # admitted: its manifest comes at once
                assert first in feed.arrived
                feed.release_below(first + 1)  # the loop is past it: its share and arrival time are dropped
                assert first not in feed.arrived and min(feed._shares, default=first + 1) > first
            finally:
                feed.close()


def test_a_feed_stops_asking_once_the_job_has_no_next_mini_batch(cp: ServerProcess) -> None:
    """A job of one step (three mini-batches): the feed delivers them, then None for the fourth, and its thread
    ends there instead of asking for the mini-batches after it (which are None too)."""
    with httpx.Client(base_url=cp.url) as c:
        assert c.post("/v1/jobs", json=job_spec(name="short", total_steps=1)).status_code == 201
        units = single_group_units(["math", "math", "code", "math", "math", "code"], job="short")
        assert c.post("/v1/jobs/short/units", json={"units": units}).status_code == 200
    with _control(cp.url) as control:
        feed = ManifestFeed(control, "short", 0, 2, collective=None, poll_s=0.1)
        try:
            assert [feed.share(n) is not None for n in range(4)] == [True, True, True, False]
            feed._thread.join(10)
            assert not feed._thread.is_alive() and feed.share(4) is None
        finally:
            feed.close()


def test_a_feed_that_cannot_start_raises_in_the_loop() -> None:
    """An unreachable control plane at start ends the feed: the loop's ``start`` and ``share`` raise its error."""
    with _control(f"http://127.0.0.1:{free_port()}") as control:
        feed = _feed(control)
        with pytest.raises(Unavailable):
            feed.start()
        with pytest.raises(Unavailable):
            feed.share(0)
        feed.close()


def test_a_feed_whose_control_plane_goes_away_raises_in_the_loop(cp: ServerProcess) -> None:
    """The control plane lost while the feed waits for a mini-batch (retries spent): the shares it got still come,
    and the loop's ``share`` of the awaited one raises the feed's error instead of waiting for ever."""
    with _control(cp.url) as control:
        feed = _feed(control)
        try:
            assert [feed.share(n) is not None for n in range(3)] == [True, True, True]
            cp.kill()
            with pytest.raises(Unavailable):
                feed.share(3)  # the next step's first: not admitted when the control plane went away
            assert feed.share(2) is not None
        finally:
            feed.close()


def test_a_closed_feed_refuses_the_shares_it_never_got(cp: ServerProcess) -> None:
    """close() while a mini-batch is not admitted yet: asking for its share raises instead of waiting."""
    with _control(cp.url) as control:
        feed = _feed(control)
        assert feed.start() == 0
        feed.close()
        assert not feed._thread.is_alive()  # close() waited for it
        with pytest.raises(KnitTransError, match="client is closed"):
            feed.share(3)  # the next step's first: not admitted


def test_progress_reports_a_withdrawn_or_failed_fetch_as_false(cp: ServerProcess) -> None:
    """fetched() is False when the control plane withdrew the mini-batch (its node was lost: DataLost), and,
    without asking the control plane (here: one that cannot be reached), when this rank's own fetch failed."""
    with httpx.Client(base_url=cp.url) as c:
        m = manifest(c, JOB, 0)
        assert m is not None
        assert c.post("/v1/nodes/n0/lost").status_code == 200
    with _control(cp.url) as control:
        assert Progress(control, JOB, 0, None).fetched(0, m.attempt) is False
    with _control(f"http://127.0.0.1:{free_port()}") as nowhere:
        assert Progress(nowhere, JOB, 0, None).fetched(0, m.attempt, ok=False) is False


def test_torch_collective_needs_torch_distributed() -> None:
    """TorchCollective outside torch.distributed is refused by name."""
    with pytest.raises(KnitTransError, match=r"needs torch\.distributed initialised"):
        TorchCollective()


def _one_rank_gloo_world() -> None:
    """Initialise a torch.distributed gloo world of one rank on a free port (the caller destroys it)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )


def test_group_auto_is_each_rank_for_itself_outside_this_jobs_world() -> None:
    """group='auto' under a torch.distributed world that is not the job's (another size): no collectives, each
    rank reads manifests itself; the job's own world gets its two gloo collectives. A feed refuses a collective
    of another size than its job's world."""
    import torch.distributed as dist

    _one_rank_gloo_world()
    try:
        config = TrainerConfig(control_url="http://127.0.0.1:1", job="j", rank=0, world_size=2)
        assert _torch_collectives(config) is None
        own = _torch_collectives(TrainerConfig(control_url="http://127.0.0.1:1", job="j", rank=0, world_size=1))
        assert own is not None and [(c.rank, c.size) for c in own] == [(0, 1), (0, 1)]
        assert own[0].broadcast("x") == "x" and own[1].gather(3) == [3]
        with (
            _control(f"http://127.0.0.1:{free_port()}") as control,
            pytest.raises(KnitTransError, match="rank 0 of 1 is not this client's rank 0 of world_size 2"),
        ):
            ManifestFeed(control, JOB, 0, 2, collective=own[0], poll_s=0.1)
    finally:
        dist.destroy_process_group()


def test_leader_call_hands_the_leaders_result_or_error_to_every_rank() -> None:
    """With a collective, what rank 0's call returns is every rank's result, and what it raises is raised on every
    rank (here a one-rank gloo group: rank 0 is every rank)."""
    import torch.distributed as dist

    def missing() -> int:
        raise NotFound("no such mini-batch")

    _one_rank_gloo_world()
    try:
        collective = TorchCollective()
        assert leader_call(collective, lambda: 7) == 7
        with pytest.raises(NotFound, match="no such mini-batch"):
            leader_call(collective, missing)
    finally:
        dist.destroy_process_group()
