"""The manifest feed against a real control plane: when it asks for the next mini-batch."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from api_support import job_spec, server, single_group_units

from knittrans.controlclient import ControlClient
from knittrans.trainer.feed import ManifestFeed


@pytest.mark.timing
def test_the_feed_asks_for_the_next_mini_batch_once_it_is_wanted(tmp_path: Path) -> None:
    """With mini-batches 0 and 1 both admitted, the feed reads 0 and does not ask for 1 until the rank wants it
    (the loop holds 0's first micro-batch, or asks for 1): its next poll stays out of 0's first fetch."""
    with server(tmp_path / "cp.db") as srv, ControlClient(srv.url) as client:
        client.create_job(job_spec(quotas={"math": 2}, mini_batches_per_step=2, world_size=1))
        client.register_node("n0", "grpc://127.0.0.1:1", host="h0")
        client.register_units("job1", single_group_units(["math", "math"]))
        assert client.progress("job1")["next_global_index"] == 2  # both admitted
        feed = ManifestFeed(client, "job1", 0, 1, collective=None, poll_s=0.5)
        try:
            first = feed.share(0)
            assert first is not None and first[0].global_index == 0
            threading.Event().wait(1.0)  # two poll lengths: a feed that asked ahead would have by now
            assert feed.requests == 1
            feed.want(1)
            second = feed.share(1)
            assert second is not None and second[0].global_index == 1 and feed.requests == 2
        finally:
            feed.close()
