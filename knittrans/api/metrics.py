"""Prometheus metrics of one control-plane instance: a registry per app, read from the service on scrape."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from knittrans.api.observe import Observations
from knittrans.api.service import ControlPlane
from knittrans.lifecycle import JOB_STATES
from knittrans.sched.staleness import READINGS

__all__ = ["METRICS", "ServiceCollector", "make_registry"]

_JOB = ("job_name",)
_RANK = ("job_name", "rank")
_WORKER = ("job_name", "worker")
_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "knittrans_nodes": ("gauge", "Store nodes by state", ("state",)),
    "knittrans_node_up": ("gauge", "1 while the store node is alive, 0 once lost", ("node",)),
    "knittrans_node_heartbeat_age_seconds": ("gauge", "Seconds since the node's last heartbeat", ("node",)),
    "knittrans_store_units": ("gauge", "Sealed units held by the store node", ("node",)),
    "knittrans_store_bytes": ("gauge", "Bytes of sealed units on the store node by place", ("node", "place")),
    "knittrans_store_budget_bytes": ("gauge", "The store node's memory budget", ("node",)),
    "knittrans_store_budget_used_bytes": ("gauge", "Budget bytes in use (sealed and pending)", ("node",)),
    "knittrans_units_registered": ("counter", "Units registered since start", ()),
    "knittrans_job_state": ("gauge", "1 for the job's lifecycle state, 0 for the others", ("job_name", "state")),
    "knittrans_quota_fill_ratio": ("gauge", "a[s]/q[s] in the current step", ("job_name", "source")),
    "knittrans_groups": ("gauge", "Groups by status and source", ("job_name", "source", "status")),
    "knittrans_pending_groups": ("gauge", "P[s]: started, not finished", ("job_name", "source")),
    "knittrans_groups_to_regenerate": (
        "gauge",
        "Lost or expired groups not yet claimed by a rollout worker for regeneration",
        _JOB,
    ),
    "knittrans_policy_version": ("gauge", "Latest reported policy version", _JOB),
    "knittrans_next_global_index": ("gauge", "Mini-batches admitted so far", _JOB),
    "knittrans_in_flight_mini_batches": ("gauge", "Admitted, not yet consumed", _JOB),
    "knittrans_consumed_mini_batches": ("gauge", "Mini-batches every rank acked", _JOB),
    "knittrans_last_admission_seconds": ("gauge", "Policy + assignment time of the last admitted mini-batch", _JOB),
    "knittrans_last_admission_wait_seconds": (
        "gauge",
        "How long the last admitted mini-batch waited for its groups",
        _JOB,
    ),
    "knittrans_staleness_versions": (
        "gauge",
        "Staleness of consumed trajectories in policy versions (job lifetime)",
        ("job_name", "source", "reading", "kind", "stat"),
    ),
    "knittrans_rank_mini_batches": ("counter", "Mini-batches the rank acked with transfer figures", _RANK),
    "knittrans_rank_exposed_transfer_seconds": (
        "counter",
        "Seconds the rank's training loop blocked waiting for rows (transfer not hidden by compute)",
        _RANK,
    ),
    "knittrans_rank_fetch_seconds": (
        "counter",
        "Seconds the rank spent fetching rows and media (overlapped with compute where prefetch works)",
        _RANK,
    ),
    "knittrans_rank_logical_bytes": (
        "counter",
        "Row bytes plus media bytes as referenced by the rows (per-trajectory copies)",
        _RANK,
    ),
    "knittrans_rank_physical_bytes": (
        "counter",
        "Row bytes plus media bytes actually fetched (each content hash once)",
        _RANK,
    ),
    "knittrans_rollout_weights_version": ("gauge", "Policy version the rollout worker generates with", _WORKER),
    "knittrans_rollout_weight_loads": ("counter", "Weights files the worker loaded", _WORKER),
    "knittrans_rollout_weights_late": (
        "counter",
        "Versions whose weights file was not there within the worker's wait (it generated with older weights)",
        _WORKER,
    ),
    "knittrans_rollout_weights_wait_seconds": ("counter", "Seconds the worker waited for weights files", _WORKER),
}

METRICS: dict[str, str] = {name: kind for name, (kind, _, _) in _FAMILIES.items()}
"""Every metric family exported, by name as declared (counters are exposed with a ``_total`` suffix)."""


class ServiceCollector(Collector):
    """Turns the service state into gauges and counters at scrape time (no state of its own)."""

    def __init__(self, service: ControlPlane, observed: Observations) -> None:
        self.service = service
        self.observed = observed

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        svc, observed = self.service, self.observed
        now = time.time()
        f: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name, (kind, text, labels) in _FAMILIES.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            f[name] = family(name, text, labels=list(labels))
        alive = sum(1 for n in svc.nodes.values() if not n.lost)
        f["knittrans_nodes"].add_metric(["alive"], alive)
        f["knittrans_nodes"].add_metric(["lost"], len(svc.nodes) - alive)
        for n in sorted(svc.nodes.values(), key=lambda n: n.node_id):
            f["knittrans_node_up"].add_metric([n.node_id], 0 if n.lost else 1)
            f["knittrans_node_heartbeat_age_seconds"].add_metric([n.node_id], max(0.0, now - n.last_heartbeat))
        for node_id, usage in sorted(observed.stores.items()):
            f["knittrans_store_units"].add_metric([node_id], usage["units"])
            f["knittrans_store_bytes"].add_metric([node_id, "memory"], usage["bytes_in_memory"])
            f["knittrans_store_bytes"].add_metric([node_id, "spill"], usage["bytes_spilled"])
            if usage["budget_bytes"] is not None:
                f["knittrans_store_budget_bytes"].add_metric([node_id], usage["budget_bytes"])
            f["knittrans_store_budget_used_bytes"].add_metric([node_id], usage["budget_used"])
        f["knittrans_units_registered"].add_metric([], svc.units_registered)
        for job in svc.jobs.values():
            one = [job.name]
            step = job.next_n // job.K
            for st in JOB_STATES:
                f["knittrans_job_state"].add_metric([job.name, st], 1 if job.state == st else 0)
            admitted = job.admitted_in_step(step)
            for s, quota in job.quotas_for_step(step).items():
                f["knittrans_quota_fill_ratio"].add_metric([job.name, s], admitted.get(s, 0) / quota if quota else 1.0)
            for (s, status), c in sorted(job.group_counts.items()):
                if c:
                    f["knittrans_groups"].add_metric([job.name, s, status], c)
            for s, p in job.pending().items():
                f["knittrans_pending_groups"].add_metric([job.name, s], p)
            f["knittrans_groups_to_regenerate"].add_metric(one, len(job.to_regenerate))
            f["knittrans_policy_version"].add_metric(one, job.version)
            f["knittrans_next_global_index"].add_metric(one, job.next_n)
            f["knittrans_in_flight_mini_batches"].add_metric(one, len(job.in_flight()))
            f["knittrans_consumed_mini_batches"].add_metric(one, job.position)
            if job.admissions:
                f["knittrans_last_admission_seconds"].add_metric(one, job.admissions[-1]["seconds"])
                f["knittrans_last_admission_wait_seconds"].add_metric(one, job.admissions[-1].get("wait_s") or 0.0)
            for reading in READINGS:
                report = job.consumed.report(reading)
                for source, part in [("all", report), *report["by_source"].items()]:
                    for kind in ("staleness", "architectural"):
                        stats = part[kind].to_dict()
                        for stat in ("mean", "p50", "p99", "max", "pos_mean") if stats["count"] else ():
                            key = [job.name, source, reading, kind, stat]
                            f["knittrans_staleness_versions"].add_metric(key, float(stats[stat]))
        for job_name, table in sorted(list(observed.transfers.items())):
            for rank, t in table.entries().items():
                key = [job_name, str(rank)]
                f["knittrans_rank_mini_batches"].add_metric(key, t["mini_batches"])
                f["knittrans_rank_exposed_transfer_seconds"].add_metric(key, t["exposed_s"])
                f["knittrans_rank_fetch_seconds"].add_metric(key, t["fetch_s"])
                f["knittrans_rank_logical_bytes"].add_metric(key, t["row_bytes"] + t["media_logical_bytes"])
                f["knittrans_rank_physical_bytes"].add_metric(key, t["row_bytes"] + t["media_physical_bytes"])
        for (job_name, worker), r in sorted(list(observed.rollout.items())):
            key = [job_name, worker]
            f["knittrans_rollout_weights_version"].add_metric(key, r["version"])
            f["knittrans_rollout_weight_loads"].add_metric(key, r["loads"])
            f["knittrans_rollout_weights_late"].add_metric(key, r["late"])
            f["knittrans_rollout_weights_wait_seconds"].add_metric(key, r["wait_s"])
        yield from f.values()


def make_registry(service: ControlPlane, observed: Observations) -> CollectorRegistry:
    """A fresh registry holding only this service's collector (and ``observed``: store usage, rank transfer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service, observed))
    return registry
