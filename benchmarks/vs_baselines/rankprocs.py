"""Consumer ranks as persistent subprocesses that take JSON-line commands on stdin (KnitTrans, local).

One process per rank, like the baselines' Ray actor processes: threads in one process would share
one GIL and one torch thread pool, which no real data-parallel trainer does.  Every process runs
with ``OMP_NUM_THREADS=1``, what Ray forces on its workers (so on both baselines' consumer actors);
without it torch's pool in a non-main thread oversubscribes the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from benchmarks.vs_baselines.workload import WorkloadSpec

__all__ = ["REPO", "RankProcesses", "rank_main", "read_config", "serve_commands"]

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


class RankProcesses:
    """``python -m <module> <role> --rank r`` for every rank; the first line each one reads is ``config``."""

    def __init__(self, module: str, role: str, ranks: int, config: dict[str, Any]) -> None:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
        )
        self.role = role
        self.procs: list[subprocess.Popen[str]] = []
        for r in range(ranks):
            proc = subprocess.Popen(
                [sys.executable, "-m", module, role, "--rank", str(r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env=env,
            )
            self.procs.append(proc)
            self._send(proc, config)
        self.receive()  # every rank answers "ready" once warmed up

    @staticmethod
    def _send(proc: subprocess.Popen[str], message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(message) + "\n")
        proc.stdin.flush()

    def send(self, message: dict[str, Any]) -> None:
        """The same command to every rank."""
        for proc in self.procs:
            self._send(proc, message)

    def receive(self) -> list[dict[str, Any]]:
        """One reply per rank, rank order; a rank that exited or reported an error raises."""
        replies = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.role} (pid {proc.pid}) exited with {proc.wait()}; see its stderr")
            reply: dict[str, Any] = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"{self.role} (pid {proc.pid}) failed: {reply['error']}")
            replies.append(reply)
        return replies

    def stop(self) -> None:
        """Ask every rank to exit; kill those still running after 30 s."""
        for proc in self.procs:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._send(proc, {"cmd": "stop"})
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):  # closed here, not by GC (a ResourceWarning)
                if pipe is not None:
                    with contextlib.suppress(BrokenPipeError, OSError):
                        pipe.close()
        self.procs = []


def read_config(inp: IO[str]) -> tuple[dict[str, Any], WorkloadSpec, int]:
    """A rank's first line: its config, the workload spec in it and the compute model's hidden size."""
    config: dict[str, Any] = json.loads(inp.readline())
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in config["spec"].items()}
    spec = WorkloadSpec(**fields)
    return config, spec, int(config["hidden"])


def serve_commands(inp: IO[str], out: IO[str], run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Say ready, then answer each command line with one JSON line until ``stop``.

    ``run(command)`` handles a ``run`` command; its exception is logged and answered as ``{"error": ...}``,
    which the driver turns into a failed run.
    """
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in inp:
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            break
        try:
            reply = run(cmd)
        except Exception as exc:
            logger.exception("consumer rank failed")
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def rank_main(
    role: str, description: str, serve: Callable[[int, IO[str], IO[str]], None], argv: list[str] | None = None
) -> int:
    """Entry point of a consumer rank process: ``<role> --rank r``, logging to stderr."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("role", choices=[role])
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format=f"%(asctime)s {role}[{args.rank}] %(name)s %(message)s"
    )
    serve(args.rank, sys.stdin, sys.stdout)
    return 0
