"""Issue 18 client side: warm Flight channels, the early first poll, streams opened at plan arrival,
registration from the writer, and ``register_units`` for a store node that has not registered yet."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from knittrans.errors import NotFound, Unavailable
from knittrans.flight.client import StoreClient
from knittrans.local import LocalCluster
from knittrans.procs import free_port, wait_until
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.trainer.client import TrainerClient, TrainerConfig
from knittrans.trainer.fetch import Fetcher
from tests.trainer_support import job_spec, mm_groups


def _consume_all(cluster: LocalCluster, job: str) -> list[str]:
    """Every row's group id, consumed (and acked) by a one-rank trainer until the job has no more."""
    config = TrainerConfig(control_url=cluster.control_url, job=job, rank=0, world_size=1, poll_timeout_s=5)
    seen: list[str] = []
    with TrainerClient(config) as client:
        for mb in client.minibatches():
            seen += [r.group_id for m in mb for r in m.rows]
            mb.ack()
    return seen


def test_writer_with_a_control_client_registers_what_it_writes(cluster: LocalCluster) -> None:
    """``write_groups`` registers its unit (in the background: ``flush`` waits for it); ``write_units`` writes one
    unit per list and registers them together; ``close`` flushes; the units are the job's and a trainer consumes
    exactly the groups written."""
    control = cluster.control()
    control.create_job(job_spec("wr", groups=3, group_size=2, k=1, world_size=1, micro_batch_size=2))
    s0, s1 = cluster.stores
    with (
        TrajectoryWriter(job="wr", node_id=s0.node_id, endpoint=s0.endpoint, control=control) as w0,
        TrajectoryWriter(
            job="wr", node_id=s1.node_id, endpoint=s1.endpoint, store_dir=s1.store_dir, control=control
        ) as w1,
    ):
        one = w0.write_groups(mm_groups("a", 1, group_size=2))
        w0.flush()
        assert control.status("wr")["counts"]["units"] == 1
        two = w1.write_units([mm_groups("b", 1, group_size=2, seed=1), mm_groups("c", 1, group_size=2, seed=2)])
    assert [d.node_id for d in two] == [s1.node_id, s1.node_id] and one.node_id == s0.node_id
    assert control.status("wr")["counts"]["units"] == 3
    seen = _consume_all(cluster, "wr")
    assert sorted(set(seen)) == ["a0", "b0", "c0"] and len(seen) == 6
    control.close()


@pytest.mark.timing
def test_register_units_of_an_unregistered_node_waits_then_says_so(cluster: LocalCluster, tmp_path: Path) -> None:
    """A unit on a node the control plane does not know: the call waits up to ``node_wait_s`` and then raises
    NotFound naming the node and the fix; when the node registers meanwhile, the call succeeds."""
    control = cluster.control()
    control.create_job(job_spec("unreg", groups=2, group_size=2, k=1, world_size=1, micro_batch_size=2))
    store = cluster.stores[0]
    with TrajectoryWriter(job="unreg", node_id=store.node_id, endpoint=store.endpoint) as w:
        desc = w.write_groups(mm_groups("u", 1, group_size=2))
    ghost = {**desc.to_dict(), "node_id": "node-late", "unit_id": "node-late-1"}
    t0 = time.monotonic()
    with pytest.raises(NotFound, match=r"store node 'node-late' has not registered .*waited 0.5 s.*--control-url"):
        control.register_units("unreg", [ghost], node_wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5  # it did wait
    with pytest.raises(NotFound, match="node-late"):
        control.register_units("unreg", [ghost], node_wait_s=0)
    with pytest.raises(ValueError, match="node_wait_s"):
        control.register_units("unreg", [ghost], node_wait_s=-1)

    late = {**desc.to_dict(), "node_id": "node-later", "unit_id": "node-later-1"}
    out: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: out.update(control.register_units("unreg", [late], node_wait_s=20)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # still waiting for the node
    control.register_node("node-later", store.endpoint, "127.0.0.1")
    waiter.join(20)
    assert not waiter.is_alive() and out, "registration did not go through once the node registered"
    control.close()


@pytest.mark.timing
def test_client_warms_channels_and_polls_before_the_loop_starts(cluster: LocalCluster) -> None:
    """A fresh client connects to every listed store node (its Flight channel and one pinged data-lane
    connection) and has the first mini-batch loading before ``minibatches()`` is called; its streams are
    open when the manifest arrives."""
    control = cluster.control()
    control.create_job(job_spec("warm", groups=2, group_size=2, k=1, world_size=1, micro_batch_size=2))
    config = TrainerConfig(control_url=cluster.control_url, job="warm", rank=0, world_size=1, poll_timeout_s=5)
    with TrainerClient(config) as client:
        endpoints = {s.endpoint for s in cluster.stores}
        wait_until(lambda: endpoints <= set(client.fetcher._clients), timeout_s=20, what="warm channels")
        clients = [client.fetcher._clients[e] for e in endpoints]
        wait_until(lambda: all(len(c._lane_idle) == 1 for c in clients), timeout_s=20, what="a warm lane connection")
        assert client._first._mini_batch is None  # waiting: nothing admitted yet
        with TrajectoryWriter(
            job="warm", node_id=cluster.stores[0].node_id, endpoint=cluster.stores[0].endpoint, control=control
        ) as w:
            w.write_units([mm_groups("w", 1, group_size=2), mm_groups("x", 1, group_size=2, seed=3)])
        wait_until(lambda: client._first._mini_batch is not None, timeout_s=20, what="the first mini-batch")
        early = client._first._mini_batch
        mbs = client.minibatches()
        mb = next(mbs)
        assert early is mb  # the background start's mini-batch, already loading
        assert mb._streams is not None and mb._streams.calls >= 1  # opened at manifest arrival, before the loop
        assert sum(m.batch.num_rows for m in mb) == 4
        mb.ack()
        assert next(mbs, None) is None
    control.close()


@pytest.mark.timing
def test_fetcher_warm_skips_unreachable_and_local_nodes(tmp_path: Path) -> None:
    """Warming a node that does not answer is not an error (its reads report it); local nodes need no channel."""
    with Fetcher(local_dirs={"node-local": str(tmp_path)}, timeout_s=2) as f:
        futures = f.warm({"node-x": f"grpc://127.0.0.1:{free_port()}", "node-local": "grpc://127.0.0.1:1"})
        assert len(futures) == 1
        futures[0].result(timeout=30)
        assert not f._warm


@pytest.mark.timing
def test_fetcher_close_while_a_pool_thread_connects(tmp_path: Path) -> None:
    """A warm-up still running when the trainer closes gets a clear error, not a channel that is never closed
    (CI once saw ``close`` iterate the channel map while a ping thread added to it)."""
    f = Fetcher(timeout_s=2)
    gate = threading.Event()
    endpoint = f"grpc://127.0.0.1:{free_port()}"

    def late_connect() -> object:
        gate.wait(timeout=30)
        return f._client(endpoint)

    pending = f.pool.submit(late_connect)
    queued = f.warm({"node-q": endpoint})
    f.close()
    gate.set()
    with pytest.raises(Unavailable, match="fetcher is closed"):
        pending.result(timeout=30)
    for q in queued:  # a ping that ran finishes quietly (its error is logged), a queued one was cancelled
        assert q.cancelled() or q.result(timeout=30) is None
    assert not f._clients
    f.close()  # closing twice is harmless


def test_fetcher_warms_an_endpoint_once_and_one_that_failed_again(cluster: LocalCluster) -> None:
    """A warmed endpoint is not pinged again; one that did not answer (its ``health`` failed; no data lane
    here) is forgotten, so a later ``warm`` tries it again. ``close`` closes the channels and the pool."""
    store, dead = cluster.stores[0], f"grpc://127.0.0.1:{free_port()}"
    with Fetcher(timeout_s=2, data_lane=False) as f:
        for future in f.warm({store.node_id: store.endpoint, "node-x": dead}):
            future.result(timeout=30)
        assert f._warm == {store.endpoint}
        assert f.warm({store.node_id: store.endpoint}) == []
        again = f.warm({"node-x": dead})
        assert len(again) == 1
        again[0].result(timeout=30)
        channel = f._clients[store.endpoint]
    assert channel._closing  # close closes the channels and the worker pool
    with pytest.raises(RuntimeError):
        f.pool.submit(f.close)


class _Gate:
    """A lock that says when a thread starts waiting for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = threading.Event()

    def __enter__(self) -> None:
        self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_fetcher_threads_asking_for_one_endpoint_at_once_share_its_channel() -> None:
    """A thread that found no channel and then waited for the fetcher's lock uses the channel another thread
    made meanwhile (one channel per endpoint), instead of replacing it."""
    endpoint = f"grpc://127.0.0.1:{free_port()}"
    with Fetcher(timeout_s=2, data_lane=False) as f:
        gate = _Gate()
        f._lock = gate  # type: ignore[assignment]
        got: list[object] = []
        with gate.lock:
            waiter = threading.Thread(target=lambda: got.append(f._client(endpoint)))
            waiter.start()
            assert gate.waiting.wait(timeout=30)
            first = f._clients[endpoint] = StoreClient(endpoint, timeout_s=2, data_lane=False)
        waiter.join(timeout=30)
        assert got == [first] and f._clients == {endpoint: first}


def test_write_units_across_nodes_registers_once_and_is_all_or_none(cluster: LocalCluster, tmp_path: Path) -> None:
    """``write_units_across`` stores on both nodes at once and registers every unit in one request (through the
    first writer with a control client); a trainer consumes them. When one node fails, the other's units are
    removed and nothing is registered."""
    from knittrans.errors import Conflict, InvalidRequest
    from knittrans.flight.client import StoreClient
    from knittrans.rollout.writer import write_units_across

    control = cluster.control()
    control.create_job(job_spec("across", groups=4, group_size=2, k=1, world_size=1, micro_batch_size=2))
    s0, s1 = cluster.stores
    calls: list[int] = []
    register = control.register_units

    def counted(job: str, units: Any, **kw: Any) -> dict[str, Any]:
        calls.append(len(units))
        return register(job, units, **kw)

    control.register_units = counted  # type: ignore[method-assign]
    w0 = TrajectoryWriter(job="across", node_id=s0.node_id, endpoint=s0.endpoint, store_dir=s0.store_dir)
    w1 = TrajectoryWriter(job="across", node_id=s1.node_id, endpoint=s1.endpoint, control=control)  # DoPut
    bad = TrajectoryWriter(job="across", node_id=s0.node_id, endpoint=s0.endpoint, store_dir=tmp_path)
    with pytest.raises(Conflict, match="is the node on another host"):
        write_units_across([(w1, [mm_groups("x", 1, group_size=2)]), (bad, [mm_groups("y", 1, group_size=2)])])
    assert calls == [] and control.status("across")["counts"]["units"] == 0
    for s in (s0, s1):
        with StoreClient(s.endpoint) as c:
            assert c.list_units("across") == []
    with pytest.raises(InvalidRequest, match="every writer must write the same job"):
        other = TrajectoryWriter(job="other", node_id=s0.node_id, endpoint=s0.endpoint)
        write_units_across([(w0, [mm_groups("z", 1, group_size=2)]), (other, [mm_groups("z", 1, group_size=2)])])
    a, b = write_units_across(
        [
            (w0, [mm_groups("a", 1, group_size=2), mm_groups("b", 1, group_size=2, seed=1)]),
            (w1, [mm_groups("c", 1, group_size=2, seed=2), mm_groups("d", 1, group_size=2, seed=3)]),
        ]
    )  # control: w0 has none, w1's is used
    w1.flush()
    assert calls == [4] and control.status("across")["counts"]["units"] == 4
    assert {d.node_id for d in a} == {s0.node_id} and {d.node_id for d in b} == {s1.node_id}
    seen = _consume_all(cluster, "across")
    assert sorted(set(seen)) == ["a0", "b0", "c0", "d0"] and len(seen) == 8
    for w in (w0, w1, bad, other):
        w.close()
    control.close()


def test_cold_path_benchmark_smoke_writes_every_figure(tmp_path: Path) -> None:
    """benchmarks/trainer/cold_path.py at its smallest (1 run, 1 warm mini-batch, depth 1): every figure present,
    one cold and one warm reading with the plan no later than the micro-batch it made ready."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "trainer" / "cold_path.py"
    cmd = [sys.executable, str(script), "--runs", "1", "--warm", "1", "--depths", "1", "--compute-ms", "1"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "cold_path.json").read_text())
    assert result["workload"]["runs"] == 1 and result["workload"]["warm_per_run"] == 1
    assert result["machine"]["cpus"] >= 1 and len(result["machine"]["loadavg"]) == 3
    assert list(result["depth_sweep"]) == ["1"] and result["depth_sweep"]["1"]["mean_wait_ms_per_micro_batch"] >= 0
    for kind in ("cold", "warm"):
        ready, plan = result[kind]["admission_to_ready"], result[kind]["admission_to_plan"]
        assert ready["n"] == plan["n"] == 1 and ready["p50_ms"] >= plan["p50_ms"] >= 0, (kind, ready, plan)
    [run] = result["raw"]
    assert [r["kind"] for r in run] == ["cold", "warm"] and all(r["rows"] > 0 for r in run), run
    assert (tmp_path / "cold_path.md").read_text().startswith("# Cold path")
