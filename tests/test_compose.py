"""Structure of ``docker-compose.yml`` and ``Dockerfile`` (no Docker engine needed).

Every container command is parsed by the real ``knittrans`` argparse parsers after compose-style
variable substitution; the health probes are run for real against a store and a control plane
on loopback; wiring (endpoints, shared volumes, ranks), published ports, tmpfs and tokens are
checked against what the processes actually need.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from knittrans.cli import SUBCOMMANDS
from knittrans.procs import ProcessGroup, free_port, knittrans_command, wait_until

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
TOKENS = (
    "KNITTRANS_WORKER_TOKEN",
    "KNITTRANS_STORE_TOKEN",
    "KNITTRANS_ADMIN_TOKEN",
    "KNITTRANS_TICKET_KEY",
    "KNITTRANS_ROLLOUT_TOKEN",
    "KNITTRANS_RANK0_TOKEN",
    "KNITTRANS_RANK1_TOKEN",
    "KNITTRANS_NODE_TOKEN",
)
DUMMY_ENV = {name: f"dummy-{name.lower()}" for name in TOKENS}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


class MissingVariable(KeyError):
    """A ``${VAR:?message}`` variable is unset (compose refuses to start)."""


def substitute(text: str, env: Mapping[str, str]) -> str:
    """Compose interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``, ``${VAR:?e}``, ``${VAR?e}``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("plain"):
            return env.get(m.group("plain"), "")
        body = m.group("braced")
        op = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?(.*)$", body, re.S)
        assert op is not None, f"bad variable ${{{body}}}"
        name, kind, arg = op.group(1), op.group(2), op.group(3)
        value = env.get(name)
        empty = value is None or (kind is not None and kind.startswith(":") and value == "")
        if kind in (":?", "?") and empty:
            raise MissingVariable(f"{name}: {arg}")
        if kind in (":-", "-") and empty:
            return arg
        return value or ""

    return _VAR.sub(one, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Substitute every string of a parsed compose document."""
    if isinstance(node, str):
        return substitute(node, env)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def load(env: Mapping[str, str] = DUMMY_ENV) -> dict[str, Any]:
    """The compose file as compose would see it with ``env``."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env)  # type: ignore[no-any-return]


def parse_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """``knittrans SUB ARGS`` through the subcommand's real parser; fails the test on a parse error."""
    assert argv[0] == "knittrans", f"not a knittrans command: {argv}"
    sub = argv[1]
    assert sub in SUBCOMMANDS, f"{sub!r} is not a knittrans subcommand ({sorted(SUBCOMMANDS)})"
    parser = argparse.ArgumentParser(prog=f"knittrans {sub}")
    importlib.import_module(SUBCOMMANDS[sub][0]).add_arguments(parser)
    try:
        return sub, parser.parse_args(argv[2:])
    except SystemExit as exc:
        pytest.fail(f"`{' '.join(argv)}` does not parse (exit {exc.code}); see the argparse message above")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def commands(compose: dict[str, Any]) -> dict[str, tuple[str, argparse.Namespace]]:
    return {
        name: parse_command(list(svc["command"]))
        for name, svc in compose["services"].items()
        if svc["command"][0] == "knittrans"
    }


def by_kind(commands: dict[str, tuple[str, argparse.Namespace]], kind: str) -> dict[str, argparse.Namespace]:
    return {name: args for name, (sub, args) in commands.items() if sub == kind}


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> named volume (short syntax ``vol:/path[:ro]``)."""
    out = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        out[target] = source
    return out


def test_services_and_commands_parse(compose: dict[str, Any], commands: dict[str, Any]) -> None:
    """Control plane, two store+rollout nodes, two ranks exist; every command parses with the real CLI."""
    kinds = [sub for sub, _ in commands.values()]
    assert kinds.count("control-plane") == 1
    assert kinds.count("store") == 2 and kinds.count("rollout") == 2 and kinds.count("train") == 2
    others = [n for n, s in compose["services"].items() if s["command"][0] != "knittrans"]
    assert others == ["setup"], f"only the one-shot setup may run something other than knittrans: {others}"
    for svc in compose["services"].values():
        assert svc["image"] == "knittrans:dev" and svc["build"]["context"] == "."
        assert svc["build"]["args"]["BASE_IMAGE"] == "knittrans-base:bookworm"


def test_setup_script_is_valid(compose: dict[str, Any], commands: dict[str, Any]) -> None:
    """The setup one-shot compiles, imports names that exist, and creates a job spec the control plane accepts."""
    from knittrans.api.spec import JobSpec

    setup = compose["services"]["setup"]
    assert setup["command"][:2] == ["python", "-c"]
    tree = ast.parse(setup["command"][2])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("knittrans"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
    spec = JobSpec.from_dict(json.loads(setup["environment"]["KNITTRANS_JOB_SPEC"]))
    assert spec.world_size == len(by_kind(commands, "train"))
    for args in by_kind(commands, "rollout").values():
        assert args.job == spec.name and args.group_size == spec.group_size
        assert {s.split(":")[0] for s in args.source} == set(spec.quotas), "every worker can regenerate every source"
    assert "model:/models" in setup["volumes"]


def test_wiring_endpoints_volumes_ranks(compose: dict[str, Any], commands: dict[str, Any]) -> None:
    """Stores advertise their service name; workers write to their node's tmpfs dir; ranks share one gloo group."""
    services = compose["services"]
    ((cp_name, cp),) = by_kind(commands, "control-plane").items()
    control_url = f"http://{cp_name}:{cp.port}"
    assert cp.host == "0.0.0.0", "inside its container the control plane must listen beyond loopback"
    stores = by_kind(commands, "store")
    advertised = {}
    for name, args in stores.items():
        assert args.advertise == f"grpc://{name}:{args.port}" and args.host == "0.0.0.0"
        assert args.control_url == control_url
        advertised[args.node_id] = (name, args)
    assert len(advertised) == 2, "two distinct store nodes"
    for name, args in by_kind(commands, "rollout").items():
        store_name, store = advertised[args.node_id]
        assert args.store_endpoint == store.advertise and args.control_url == control_url
        assert args.store_dir == str(store.dir)
        assert mounts(services[name])[args.store_dir] == mounts(services[store_name])[str(store.dir)], (
            f"{name} must mount {store_name}'s tmpfs volume at the same path for direct writes"
        )
        assert mounts(services[name])["/weights"] == "weights"
    ranks = by_kind(commands, "train")
    assert sorted(a.rank for a in ranks.values()) == list(range(len(ranks)))
    assert {a.world_size for a in ranks.values()} == {len(ranks)}
    assert len({a.dist_url for a in ranks.values()}) == 1
    rank0 = next(n for n, a in ranks.items() if a.rank == 0)
    assert ranks[rank0].dist_url.startswith(f"tcp://{rank0}:")
    for name, args in ranks.items():
        assert args.control_url == control_url and args.local_dir == [], "ranks fetch over Flight, never mmap"
        assert services[name]["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert str(ranks[rank0].weights_dir) == "/weights" and mounts(services[rank0])["/weights"] == "weights"
    assert "weights:/weights" in services[rank0]["volumes"], "rank 0 writes the shared weights volume"
    assert "weights" in compose["volumes"] and "model" in compose["volumes"]


def test_only_control_plane_published_on_loopback(compose: dict[str, Any], commands: dict[str, Any]) -> None:
    """Nothing is published except the control plane's port, bound to 127.0.0.1 on the host."""
    ((cp_name, cp),) = by_kind(commands, "control-plane").items()
    for name, svc in compose["services"].items():
        ports = svc.get("ports", [])
        if name != cp_name:
            assert not ports, f"{name} publishes {ports}; only the control plane may"
            assert svc.get("network_mode") != "host"
            continue
        assert len(ports) == 1
        host_ip, host_port, container_port = str(ports[0]).split(":")
        assert host_ip == "127.0.0.1" and int(container_port) == cp.port and int(host_port) > 0
    raw = COMPOSE.read_text()
    assert "0.0.0.0:" not in raw, "no 0.0.0.0 host binding"


def _run_probe(test: list[str], port_from: int, port_to: int, env: Mapping[str, str]) -> int:
    assert test[0] == "CMD"
    argv = [sys.executable if a == "python" else a.replace(f":{port_from}", f":{port_to}") for a in test[1:]]
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, timeout=60).returncode


def test_store_health_probe_runs_against_real_store(
    compose: dict[str, Any], commands: dict[str, Any], start_server: Any
) -> None:
    """The store health check calls the Flight ``health`` action: passes on a live store, fails on a wrong token."""
    from knittrans.flight.server import StoreServer

    for name, args in by_kind(commands, "store").items():
        check = compose["services"][name]["healthcheck"]
        assert "health()" in check["test"][-1] and f"127.0.0.1:{args.port}" in check["test"][-1]
        assert check["retries"] >= 1 and check["interval"]
    assert "health" in {a for a, _ in StoreServer.list_actions(None, None)}  # type: ignore[arg-type]
    server = start_server(token="s3cret")
    test = compose["services"]["store-a"]["healthcheck"]["test"]
    env = {"KNITTRANS_FLIGHT_SCHEME": "grpc"}
    assert _run_probe(test, 8815, server.port, {**env, "KNITTRANS_STORE_TOKEN": "s3cret"}) == 0
    assert _run_probe(test, 8815, server.port, {**env, "KNITTRANS_STORE_TOKEN": "wrong"}) != 0
    assert _run_probe(test, 8815, free_port(), {**env, "KNITTRANS_STORE_TOKEN": "s3cret"}) != 0


def test_control_plane_health_probe_runs_against_real_server(
    compose: dict[str, Any], commands: dict[str, Any], tmp_path: Path
) -> None:
    """The control-plane health check GETs /v1/health (a real route) and passes against a real server."""
    from knittrans.api.routes.health import router

    ((cp_name, cp),) = by_kind(commands, "control-plane").items()
    test = compose["services"][cp_name]["healthcheck"]["test"]
    assert f"://127.0.0.1:{cp.port}/v1/health" in test[-1] and "KNITTRANS_CONTROL_SCHEME" in test[-1]
    assert "/v1/health" in {getattr(r, "path", None) for r in router.routes}
    port = free_port()
    env = {"KNITTRANS_CONTROL_SCHEME": "http", "KNITTRANS_TLS_CA": ""}
    assert _run_probe(test, cp.port, port, env) != 0, "the probe must fail when nothing listens"
    with ProcessGroup(tmp_path / "logs") as procs:
        procs.start("cp", knittrans_command("control-plane", "--db", str(tmp_path / "c.db"), "--port", str(port)))
        wait_until(lambda: _run_probe(test, cp.port, port, env) == 0, timeout_s=60, what="control-plane probe")


def test_depends_on_conditions(compose: dict[str, Any], commands: dict[str, Any]) -> None:
    """Stores wait for a healthy control plane, workers and ranks for healthy stores and a finished setup."""
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in CONDITIONS
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy but it has no check"
    kind = {n: sub for n, (sub, _) in commands.items()}
    for name, sub in kind.items():
        deps = services[name].get("depends_on", {})
        if sub == "store":
            assert deps["control-plane"]["condition"] == "service_healthy"
        if sub in ("rollout", "train"):
            assert deps["setup"]["condition"] == "service_completed_successfully"
            own = [d for d in deps if kind.get(d) == "store"]
            assert own and all(deps[d]["condition"] == "service_healthy" for d in own)
    assert services["setup"]["depends_on"]["control-plane"]["condition"] == "service_healthy"
    # no cycles
    seen: dict[str, int] = {}

    def visit(n: str) -> None:
        assert seen.get(n) != 1, f"depends_on cycle through {n}"
        if seen.get(n) == 2:
            return
        seen[n] = 1
        for d in services[n].get("depends_on", {}):
            visit(d)
        seen[n] = 2

    for n in services:
        visit(n)


def test_stores_on_sized_tmpfs(compose: dict[str, Any], commands: dict[str, Any]) -> None:
    """Every store directory is a size-limited tmpfs volume owned by the image's non-root user."""
    for name, args in by_kind(commands, "store").items():
        volume = mounts(compose["services"][name])[str(args.dir)]
        opts = compose["volumes"][volume]["driver_opts"]
        assert opts["type"] == "tmpfs" and opts["device"] == "tmpfs"
        o = dict(kv.split("=") for kv in opts["o"].split(","))
        assert re.fullmatch(r"\d+[kmg]?", o["size"]) and o["uid"] == "10001"
        assert args.budget_bytes is not None and args.budget_bytes < 2 << 30, "budget below the tmpfs size"


def test_tokens_come_from_environment(compose: dict[str, Any]) -> None:
    """Tokens are required environment variables (compose refuses to start without them), never literals."""
    for missing in TOKENS:
        env = {k: v for k, v in DUMMY_ENV.items() if k != missing}
        with pytest.raises(MissingVariable, match=missing):
            load(env)
    raw = yaml.safe_load(COMPOSE.read_text())
    # each process has its own scoped control-plane credential; only stores hold the ticket key
    own = {"store": "KNITTRANS_NODE_TOKEN", "rollout": "KNITTRANS_ROLLOUT_TOKEN"}
    for name, svc in compose["services"].items():
        sub = svc["command"][1] if svc["command"][0] == "knittrans" else None
        if sub in ("store", "rollout", "train"):
            env = svc["environment"]
            token = own.get(sub) or f"KNITTRANS_RANK{parse_command(list(svc['command']))[1].rank}_TOKEN"
            assert env["KNITTRANS_WORKER_TOKEN"] == DUMMY_ENV[token], (name, token)
            assert env["KNITTRANS_STORE_TOKEN"] == DUMMY_ENV["KNITTRANS_STORE_TOKEN"], name
            assert ("KNITTRANS_TICKET_KEY" in env) == (sub == "store"), name
            assert "--token" not in svc["command"] and "--store-token" not in svc["command"]
    cp = raw["services"]["control-plane"]
    assert "--worker-token" not in cp["command"] and "--admin-token" not in cp["command"], (
        "tokens on a command line show in `ps`; the control plane reads them from its environment"
    )
    assert cp["environment"]["KNITTRANS_WORKER_TOKEN"].startswith("${KNITTRANS_WORKER_TOKEN:?")
    assert cp["environment"]["KNITTRANS_ADMIN_TOKEN"].startswith("${KNITTRANS_ADMIN_TOKEN:?")
    assert cp["environment"]["KNITTRANS_TICKET_KEY"].startswith("${KNITTRANS_TICKET_KEY:?")
    assert "dummy-knittrans_admin_token" not in str(compose["services"]["store-a"])


def test_dockerfile() -> None:
    """Debian base made by the script, wheels from the wheelhouse (no network), deps before the package, non-root."""
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "ARG BASE_IMAGE=knittrans-base:bookworm"
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert froms == ["FROM ${BASE_IMAGE} AS deps", "FROM ${BASE_IMAGE}"]
    installs = [ln for ln in lines if "pip install" in ln]
    assert installs and all("--no-index" in ln for ln in installs), "the build installs from the wheelhouse only"
    deps_at = next(i for i, ln in enumerate(lines) if "-r /tmp/wheels/requirements.txt" in ln)
    package_at = next(i for i, ln in enumerate(lines) if "--no-deps" in ln and "pip install" in ln)
    assert deps_at < package_at
    assert lines.index("COPY --from=deps /opt/venv /opt/venv") < package_at
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignore and ".venv" in ignore and ".wheelhouse" not in ignore
    script = (ROOT / "scripts" / "compose_up.sh").read_text()
    assert "torch==2.13.0" in script and "debootstrap --variant=minbase" in script


def test_networks_have_own_subnets(compose: dict[str, Any]) -> None:
    """Two networks with explicit subnets; the backend is internal; only the control plane is on `admin`."""
    nets = compose["networks"]
    assert set(nets) == {"backend", "admin"}
    assert nets["backend"]["internal"] is True
    for net in nets.values():
        (cfg,) = net["ipam"]["config"]
        assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+/\d+", cfg["subnet"])
    assert nets["backend"]["ipam"]["config"][0]["subnet"] != nets["admin"]["ipam"]["config"][0]["subnet"]
    for name, svc in compose["services"].items():
        want = ["backend", "admin"] if name == "control-plane" else ["backend"]
        assert svc["networks"] == want, f"{name}: networks {svc['networks']}"


def test_tls_switches_by_environment() -> None:
    """KNITTRANS_CONTROL_SCHEME / KNITTRANS_FLIGHT_SCHEME change every URL and advertised endpoint."""
    tls = load(
        {
            **DUMMY_ENV,
            "KNITTRANS_CONTROL_SCHEME": "https",
            "KNITTRANS_FLIGHT_SCHEME": "grpc+tls",
            "KNITTRANS_TLS_CERT": "/etc/knittrans/tls/cert.pem",
        }
    )
    text = json.dumps(tls["services"])
    assert "http://control-plane" not in text and "grpc://store-" not in text
    assert "https://control-plane:8700" in text and "grpc+tls://store-a:8815" in text
    for name, svc in tls["services"].items():
        env = svc.get("environment", {})
        assert env.get("KNITTRANS_TLS_CERT") == "/etc/knittrans/tls/cert.pem", name
        assert any(v.endswith(":/etc/knittrans/tls:ro") for v in svc["volumes"]), name
