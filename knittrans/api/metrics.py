"""Prometheus metrics of one control-plane instance: a registry per app, read from the service on scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from knittrans.api.service import ControlPlane
from knittrans.sched.staleness import READINGS, step_report

__all__ = ["ServiceCollector", "make_registry"]


class ServiceCollector(Collector):
    """Turns the service state into gauges and counters at scrape time (no state of its own)."""

    def __init__(self, service: ControlPlane) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        svc = self.service
        nodes = GaugeMetricFamily("knittrans_nodes", "Store nodes by state", labels=["state"])
        alive = sum(1 for n in svc.nodes.values() if not n.lost)
        nodes.add_metric(["alive"], alive)
        nodes.add_metric(["lost"], len(svc.nodes) - alive)
        yield nodes
        yield CounterMetricFamily("knittrans_units_registered", "Units registered since start",
                                  value=svc.units_registered)
        fill = GaugeMetricFamily("knittrans_quota_fill", "a[s]/q[s] in the current step", labels=["job", "source"])
        groups = GaugeMetricFamily("knittrans_groups", "Groups by status and source",
                                   labels=["job", "source", "status"])
        pending = GaugeMetricFamily("knittrans_pending_groups", "P[s]: started, not finished", labels=["job", "source"])
        version = GaugeMetricFamily("knittrans_policy_version", "Latest reported policy version", labels=["job"])
        planned = GaugeMetricFamily("knittrans_next_global_index", "Mini-batches admitted so far", labels=["job"])
        in_flight = GaugeMetricFamily("knittrans_in_flight_mini_batches", "Admitted, not yet consumed",
                                      labels=["job"])
        admit_s = GaugeMetricFamily("knittrans_last_admission_seconds", "Policy + assignment time of the "
                                    "last admitted mini-batch", labels=["job"])
        stale = GaugeMetricFamily("knittrans_staleness", "Staleness of consumed trajectories (job lifetime)",
                                  labels=["job", "source", "reading", "kind", "stat"])
        for job in svc.jobs.values():
            step = job.next_n // job.K
            q = job.quotas_for_step(step)
            a = job.admitted_in_step(step)
            for s, quota in q.items():
                fill.add_metric([job.name, s], a.get(s, 0) / quota if quota else 1.0)
            counts: dict[tuple[str, str], int] = {}
            for g in job.groups.values():
                key = (g.record.source, g.status)
                counts[key] = counts.get(key, 0) + 1
            for (s, st), c in sorted(counts.items()):
                groups.add_metric([job.name, s, st], c)
            for s, p in job.pending().items():
                pending.add_metric([job.name, s], p)
            version.add_metric([job.name], job.version)
            planned.add_metric([job.name], job.next_n)
            in_flight.add_metric([job.name], sum(1 for mb in job.minibatches.values() if mb.status == "planned"))
            if job.admissions:
                admit_s.add_metric([job.name], job.admissions[-1]["seconds"])
            for reading in READINGS:
                report = step_report(job.consumed, reading)
                scopes = [("all", report)] + [(s, r) for s, r in report["by_source"].items()]
                for source, part in scopes:
                    for kind in ("staleness", "architectural"):
                        stats = part[kind].to_dict()
                        if not stats["count"]:
                            continue
                        for stat in ("mean", "p50", "p99", "max", "pos_mean"):
                            stale.add_metric([job.name, source, reading, kind, stat], float(stats[stat]))
        yield from (fill, groups, pending, version, planned, in_flight, admit_s, stale)


def make_registry(service: ControlPlane) -> CollectorRegistry:
    """A fresh registry holding only this service's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    return registry
