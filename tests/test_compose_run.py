"""``docker-compose.yml`` for real: build, start, run a job to completion, lose a store container, tear down.

Marked ``compose`` (own CI step in ``scripts/test.sh``, which installs and starts the Docker engine
first). Needs a running engine, ``docker-compose`` (v1) or the v2 plugin, and ``debootstrap`` the
first time (the base image). If the engine is not reachable the test fails and says why. Every
run uses its own compose project name, subnets and admin port, and removes its containers,
networks and volumes afterwards, also on failure. Timings go to ``results/compose/compose_run.json``
(``KNITTRANS_ARTIFACTS`` overrides the directory).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from api_support import free_port

from knittrans.api.service import HEARTBEATS_PER_TIMEOUT
from knittrans.sched.timing import staleness_bound

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2700)]  # image builds take minutes on a busy machine

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compose_up.sh"
STEPS, K, GROUP, RANKS = 6, 4, 4, 2
QUOTAS = {"math": 4, "mm_qa": 4}
T = TypeVar("T")


def _compose_cmd() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed (apt-get install -y docker-compose)")


def _engine() -> None:
    """Fail with the engine's own words when no Docker engine answers."""
    if not shutil.which("docker"):
        pytest.fail("no docker CLI: apt-get install -y docker.io, then start dockerd (scripts/test.sh does both)")
    info = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}} {{.Driver}}"], capture_output=True, text=True, timeout=60
    )
    if info.returncode != 0:
        pytest.fail(
            f"the Docker engine is not reachable: {info.stderr.strip() or info.stdout.strip()} "
            "(scripts/test.sh starts dockerd and prints its log when it cannot)"
        )


class Stack:
    """One compose project: its environment, commands, the admin API and the containers' ids."""

    def __init__(self, tmp: Path) -> None:
        n = os.getpid() % 120 * 2
        self.project = f"knittrans-ci-{os.getpid()}"
        self.port = free_port()
        self.admin = secrets.token_hex(16)
        self.env = {
            **os.environ,
            "COMPOSE_PROJECT_NAME": self.project,
            "KNITTRANS_ADMIN_PORT": str(self.port),
            "KNITTRANS_WORKER_TOKEN": secrets.token_hex(16),
            "KNITTRANS_STORE_TOKEN": secrets.token_hex(16),
            "KNITTRANS_ADMIN_TOKEN": self.admin,
            "KNITTRANS_NODE_TIMEOUT_S": "6",
            "KNITTRANS_TOTAL_STEPS": str(STEPS),
            "KNITTRANS_BACKEND_SUBNET": f"10.219.{n}.0/24",
            "KNITTRANS_ADMIN_SUBNET": f"10.219.{n + 1}.0/24",
            "KNITTRANS_STORE_SHM_SIZE": "256m",
            "KNITTRANS_STORE_BUDGET_BYTES": str(128 << 20),
            "KNITTRANS_TICKET_KEY": secrets.token_hex(24),
            "KNITTRANS_TLS_DIR": str(tmp / "tls"),
        }
        self.ca = tmp / "tls" / "ca.pem"  # made by compose_up.sh: every hop of the stack is TLS
        self.url = f"https://127.0.0.1:{self.port}"
        self.compose = _compose_cmd()
        self._api: httpx.Client | None = None
        self.logs = tmp / "compose-logs.txt"
        self.refused: list[str] = []  # every answer of the admin API other than 200 that get() saw

    @property
    def api(self) -> httpx.Client:
        """Admin client of the control plane, verifying the stack's CA (made when the stack starts)."""
        if self._api is None:
            self._api = httpx.Client(
                base_url=self.url,
                timeout=10,
                verify=ssl.create_default_context(cafile=str(self.ca)),
                headers={"Authorization": f"Bearer {self.admin}"},
            )
        return self._api

    def run(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(args), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`{' '.join(args)}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def adopt_env(self) -> None:
        """Take what compose_up.sh set up (per-process tokens, TLS) so plain docker-compose calls work."""
        for line in self.run("bash", str(SCRIPT), "env", timeout=120).stdout.splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            self.env[name] = shlex.split(value)[0] if value else ""

    def dc(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(*self.compose, *args, timeout=timeout, check=check)

    def container(self, service: str) -> str:
        ids = self.dc("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str, fmt: str) -> str:
        return self.run("docker", "inspect", "-f", fmt, self.container(service)).stdout.strip()

    def get(self, path: str) -> Any:
        """``GET path``'s JSON; any other answer than 200 is noted in :attr:`refused` and raised as an
        AssertionError naming it (so :func:`poll` retries it and reports the last one)."""
        r = self.api.get(path)
        if r.status_code != 200:
            self.refused.append(f"GET {path}: {r.status_code} {r.text[:500]}")
            raise AssertionError(self.refused[-1])
        return r.json()

    def status(self) -> dict[str, Any]:
        return self.get("/v1/jobs/demo/status")  # type: ignore[no-any-return]

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.get("/v1/nodes")}

    def records(self, tmp: Path) -> list[dict[str, Any]]:
        out = []
        for rank in range(RANKS):
            dest = tmp / f"rank-{rank}.jsonl"
            self.run("docker", "cp", f"{self.container(f'trainer-{rank}')}:/results/rank-{rank}.jsonl", str(dest))
            out += [{**json.loads(line), "rank": rank} for line in dest.read_text().splitlines() if line.strip()]
        return out

    def down(self) -> None:
        logs = self.dc("logs", "--no-color", "--tail", "200", timeout=120, check=False).stdout
        self.logs.write_text(logs)
        # CI shows stdout (-s): the control plane's warnings and errors, and the refused API answers
        said = [ln for ln in logs.splitlines() if ln.startswith("control-plane") and re.search(" (WARNING|ERROR) ", ln)]
        print("\n".join(["", "control plane's warnings and errors (last 40):", *said[-40:]]))
        print("\n".join(["admin API answers other than 200 (last 20):", *self.refused[-20:]]))
        self.run("bash", str(SCRIPT), "--down", timeout=300, check=False)
        if self._api is not None:
            self._api.close()


def poll(what: str, check: Callable[[], T], timeout_s: float, interval_s: float = 0.25) -> T:
    """Wait until ``check()`` is truthy (transport errors count as not yet); fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.TransportError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    _engine()
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.down()
        leftovers = s.run(
            "docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={s.project}", check=False
        ).stdout.split()
        assert not leftovers, f"containers left after teardown: {leftovers}"


def _screenshot(stack: Stack, path: Path) -> None:
    """The live stack's /ui in headless chromium (for the docs: a lost node, lost groups, real staleness)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        # the page is served over HTTPS with the stack's own CA (httpx checks the chain elsewhere)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, ignore_https_errors=True)
        page.goto(f"{stack.url}/ui#token={stack.admin}")
        page.locator('.badge[data-state="lost"]').wait_for(timeout=30_000)
        page.screenshot(path=str(path), full_page=True)
        browser.close()


def _artifacts() -> Path:
    out = Path(os.environ.get("KNITTRANS_ARTIFACTS", ROOT / "results")) / "compose"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_compose_stack_runs_job_and_survives_store_loss(stack: Stack, tmp_path: Path) -> None:
    """Health checks pass, the job completes with exact quotas and exactly-once; a killed store is declared lost."""
    timings: dict[str, float] = {}
    t = time.monotonic()
    stack.run("bash", str(SCRIPT), "--build", timeout=1500)
    timings["image_build_s"] = time.monotonic() - t

    t0 = time.monotonic()
    stack.run("bash", str(SCRIPT), "up", timeout=600)
    stack.adopt_env()
    for service in ("control-plane", "store-a", "store-b"):  # `up` waited for these; check it did
        assert stack.inspect(service, "{{.State.Health.Status}}") == "healthy", service
    assert stack.inspect("setup", "{{.State.Status}} {{.State.ExitCode}}") == "exited 0"
    timings["startup_s"] = time.monotonic() - t0

    # TLS on every hop: the API answers HTTPS only (verified against the stack's CA), stores advertise grpc+tls
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{stack.port}/v1/health", timeout=5)
    assert {n["endpoint"].split("://")[0] for n in stack.nodes().values()} == {"grpc+tls"}

    # networks: explicit subnets, the backend internal; only the control plane publishes a port
    backend = json.loads(stack.run("docker", "network", "inspect", f"{stack.project}_backend").stdout)[0]
    assert backend["Internal"] is True
    assert backend["IPAM"]["Config"][0]["Subnet"] == stack.env["KNITTRANS_BACKEND_SUBNET"]
    for service in ("store-a", "trainer-0"):
        assert stack.inspect(service, "{{json .NetworkSettings.Ports}}") in (
            "{}",
            '{"8815/tcp":null}',
            '{"29500/tcp":null}',
        ), service

    def consumed(n: int) -> bool:
        return stack.status()["counts"]["consumed_mini_batches"] >= n  # type: ignore[no-any-return]

    poll("the first mini-batch consumed", lambda: consumed(1), 300)
    timings["first_mini_batch_s"] = time.monotonic() - t0
    poll("one train step consumed", lambda: consumed(K), 300)

    # pause; once the rollout workers filled the window and idle, kill the store container holding finished,
    # unadmitted groups
    assert stack.api.post("/v1/jobs/demo/pause").status_code == 200
    poll("nothing in flight after pause", lambda: stack.status()["counts"]["in_flight_mini_batches"] == 0, 120)

    def settled_pool() -> dict[str, dict[str, int]]:
        """The pool once rollout filled the window (a paused job keeps its room) and nothing generates:
        nothing can join it before the kill."""
        full = not any(stack.get("/v1/jobs/demo/headroom")["headroom"].values())
        st = stack.status()
        pool = stack.get("/v1/overview")["jobs"][0]["pool_by_node"]
        return pool if full and not any(st["counts"]["pending"].values()) and pool else {}

    pool = poll("finished groups in the pool, workers idle", settled_pool, 180)
    node = "node-a" if "node-a" in pool else "node-b"
    store = "store-" + node[-1]
    before = stack.status()
    t_kill = time.monotonic()
    stack.run("docker", "kill", stack.container(store))
    assert stack.api.post("/v1/jobs/demo/resume").status_code == 200
    poll(f"{node} declared lost", lambda: stack.nodes()[node]["state"] == "lost", 60, 0.1)
    timings["kill_to_lost_s"] = time.monotonic() - t_kill
    lost_reason = stack.nodes()[node]["lost_reason"]
    after = stack.status()
    lost_groups = [r for r in after["lost_groups"] if r["node_id"] == node]
    assert len(lost_groups) == sum(pool[node].values()), (
        f"the {pool[node]} pooled groups of {node} must be reported lost: {after['lost_groups']}"
    )
    assert {r["group_id"] for r in after["to_regenerate"]} <= {r["group_id"] for r in after["lost_groups"]}
    if os.environ.get("KNITTRANS_UPDATE_DOCS_IMG") == "1":
        _screenshot(stack, ROOT / "docs" / "img" / "dashboard_compose.png")
    poll("a mini-batch consumed after the loss", lambda: consumed(before["counts"]["consumed_mini_batches"] + 1), 300)
    timings["kill_to_next_consumed_s"] = time.monotonic() - t_kill

    # the store comes back (a killed container is not restarted by its policy: start it) and registers again
    stack.run("docker", "start", stack.container(store))
    poll(f"{node} alive again", lambda: stack.nodes()[node]["state"] == "alive", 120)

    final = poll("job completed", lambda: (s := stack.status())["state"] == "completed" and s, 600, 0.5)
    timings["kill_to_completed_s"] = time.monotonic() - t_kill
    timings["job_s"] = time.monotonic() - t0
    for rank in range(RANKS):
        poll(
            f"trainer-{rank} exited", lambda r=rank: stack.inspect(f"trainer-{r}", "{{.State.Status}}") == "exited", 120
        )
        assert stack.inspect(f"trainer-{rank}", "{{.State.ExitCode}}") == "0"

    # exact quotas per step, exactly-once from the ranks' own records
    total = STEPS * K
    assert final["counts"]["consumed_mini_batches"] == total
    assert final["counts"]["consumed_groups"] == STEPS * sum(QUOTAS.values())
    for step in range(STEPS):
        by_source = final["staleness"]["by_step"][str(step)]["end"]["by_source"]
        counts = {s: v["staleness"]["count"] // GROUP for s, v in by_source.items()}
        assert counts == QUOTAS, f"step {step}: consumed {counts}, quotas {QUOTAS}"
    # fresh in the live loop: every group's end-reading architectural staleness within the bound the
    # timing rule derives (window 1 of the compose job; the ranks publish before they ack, so one step at
    # most may end during a group's last chunk)
    bound = max(
        staleness_bound(mini_batches_per_step=K, window=1, train_batch_groups=sum(QUOTAS.values()), quota=q, sync_lag=1)
        for q in QUOTAS.values()
    )
    end = final["staleness"]["overall"]["end"]["architectural"]
    assert end["max"] <= bound, f"end-reading architectural staleness {end} above the bound {bound}"
    timings["end_staleness_max"], timings["end_staleness_bound"] = end["max"], bound
    records = stack.records(tmp_path)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_index.setdefault(r["global_index"], []).append(r)
    assert sorted(by_index) == list(range(total)), "every mini-batch trained, none twice"
    for n, rs in by_index.items():
        assert sorted(r["rank"] for r in rs) == list(range(RANKS)), f"mini-batch {n}: ranks {rs}"
        assert sum(r["rows"] for r in rs) == rs[0]["global_trajectories"] == GROUP * sum(QUOTAS.values()) // K
        assert len({r["plan_id"].split(".")[1] for r in rs}) == 1, f"mini-batch {n}: ranks trained other attempts"
    trained = [tid for r in records for tid in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == total * GROUP * sum(QUOTAS.values()) // K, "exactly once"
    assert not {tid.rsplit(".", 1)[0] for tid in trained} & {r["group_id"] for r in lost_groups}, (
        "a trajectory of a lost group was trained"
    )
    cp_log = stack.dc("logs", "--no-color", "control-plane").stdout
    withdrew = re.findall(rf"node {node} lost, withdrew mini-batches \[([0-9, ]+)\]", cp_log)
    # a 5xx other than 503 (the database refused a write; retry) is a bug of the control plane
    crashed = [r for r in stack.refused if re.match(r"GET \S+: 5(?!03)", r)]
    unhandled = [i for i, ln in enumerate(cp_log.splitlines()) if "unhandled error" in ln]
    assert not crashed and not unhandled, "\n".join(
        [*crashed, *("\n".join(cp_log.splitlines()[i : i + 30]) for i in unhandled[:3])]
    )
    for n in (int(x) for found in withdrew for x in found.split(",")):
        assert all(r["attempt"] >= 1 for r in by_index[n]), f"mini-batch {n} trained from its withdrawn plan"

    # the overview saw both nodes' usage and both ranks' transfer figures
    view = stack.get("/v1/overview")
    assert all(n["usage"] is not None for n in view["nodes"])
    (job,) = view["jobs"]
    assert [r["mini_batches"] > 0 and r["row_bytes"] > 0 for r in job["ranks"]] == [True] * RANKS
    metrics = stack.api.get("/metrics").text
    assert 'knittrans_rank_physical_bytes_total{job_name="demo",rank="1"}' in metrics

    result = {
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "steps": STEPS,
        "mini_batches": total,
        "killed": store,
        "lost_groups": len(lost_groups),
        "lost_reason": lost_reason,
        "withdrawn_mini_batches": sorted(int(x) for found in withdrew for x in found.split(",")),
        "node_timeout_s": float(stack.env["KNITTRANS_NODE_TIMEOUT_S"]),
        "heartbeat_s": float(stack.env["KNITTRANS_NODE_TIMEOUT_S"]) / HEARTBEATS_PER_TIMEOUT,
        "refused_answers": stack.refused,
    }
    (_artifacts() / "compose_run.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\ncompose run: " + json.dumps(result))
