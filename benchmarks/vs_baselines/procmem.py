"""Sample the RSS of a process tree in a background thread and attribute each process to a role.

The driver child is the root; Ray's gcs_server, raylet (which hosts the plasma store), agents and
workers (TransferQueue controller/storage actors, consumer actors) all descend from it, as do the
KnitTrans store / control-plane / trainer subprocesses, so one tree walk finds them all.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil

__all__ = ["ROLE_PATTERNS", "TreeMemorySampler", "classify"]

# (substring of name or cmdline, role); first match wins.
ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("SimpleStorageUnit", "storage"),
    ("KnitTransStoreActor", "storage"),  # the TransferQueue backend's per-node store (knittrans.integrations)
    ("TransferQueueController", "controller"),
    ("TQConsumer", "consumer"),
    ("RayConsumer", "consumer"),
    ("ray::IDLE", "ray_idle_worker"),
    ("DashboardAgent", "ray_aux"),
    ("RuntimeEnvAgent", "ray_aux"),
    ("dashboard", "ray_aux"),
    ("log_monitor", "ray_aux"),
    ("monitor.py", "ray_aux"),
    (" store ", "storage"),
    ("control-plane", "controller"),
    ("knittrans_consumer", "consumer"),
    ("local_consumer", "consumer"),
    ("trainer", "consumer"),
)


def classify(proc: psutil.Process, root_pid: int) -> str:
    """Role of ``proc`` in the benchmark (``driver`` for the root)."""
    if proc.pid == root_pid:
        return "driver"
    try:
        name = proc.name()
        text = " ".join([name, *proc.cmdline()]) + " "
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    # Executables first: Ray workers carry "--raylet-name=..." in their command line.
    if name == "raylet":
        return "raylet+plasma"
    if name == "gcs_server":
        return "ray_gcs"
    for needle, role in ROLE_PATTERNS:
        if needle in text:
            return role
    return "other"


@dataclass
class TreeMemorySampler:
    """Polls ``root_pid`` and its descendants every ``interval_s`` until :meth:`stop`."""

    root_pid: int
    interval_s: float = 0.2
    peak_by_pid: dict[int, tuple[str, int]] = field(default_factory=dict)
    """pid -> (role, peak RSS bytes)."""
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(wall time, RSS summed per role) for every poll."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeMemorySampler:
        self._thread = threading.Thread(target=self._run, name="tree-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def sample_once(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        per_role: dict[str, int] = {}
        for proc in procs:
            try:
                rss = proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            # Re-classified every poll: a Ray worker turns from ray::IDLE into an actor.
            role = classify(proc, self.root_pid)
            per_role[role] = per_role.get(role, 0) + rss
            _, peak = self.peak_by_pid.get(proc.pid, (role, 0))
            self.peak_by_pid[proc.pid] = (role, max(peak, rss))
        self.samples.append((time.time(), per_role))

    def peak_per_role(self, start: float = 0.0, end: float = float("inf")) -> dict[str, int]:
        """Peak of the per-role RSS sum over samples in ``[start, end]`` (plus ``total``)."""
        peaks: dict[str, int] = {}
        for t, per_role in self.samples:
            if start <= t <= end:
                for role, rss in [*per_role.items(), ("total", sum(per_role.values()))]:
                    peaks[role] = max(peaks.get(role, 0), rss)
        return peaks
