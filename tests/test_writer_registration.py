"""A writer's registrations in the background (``knittrans.rollout.registrar``) and ``register_units`` over HTTP,
against real control-plane and store processes: puts return once sealed, queued puts coalesce into one request,
every unit is registered once, refusals are raised once (by the next call, ``flush`` or ``close``) with their
type and the units they left unregistered."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from api_support import ServerProcess, job_spec, register_from_threads, server, single_group_units
from trainer_support import job_spec as trainer_job_spec
from trainer_support import mm_groups

from knittrans.controlclient import ControlClient
from knittrans.errors import Conflict, InvalidRequest, NotFound, Unauthenticated
from knittrans.flight.client import StoreClient
from knittrans.local import LocalCluster
from knittrans.procs import wait_until
from knittrans.rollout.writer import TrajectoryWriter


class _Gate:
    """Wraps ``control.register_units``: records each request's unit ids; the first request waits for ``open``."""

    def __init__(self, control: ControlClient) -> None:
        self.calls: list[list[str]] = []
        self.entered, self.open = threading.Event(), threading.Event()
        register = control.register_units

        def gated(job: str, units: Sequence[Any], **kw: Any) -> dict[str, Any]:
            self.calls.append([u.unit_id for u in units])
            if len(self.calls) == 1:
                self.entered.set()
                assert self.open.wait(60)
            return register(job, units, **kw)

        control.register_units = gated  # type: ignore[method-assign]


def _writer(cluster: LocalCluster, job: str, control: ControlClient) -> TrajectoryWriter:
    store = cluster.stores[0]
    return TrajectoryWriter(
        job=job, node_id=store.node_id, endpoint=store.endpoint, store_dir=store.store_dir, control=control
    )


def _stored(cluster: LocalCluster, job: str) -> set[str]:
    with StoreClient(cluster.stores[0].endpoint) as c:
        return {u["unit_id"] for u in c.list_units(job)}


def test_puts_return_sealed_and_queued_puts_register_once_in_one_request(cluster: LocalCluster) -> None:
    """While a registration is in flight the next puts return with their units sealed and not yet registered; they
    go in one request once it is done; ``flush`` waits for them; every unit is registered once."""
    control = cluster.control()
    control.create_job(trainer_job_spec("bg", groups=8, group_size=2, k=1, world_size=1, micro_batch_size=2))
    gate = _Gate(control)
    with _writer(cluster, "bg", control) as writer:
        first = writer.write_groups(mm_groups("a", 1, group_size=2))
        assert gate.entered.wait(60)
        later = [writer.write_groups(mm_groups(p, 1, group_size=2, seed=k)) for k, p in enumerate("bcd")]
        assert _stored(cluster, "bg") == {d.unit_id for d in [first, *later]}  # sealed on the node
        assert control.status("bg")["counts"]["units"] == 0  # none registered yet
        gate.open.set()
        writer.flush()
        assert gate.calls == [[first.unit_id], [d.unit_id for d in later]]
        assert control.status("bg")["counts"]["units"] == 4
        writer.write_units([mm_groups("e", 1, group_size=2, seed=9)])
    # close() flushed the last put
    assert control.status("bg")["counts"]["units"] == 5 and len(gate.calls) == 3
    control.close()


def test_a_refused_registration_is_raised_once_with_its_units_and_the_rest_of_its_request_registers(
    cluster: LocalCluster,
) -> None:
    """A put whose group is registered already (Conflict) coalesced with a good one: the request is split, the good
    unit registers, and ``flush`` raises the Conflict once, naming the refused unit and carrying its descriptor."""
    control = cluster.control()
    control.create_job(trainer_job_spec("refuse", groups=8, group_size=2, k=1, world_size=1, micro_batch_size=2))
    gate = _Gate(control)
    writer = _writer(cluster, "refuse", control)
    writer.write_groups(mm_groups("x", 1, group_size=2))
    assert gate.entered.wait(60)
    clash = writer.write_groups(mm_groups("x", 1, group_size=2))  # group x0 again, in a unit of another id
    good = writer.write_groups(mm_groups("y", 1, group_size=2, seed=1))
    gate.open.set()
    with pytest.raises(Conflict, match=rf"units \['{clash.unit_id}'\] of job 'refuse' were stored but not registered"):
        writer.flush()
    writer.flush()  # raised once
    assert len(gate.calls) == 4 and gate.calls[1] == [clash.unit_id, good.unit_id]  # then each on its own
    assert control.status("refuse")["counts"]["units"] == 2  # x0's first unit and y0's
    writer.close()
    control.close()


def test_a_put_of_no_units_sends_no_registration(cluster: LocalCluster) -> None:
    """``write_units([])`` stores nothing and asks the control plane nothing."""
    control = cluster.control()
    control.create_job(trainer_job_spec("none", groups=8, group_size=2, k=1, world_size=1, micro_batch_size=2))
    gate = _Gate(control)
    gate.open.set()
    with _writer(cluster, "none", control) as writer:
        assert writer.write_units([]) == []
        writer.flush()
    assert gate.calls == []
    control.close()


@pytest.mark.timing
def test_an_earlier_failure_is_raised_by_the_next_write_before_it_writes(cluster: LocalCluster) -> None:
    """A background failure is raised by the writer's next write, which then stores nothing; the one after works.
    The failure carries the descriptors left unregistered."""
    control = cluster.control()
    control.create_job(trainer_job_spec("next", groups=8, group_size=2, k=1, world_size=1, micro_batch_size=2))
    writer = _writer(cluster, "next", control)
    writer.write_groups(mm_groups("n", 1, group_size=2))
    writer.flush()
    clash = writer.write_groups(mm_groups("n", 1, group_size=2))
    assert writer._registrar is not None
    registrar = writer._registrar
    wait_until(lambda: not registrar._busy, timeout_s=60, what="the background registration to end")
    before = _stored(cluster, "next")
    with pytest.raises(Conflict, match="already registered") as raised:
        writer.write_groups(mm_groups("m", 1, group_size=2, seed=2))
    assert [u.unit_id for u in raised.value.units] == [clash.unit_id]  # type: ignore[attr-defined]
    assert isinstance(raised.value.__cause__, Conflict)  # the control plane's own refusal, chained
    assert _stored(cluster, "next") == before  # the refused write stored nothing
    writer.write_groups(mm_groups("m", 1, group_size=2, seed=2))
    writer.close()
    assert control.status("next")["counts"]["units"] == 2
    control.close()


def _setup(admin: ControlClient) -> None:
    admin.create_job(job_spec(quotas={"math": 100, "code": 100}, mini_batches_per_step=1, world_size=1))
    admin.register_node("n0", "grpc://127.0.0.1:1", host="h0")


def test_registration_errors_keep_their_types_and_threads_all_land(tmp_path: Path) -> None:
    """``register_units`` raises the control plane's refusals with their type and words; registrations from several
    threads through one client all land."""
    with (
        server(tmp_path / "cp.db", "--admin-token", "at", "--worker-token", "wt") as srv,
        ControlClient(srv.url, token="at") as admin,
        ControlClient(srv.url, token="wt") as worker,
        ControlClient(srv.url, token="nope") as stranger,
    ):
        _setup(admin)
        with pytest.raises(Unauthenticated):
            stranger.register_units("job1", single_group_units(["math"]))
        with pytest.raises(NotFound, match="ghost"):
            worker.register_units("ghost", single_group_units(["math"], job="ghost"))
        bad = single_group_units(["math"])
        bad[0]["groups"][0]["version_start"] = -3
        with pytest.raises(InvalidRequest, match="version_start"):
            worker.register_units("job1", bad)
        assert not register_from_threads(worker, threads=4, each=5)
        assert admin.status("job1")["counts"]["units"] == 4 * 5 * 2


def test_registration_across_a_control_plane_restart_goes_through(tmp_path: Path) -> None:
    """A registration after the control plane was killed and restarted on the same port is retried and lands."""
    srv = ServerProcess(tmp_path / "cp.db").start()
    try:
        with ControlClient(srv.url) as client:
            _setup(client)
            client.register_units("job1", single_group_units(["math", "code"], prefix="a"))
            srv.kill()
            srv.start()
            client.register_units("job1", single_group_units(["math", "code"], prefix="b"))
            assert client.status("job1")["counts"]["units"] == 4
    finally:
        srv.stop()
