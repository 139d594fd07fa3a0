"""Child processes for the demo, benchmarks and tests: start, wait until ready, stop them all cleanly."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

__all__ = [
    "ProcessGroup",
    "control_plane_args",
    "free_port",
    "knittrans_command",
    "stop_process",
    "token_env",
    "wait_ready",
    "wait_until",
]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def knittrans_command(*args: str) -> list[str]:
    """``python -m knittrans.cli ARGS`` with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "knittrans.cli", *args]


def token_env(**tokens: str | None) -> dict[str, str]:
    """``KNITTRANS_WORKER_TOKEN`` etc. from ``worker_token=...`` (None or empty: left out): a child's tokens
    go in its environment, never on its command line (``/proc/<pid>/cmdline`` is readable by every user)."""
    return {f"KNITTRANS_{k.upper()}": v for k, v in tokens.items() if v}


def control_plane_args(
    db: str | Path,
    *,
    port: int = 0,
    host: str | None = None,
    ready_file: str | Path | None = None,
    node_timeout_s: float | None = None,
    log_level: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The arguments of ``knittrans control-plane`` on ``db`` (for :func:`knittrans_command`).

    ``port`` 0 binds a free port, reported in ``ready_file`` (``{url, host, port, pid}``);
    ``host``/``node_timeout_s``: the server's defaults when None; ``log_level``: the CLI's global
    ``--log-level``; ``extra``: further ``control-plane`` flags (tokens, TLS, ``--http``). Tokens are
    better passed in the environment (``KNITTRANS_WORKER_TOKEN``...): a command line is readable by
    every user of the host.
    """
    args = ["--log-level", log_level] if log_level else []
    args += ["control-plane", "--db", str(db), "--port", str(port)]
    if host is not None:
        args += ["--host", host]
    if ready_file is not None:
        args += ["--ready-file", str(ready_file)]
    if node_timeout_s is not None:
        args += ["--node-timeout-s", f"{node_timeout_s:g}"]
    return [*args, *extra]


def wait_until(check: Callable[[], bool], *, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Call ``check`` until it returns True; raise TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            if check():
                return
        except Exception as exc:  # the thing may not be up yet; report the last error on timeout
            last = exc
        else:
            last = None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s" + (f": {last}" if last else ""))
        time.sleep(interval_s)


def wait_ready(
    proc: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    output: Callable[[], str] = lambda: "",
) -> None:
    """Wait until ``ready()`` is true while ``proc`` runs (``ready`` may raise while the child starts).

    Raises RuntimeError naming ``what``, its exit code and ``output()`` (e.g. its log tail) when the child
    exits first, TimeoutError after ``timeout_s``.
    """

    def exited_or_ready() -> bool:
        return proc.poll() is not None or ready()

    try:
        wait_until(exited_or_ready, timeout_s=timeout_s, what=what)
    except TimeoutError:
        if proc.poll() is None:
            raise
    if proc.returncode is not None:  # set only by a poll that found it exited
        raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready:\n{output()}")


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float, send: Callable[[int, int], None]) -> None:
    """``send(pid, SIGTERM)`` to each live one of ``procs``, wait up to ``grace_s`` in all, then
    ``send(pid, SIGKILL)`` to the rest and reap them."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            send(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                send(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def stop_process(proc: subprocess.Popen[bytes], *, grace_s: float = 10.0) -> int | None:
    """SIGTERM ``proc``, SIGKILL after ``grace_s``, close its pipes; its exit code."""
    _stop([proc], grace_s, os.kill)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return proc.returncode


class ProcessGroup:
    """Children started in their own sessions, stopped together (SIGTERM, then SIGKILL) on exit.

    Each child's stdout and stderr go to ``<log_dir>/<name>.log``.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """Start ``prefix + argv`` as child ``name`` (``prefix`` e.g. ``ip netns exec NS``)."""
        if name in self.children and self.children[name].poll() is None:
            raise RuntimeError(f"child {name!r} is already running")
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            [*prefix, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        log.close()
        self.children[name] = proc
        logger.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        """Last lines of a child's log, for error messages."""
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self, *names: str) -> None:
        """Raise RuntimeError with the log tail if one of ``names`` (default: all) has exited non-zero."""
        for name in names or tuple(self.children):
            rc = self.children[name].poll()
            if rc is not None and rc != 0:
                raise RuntimeError(f"{name} exited with code {rc}:\n{self.log_tail(name)}")

    def kill(self, name: str) -> None:
        """SIGKILL child ``name``'s whole process group and reap it."""
        proc = self.children[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop_all(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to ``grace_s``, then SIGKILL the rest."""
        _stop(list(self.children.values()), grace_s, os.killpg)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()
