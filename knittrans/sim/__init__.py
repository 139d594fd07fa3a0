"""Discrete-event staleness simulator driving the real ``knittrans.sched`` admission and assignment."""

from knittrans.sim.engine import MiniBatchRecord, RunTrace, SimulationStalled, simulate
from knittrans.sim.metrics import RunMetrics, compute_metrics
from knittrans.sim.workload import SourceProfile, Workload, bundled_workloads, load_workload

__all__ = [
    "MiniBatchRecord",
    "RunMetrics",
    "RunTrace",
    "SimulationStalled",
    "SourceProfile",
    "Workload",
    "bundled_workloads",
    "compute_metrics",
    "load_workload",
    "simulate",
]
