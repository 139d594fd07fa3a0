"""Multi-host run in network namespaces: control plane, two rollout/store hosts, two trainer hosts.

Real processes run inside their own namespace (``ip netns exec``), each bound to its own address on a
private /24 behind a bridge in a switch namespace; ranks get no ``--local-dir`` so every row crosses
the (virtual) network from the host that owns it. Phase 1 trains two steps and checks quotas,
exactly-once delivery and staleness. Phase 2 cuts one store host's link while the ranks train
mini-batches with its rows (the same trainer processes throughout), and checks the reaction: the
ranks' fetches time out (``--fetch-timeout-s``) instead of hanging, no rank steps on a mini-batch
some rank could not fetch, the node is declared lost after its heartbeat timeout, its groups are
listed for regeneration, planned mini-batches with its rows are withdrawn and re-planned (next
attempt), and the job completes on the survivor with every trajectory trained exactly once
(checked from the ranks' records: plan ids and trajectory ids).

Needs root (CI runs as root); it fails, never skips, without it. Timings are printed, not asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from netns_support import PREFIX, Lab, Probe, clean_leftovers, ip, lab, our_namespaces

from knittrans.manifest import Manifest
from knittrans.procs import ProcessGroup, control_plane_args, knittrans_command
from knittrans.rollout.models import build_tiny_qwen2
from knittrans.sched.timing import staleness_bound

pytestmark = pytest.mark.netns

JOB = "mh"
W_TOKEN, A_TOKEN, S_TOKEN = "netns-worker", "netns-admin", "netns-store"
QUOTAS = {"math": 2, "mm_qa": 2}
K, STEPS, RANKS, GROUP = 2, 16, 2, 4
SOURCES = ["math:8-16:4-10", "mm_qa:8-16:8-16:image=3x16x16"]
NODE_TIMEOUT_S = 3.0
FETCH_TIMEOUT_S = 3.0
HOSTS = ["cp", "h1", "h2", "t0", "t1"]
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "eth0"}


def poll(
    what: str,
    check: Callable[[], Any],
    timeout_s: float,
    procs: ProcessGroup,
    interval_s: float = 0.1,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Call ``check`` until it returns something truthy; fail with ``what``, dead children and ``explain()``
    (what the test last saw) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    dead = {n: p.poll() for n, p in procs.children.items() if p.poll() not in (None, 0)}
    tails = "\n".join(f"--- {n}\n{procs.log_tail(n, 15)}" for n in dead)
    seen = f"\nlast seen: {explain()}" if explain is not None else ""
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; exited children {dead}{seen}\n{tails}")


@pytest.fixture
def netlab() -> Iterator[Lab]:
    """The namespaces; fails loudly (no skip) when not root."""
    assert os.geteuid() == 0, "tests/test_netns.py needs root to create network namespaces (CI runs as root)"
    assert shutil.which("ip"), "tests/test_netns.py needs `ip` from iproute2"
    with lab(HOSTS) as the_lab:
        yield the_lab


def _records(work: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(work.glob("rank-*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def _manifest_unless_consumed(probe: Any, control_url: str, n: int) -> Any:
    """Mini-batch ``n``'s manifest body (None: not admitted within 0.1 s, or consumed since the caller read
    the progress: the ranks keep training while the test looks)."""
    try:
        return probe.call(control_url, "manifest", JOB, n, 0.1)
    except RuntimeError as exc:
        if "was consumed" in str(exc):
            return None
        raise


def test_leftover_cleanup_spares_labs_of_running_processes() -> None:
    """A new lab removes the namespaces of runs whose process is gone, not those of a run still going
    (another test session or benchmark using its lab at the same moment)."""
    assert os.geteuid() == 0, "needs root to create network namespaces (CI runs as root)"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live, stale = f"{PREFIX}1-probe", f"{PREFIX}{gone.pid}-probe"  # pid 1 always runs
    for ns in (live, stale):
        ip("netns", "add", ns)
    try:
        removed = clean_leftovers()
        assert stale in removed and live not in removed
        assert live in our_namespaces() and stale not in our_namespaces()
    finally:
        for ns in (live, stale):
            ip("netns", "del", ns, check=False)


@pytest.mark.timing
def test_multihost_run_and_store_host_loss(netlab: Lab, tmp_path: Path) -> None:
    """Quotas exact, exactly-once, staleness, remote fetch; a cut store host is lost, re-planned, regenerated."""
    addr = netlab.hosts
    control_url = f"http://{addr['cp']}:8700"
    model_dir = build_tiny_qwen2(tmp_path / "model", seed=0)
    weights = tmp_path / "weights"
    weights.mkdir()
    timings: dict[str, float] = {}
    procs = ProcessGroup(tmp_path / "logs")
    probe = Probe(netlab, "t0", token=W_TOKEN)
    try:

        def start(name: str, host: str, *argv: str) -> None:
            procs.start(name, knittrans_command(*argv), env=ENV, prefix=netlab.exec_prefix(host))

        start(
            "control-plane",
            "cp",
            *control_plane_args(
                tmp_path / "control.db",
                host=addr["cp"],
                port=8700,
                node_timeout_s=NODE_TIMEOUT_S,
                extra=["--worker-token", W_TOKEN, "--admin-token", A_TOKEN],
            ),
        )
        poll("control plane", lambda: _try(lambda: probe.call(control_url, "health")), 60, procs)
        probe.call(
            control_url,
            "create_job",
            {
                "name": JOB,
                "group_size": GROUP,
                "quotas": QUOTAS,
                "mini_batches_per_step": K,
                "policy": "constraint_preserving",
                "world_size": RANKS,
                "micro_batch_size": 4,
                "total_steps": STEPS,
                "window": 2,
            },
            token=A_TOKEN,
        )
        nodes = {"node-0": "h1", "node-1": "h2"}
        endpoints = {n: f"grpc://{addr[h]}:8815" for n, h in nodes.items()}
        for node, host in nodes.items():
            store_dir = tmp_path / "stores" / node
            store_dir.mkdir(parents=True)
            start(
                f"store-{node}",
                host,
                "store",
                "--dir",
                str(store_dir),
                "--host",
                addr[host],
                "--port",
                "8815",
                "--node-id",
                node,
                "--advertise",
                endpoints[node],
                "--control-url",
                control_url,
                "--heartbeat-s",
                "0.5",
                "--token",
                S_TOKEN,
                "--control-token",
                W_TOKEN,
            )
        poll("store registration", lambda: len(probe.call(control_url, "list_nodes")) == 2, 60, procs)
        for i, (node, host) in enumerate(nodes.items()):
            argv = [
                "rollout",
                "--control-url",
                control_url,
                "--job",
                JOB,
                "--worker-id",
                f"w{i}",
                "--node-id",
                node,
                "--store-endpoint",
                endpoints[node],
                "--store-dir",
                str(tmp_path / "stores" / node),
                "--model-dir",
                str(model_dir),
                "--weights-dir",
                str(weights),
                "--state-file",
                str(tmp_path / f"w{i}.json"),
                "--group-size",
                str(GROUP),
                "--chunk-tokens",
                "8",
                "--seed",
                str(i),
                "--token",
                W_TOKEN,
                "--store-token",
                S_TOKEN,
            ]
            for s in SOURCES:
                argv += ["--source", s]
            start(f"rollout-{node}", host, *argv)

        def start_trainers(model: Path, port: int) -> None:
            for rank in range(RANKS):  # no --local-dir: every row is fetched over Flight from its owner
                start(
                    f"rank-{rank}",
                    f"t{rank}",
                    "train",
                    "--control-url",
                    control_url,
                    "--job",
                    JOB,
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(RANKS),
                    "--dist-url",
                    f"tcp://{addr['t0']}:{port}",
                    "--model-dir",
                    str(model),
                    "--weights-dir",
                    str(weights),
                    "--fetch-mode",
                    "iter",
                    "--lr",
                    "1e-3",
                    "--out",
                    str(tmp_path / f"rank-{rank}.jsonl"),
                    "--token",
                    W_TOKEN,
                    "--store-token",
                    S_TOKEN,
                    "--threads",
                    "1",
                    "--fetch-timeout-s",
                    str(FETCH_TIMEOUT_S),
                )

        def status() -> dict[str, Any]:
            result: dict[str, Any] = probe.call(control_url, "status", JOB)
            return result

        # ---------------------------------------------------------------- phase 1: two train steps
        t0 = time.monotonic()
        start_trainers(model_dir, 29500)
        consumed_at: dict[int, float] = {}

        def consumed(n: int) -> bool:
            c = status()["counts"]["consumed_mini_batches"]
            consumed_at.setdefault(c, time.monotonic())
            return c >= n

        poll("the first mini-batch", lambda: consumed(1), 120, procs)
        timings["first_mini_batch_s"] = time.monotonic() - t0
        poll("two train steps", lambda: consumed(2 * K), 120, procs)
        first_seen = {n: min(t for c, t in consumed_at.items() if c >= n) for n in (K, 2 * K)}
        timings["step_s"] = first_seen[2 * K] - first_seen[K]  # the second train step, polled at 10 Hz
        plan_endpoints = set()
        # every manifest's reads go to a namespace address, never loopback or a local dir
        position = probe.call(control_url, "progress", JOB)["position"]
        for n in (position, position + 1):
            body = _manifest_unless_consumed(probe, control_url, n)
            if body is not None:
                plan_endpoints |= {node.endpoint for node in Manifest.from_json(body).nodes}
        assert plan_endpoints <= set(endpoints.values())

        # pause: the trainers (kept running) drain what is planned and wait; rollout fills the pool (window)
        probe.call(control_url, "pause", JOB, token=A_TOKEN)
        paused_at = status()
        assert paused_at["next_global_index"] < STEPS * K, "phase 1 ran to the end; give the job more steps"

        def idle() -> bool:
            st = status()
            done = st["counts"]["consumed_mini_batches"]
            per_rank = [sum(1 for r in _records(tmp_path) if r["rank"] == k) for k in range(RANKS)]
            return st["counts"]["in_flight_mini_batches"] == 0 and per_rank == [done] * RANKS

        poll("trainers idle after pause", idle, 60, procs)
        phase1 = status()
        _check_steps(phase1, range(phase1["counts"]["consumed_mini_batches"] // K))
        assert phase1["staleness"]["overall"]["end"]["architectural"]["count"] > 0

        # ---------------------------------------------------------------- phase 2: cut a store host
        total = STEPS * K

        last: dict[str, Any] = {}

        def pool_ready() -> bool:
            """A train step of finished groups in the pool and rollout idle: a paused job keeps its window's
            room (W·G = 8 groups), so rollout fills the pool while nothing is admitted."""
            st = status()
            last.update(counts=st["counts"])
            finished, idle = st["counts"]["finished"], not any(st["counts"]["pending"].values())
            return idle and all(finished.get(s, 0) >= q for s, q in QUOTAS.items())

        def rollout_logs() -> str:
            tails = "\n".join(f"--- {n}\n{procs.log_tail(n, 10)}" for n in procs.children if n.startswith("rollout"))
            return f"{last}\n{tails}"

        poll("finished groups in the pool, rollout idle", pool_ready, 180, procs, explain=rollout_logs)
        before = status()
        # The victim is the node holding the group admission takes first: its rows are in the first plan
        # after the resume. (Which node that is depends on which worker finished first: under load one
        # worker can have nothing in the pool, and cutting it would withdraw nothing.)
        victim = before["pool"]["head"][0]["node_id"]
        (survivor,) = set(nodes) - {victim}
        t_cut = time.monotonic()
        # Cut first, then resume: the running ranks get plans with rows on the victim (not yet declared
        # lost) and must fail them together (fetch timeout) instead of hanging or stepping on a partial share.
        netlab.cut(nodes[victim])
        probe.call(control_url, "resume", JOB, token=A_TOKEN)

        def lost() -> bool:
            return any(n["node_id"] == victim and n["state"] == "lost" for n in probe.call(control_url, "list_nodes"))

        poll(f"{victim} declared lost", lost, 30, procs, interval_s=0.05)
        timings["cut_to_lost_s"] = time.monotonic() - t_cut
        after = status()
        # the surviving worker may claim them for regeneration at once, which takes them off to_regenerate
        lost_groups = [r for r in after["lost_groups"] if r["node_id"] == victim]
        assert lost_groups, f"no group of {victim} reported lost: {after['lost_groups']}"
        assert {r["group_id"] for r in after["to_regenerate"]} <= {r["group_id"] for r in after["lost_groups"]}
        assert all(r["reason"] == f"node {victim} lost" for r in after["to_regenerate"] if r["node_id"] == victim)
        log_path = tmp_path / "logs" / "control-plane.log"
        pattern = re.compile(rf"node {victim} lost, withdrew mini-batches \[([0-9, ]+)\]")
        found = poll("withdrawal in the control-plane log", lambda: pattern.findall(log_path.read_text()), 10, procs)
        withdrawn = [int(x) for x in found[0].split(",")]
        first_withdrawn = withdrawn[0]
        assert withdrawn == list(range(first_withdrawn, withdrawn[-1] + 1)), withdrawn
        assert first_withdrawn >= before["counts"]["consumed_mini_batches"]  # consumed ones are never withdrawn
        poll(
            "both ranks to give up the plans they could not fetch",
            lambda: all("abandoned" in procs.log_tail(f"rank-{r}", 400) for r in range(RANKS)),
            60,
            procs,
        )
        timings["cut_to_abandoned_s"] = time.monotonic() - t_cut
        # admission runs at most `lookahead` (1) mini-batches beyond the trainer: the withdrawn indices are
        # re-planned as the ranks reach them, not all at once
        poll("re-plan of the withdrawn mini-batches", lambda: status()["next_global_index"] > withdrawn[-1], 120, procs)
        timings["cut_to_replanned_s"] = time.monotonic() - t_cut
        # a manifest the ranks get from now on for a withdrawn index is a re-plan that never reads the lost node
        for mb in probe.call(control_url, "progress", JOB)["in_flight"]:
            body = _manifest_unless_consumed(probe, control_url, mb["global_index"])
            manifest = Manifest.from_json(body) if body is not None else None
            if manifest is not None and manifest.global_index >= first_withdrawn:
                assert {node.node_id for node in manifest.nodes} <= {survivor}
                if manifest.global_index == first_withdrawn:
                    assert manifest.attempt == 1, manifest.manifest_id

        final = poll("job completed", lambda: (s := status())["state"] == "completed" and s, 180, procs, 0.2)
        timings["cut_to_completed_s"] = time.monotonic() - t_cut
        for rank in range(RANKS):
            assert procs.children[f"rank-{rank}"].wait(timeout=60) == 0, procs.log_tail(f"rank-{rank}", 40)

        # ---------------------------------------------------------------- end-to-end invariants
        assert final["counts"]["consumed_mini_batches"] == total
        assert final["counts"]["consumed_groups"] == STEPS * sum(QUOTAS.values())
        _check_steps(final, range(STEPS))
        records = _records(tmp_path)
        by_index: dict[int, list[dict[str, Any]]] = {}
        for r in records:
            by_index.setdefault(r["global_index"], []).append(r)
        assert sorted(by_index) == list(range(total)), "every mini-batch trained, none twice"
        for n, rs in by_index.items():  # exactly once per rank, and all of its rows: never half-trained
            assert sorted(r["rank"] for r in rs) == list(range(RANKS)), f"mini-batch {n}: ranks {rs}"
            assert sum(r["rows"] for r in rs) == rs[0]["global_trajectories"]
            assert rs[0]["global_trajectories"] == GROUP * sum(QUOTAS.values()) // K
            assert all(r["row_bytes"] > 0 or r["rows"] == 0 for r in rs), "rows came over Flight"
            assert len({r["plan_id"].split(".")[1] for r in rs}) == 1, f"mini-batch {n}: ranks trained other attempts"
            if n in withdrawn:  # trained from its re-plan, never from the withdrawn plan
                assert all(r["attempt"] >= 1 for r in rs), f"mini-batch {n}: {[r['plan_id'] for r in rs]}"
        trained = [t for r in records for t in r["traj_ids"]]
        assert len(trained) == len(set(trained)) == total * GROUP * sum(QUOTAS.values()) // K, "exactly once"
        assert not {t.rsplit(".", 1)[0] for t in trained} & {r["group_id"] for r in lost_groups}, (
            "a trajectory of a lost group was trained"
        )
        remaining = {r["group_id"] for r in final["to_regenerate"]}
        assert remaining < {r["group_id"] for r in after["to_regenerate"]} or not remaining, (
            "the surviving worker claimed lost groups when it regenerated"
        )
        end = final["staleness"]["overall"]["end"]["architectural"]
        assert end["count"] == total * GROUP * 2
        # fresh in the live loop: within the bound the timing rule derives (window 2; the ranks publish before
        # they ack, so at most one step ends during a group's last chunk)
        G = sum(QUOTAS.values())
        bound = max(
            staleness_bound(mini_batches_per_step=K, window=2, train_batch_groups=G, quota=q, sync_lag=1)
            for q in QUOTAS.values()
        )
        assert end["max"] <= bound, f"end-reading architectural staleness {end} above the bound {bound}"
        timings["total_s"] = time.monotonic() - t0
        per_step: dict[int, float] = {}
        for rs in by_index.values():  # a mini-batch takes as long as its slowest rank (DDP)
            per_step[rs[0]["step"]] = per_step.get(rs[0]["step"], 0.0) + max(r["step_time_s"] for r in rs)
        timings["train_step_s_mean"] = sum(per_step.values()) / len(per_step)
        timings["exposed_fetch_s_per_mini_batch"] = sum(r["wait_s"] for r in records) / len(records)
        print("\nnetns timings: " + ", ".join(f"{k}={v:.2f}" for k, v in timings.items()))
        (tmp_path / "timings.json").write_text(json.dumps(timings))
    finally:
        probe.close()
        procs.stop_all(grace_s=5)


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError:
        return None


def _check_steps(status: dict[str, Any], steps: range) -> None:
    """Each completed train step consumed exactly ``QUOTAS`` groups per source."""
    by_step = status["staleness"]["by_step"]
    for step in steps:
        counts = {s: v["staleness"]["count"] // GROUP for s, v in by_step[str(step)]["end"]["by_source"].items()}
        assert counts == QUOTAS, f"step {step}: consumed {counts}, quotas {QUOTAS}"
