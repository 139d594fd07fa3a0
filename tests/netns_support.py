"""Network namespaces for multi-host tests: hosts on a private /24 behind a bridge in a "switch" namespace.

Nothing is created in the root namespace: every veth pair is created with one end already in its
host namespace (``eth0``) and the other in the switch namespace, where a bridge joins them; the
host's own interfaces, routes and firewall are never touched. Names carry a per-run prefix
(``kttest-<pid>-``); :func:`clean_leftovers` removes namespaces of earlier crashed runs.

Run as a script inside a namespace, the module is a *probe*: it reads JSON requests from stdin
and answers with JSON lines, so the test (in the root namespace, which has no route to the
hosts) can call the control plane and the store nodes from inside their network::

    ip netns exec NS python tests/netns_support.py probe
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "kttest-"
"""Every namespace this module creates starts with this."""
SUBNET = "10.213.0"
"""Private /24 used only inside the namespaces."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise with its stderr on failure when ``check``."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def our_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix``."""
    out = ip("netns", "list").stdout.split("\n")
    return [line.split()[0] for line in out if line.strip() and line.split()[0].startswith(prefix)]


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process left running inside ``ns`` (only ours: they live in our namespace)."""
    pids = ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


def _owner_alive(ns: str) -> bool:
    """Whether the process that made ``ns`` (``kttest-<pid>-...``) still runs: its lab is in use."""
    pid = ns[len(PREFIX) :].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces (and with them their veths and bridge) of earlier runs whose process is gone
    (another run's lab, still in use, is left alone); returns their names."""
    found = [ns for ns in our_namespaces(prefix) if prefix != PREFIX or not _owner_alive(ns)]
    for ns in found:
        kill_namespace_processes(ns)
        ip("netns", "del", ns, check=False)
    return found


@dataclass
class Lab:
    """A switch namespace with a bridge and host namespaces plugged into it."""

    run_prefix: str
    """Prefix of this run's namespace names (``kttest-<pid>-``)."""
    hosts: dict[str, str] = field(default_factory=dict)
    """Host name -> its address on the private /24."""

    @property
    def switch(self) -> str:
        return f"{self.run_prefix}sw"

    def ns(self, host: str) -> str:
        """Namespace name of ``host``."""
        return f"{self.run_prefix}{host}"

    def exec_prefix(self, host: str) -> list[str]:
        """Command prefix running a process inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)]

    def create_switch(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, host: str, octet: int) -> str:
        """A namespace with ``eth0`` at ``SUBNET.octet/24`` wired to the bridge; returns the address."""
        ns, port = self.ns(host), f"p{octet}"
        address = f"{SUBNET}.{octet}"
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[host] = address
        return address

    def cut(self, host: str) -> None:
        """Take ``host``'s link down on both ends (its processes keep running, unreachable)."""
        ip("-n", self.ns(host), "link", "set", "eth0", "down")
        ip("-n", self.switch, "link", "set", f"p{self.hosts[host].rsplit('.', 1)[1]}", "down")

    def destroy(self) -> None:
        """Kill what runs inside, delete every namespace of this run (veths and bridge go with them)."""
        clean_leftovers(self.run_prefix)


@contextmanager
def lab(hosts: Sequence[str]) -> Iterator[Lab]:
    """A lab with one namespace per host (addresses ``.1``, ``.2``, ...); removed on exit, also on error."""
    clean_leftovers()
    the_lab = Lab(run_prefix=f"{PREFIX}{os.getpid()}-")
    try:
        the_lab.create_switch()
        for i, host in enumerate(hosts, start=1):
            the_lab.add_host(host, i)
        yield the_lab
    finally:
        the_lab.destroy()


class Probe:
    """A probe process inside one namespace: calls the control plane or a store node on the test's behalf."""

    def __init__(self, the_lab: Lab, host: str, *, token: str | None = None) -> None:
        self.token = token
        """Token used when a call names none."""
        self.proc = subprocess.Popen(
            [*the_lab.exec_prefix(host), sys.executable, "-u", str(Path(__file__).resolve()), "probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def call(self, target: str, method: str, *args: Any, token: str | None = None, **kwargs: Any) -> Any:
        """``ControlClient(target).method(*args)`` (``http`` targets) or ``StoreClient(target).method`` (``grpc``)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"target": target, "method": method, "args": args, "kwargs": kwargs, "token": token or self.token}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"probe died (exit {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{method}{tuple(args)} on {target}: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a write buffer to a dead probe cannot be flushed
                    pipe.close()


def _serve_probe() -> None:
    from knittrans.controlclient import ControlClient
    from knittrans.flight.client import StoreClient
    from knittrans.manifest import Manifest

    clients: dict[tuple[str, str | None], Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        key = (request["target"], request["token"])
        try:
            client = clients.get(key)
            if client is None:
                if key[0].startswith("http"):
                    client = ControlClient(key[0], token=key[1], retries=2, timeout_s=5)
                else:
                    client = StoreClient(key[0], token=key[1], timeout_s=5)
                clients[key] = client
            result = getattr(client, request["method"])(*request["args"], **request["kwargs"])
            if isinstance(result, tuple) and result and isinstance(result[0], Manifest):
                result = json.loads(result[0].encode())  # (manifest, etag) of ControlClient.manifest
            reply: dict[str, Any] = {"result": result}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["probe"]:
    _serve_probe()
