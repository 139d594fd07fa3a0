"""Prometheus metrics of one control-plane instance: a registry per app, read from the service on scrape.

Names follow the Prometheus conventions: ``knittrans_`` prefix, base units in the name (``_seconds``,
``_bytes``, ``_ratio``, ``_versions``), ``_total`` on counters (added by the exposition), and labels
whose values can be summed or averaged meaningfully. The RL job is the label ``job_name``: ``job``
and ``instance`` belong to the scraper (Prometheus would rename a scraped ``job`` to ``exported_job``).
:data:`METRICS` lists every family exported; ``deploy/grafana/knittrans.json`` only uses these
(checked by ``tests/test_grafana.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from knittrans.api.observe import Observations
from knittrans.api.service import ControlPlane
from knittrans.lifecycle import JOB_STATES
from knittrans.sched.staleness import READINGS

__all__ = ["METRICS", "ServiceCollector", "make_registry"]

METRICS: dict[str, str] = {
    "knittrans_nodes": "gauge",
    "knittrans_node_up": "gauge",
    "knittrans_node_heartbeat_age_seconds": "gauge",
    "knittrans_store_units": "gauge",
    "knittrans_store_bytes": "gauge",
    "knittrans_store_budget_bytes": "gauge",
    "knittrans_store_budget_used_bytes": "gauge",
    "knittrans_units_registered": "counter",
    "knittrans_job_state": "gauge",
    "knittrans_quota_fill_ratio": "gauge",
    "knittrans_groups": "gauge",
    "knittrans_pending_groups": "gauge",
    "knittrans_groups_to_regenerate": "gauge",
    "knittrans_policy_version": "gauge",
    "knittrans_next_global_index": "gauge",
    "knittrans_in_flight_mini_batches": "gauge",
    "knittrans_consumed_mini_batches": "gauge",
    "knittrans_last_admission_seconds": "gauge",
    "knittrans_last_admission_wait_seconds": "gauge",
    "knittrans_staleness_versions": "gauge",
    "knittrans_rank_mini_batches": "counter",
    "knittrans_rank_exposed_transfer_seconds": "counter",
    "knittrans_rank_fetch_seconds": "counter",
    "knittrans_rank_logical_bytes": "counter",
    "knittrans_rank_physical_bytes": "counter",
    "knittrans_rollout_weights_version": "gauge",
    "knittrans_rollout_weight_loads": "counter",
    "knittrans_rollout_weights_late": "counter",
    "knittrans_rollout_weights_wait_seconds": "counter",
}
"""Every metric family exported, by name as declared (counters are exposed with a ``_total`` suffix)."""


class ServiceCollector(Collector):
    """Turns the service state into gauges and counters at scrape time (no state of its own)."""

    def __init__(self, service: ControlPlane, observed: Observations | None = None) -> None:
        self.service = service
        self.observed = observed or Observations()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        svc = self.service
        now = svc.clock()
        nodes = GaugeMetricFamily("knittrans_nodes", "Store nodes by state", labels=["state"])
        alive = sum(1 for n in svc.nodes.values() if not n.lost)
        nodes.add_metric(["alive"], alive)
        nodes.add_metric(["lost"], len(svc.nodes) - alive)
        yield nodes
        up = GaugeMetricFamily("knittrans_node_up", "1 while the store node is alive, 0 once lost", labels=["node"])
        age = GaugeMetricFamily(
            "knittrans_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat", labels=["node"]
        )
        for n in sorted(svc.nodes.values(), key=lambda n: n.node_id):
            up.add_metric([n.node_id], 0 if n.lost else 1)
            age.add_metric([n.node_id], max(0.0, now - n.last_heartbeat))
        yield from (up, age)
        units = GaugeMetricFamily("knittrans_store_units", "Sealed units held by the store node", labels=["node"])
        held = GaugeMetricFamily(
            "knittrans_store_bytes", "Bytes of sealed units on the store node by place", labels=["node", "place"]
        )
        budget = GaugeMetricFamily("knittrans_store_budget_bytes", "The store node's memory budget", labels=["node"])
        used = GaugeMetricFamily(
            "knittrans_store_budget_used_bytes", "Budget bytes in use (sealed and pending)", labels=["node"]
        )
        for node_id, usage in sorted(self.observed.stores.items()):
            units.add_metric([node_id], usage.units)
            held.add_metric([node_id, "memory"], usage.bytes_in_memory)
            held.add_metric([node_id, "spill"], usage.bytes_spilled)
            if usage.budget_bytes is not None:
                budget.add_metric([node_id], usage.budget_bytes)
            used.add_metric([node_id], usage.budget_used)
        yield from (units, held, budget, used)
        yield CounterMetricFamily(
            "knittrans_units_registered", "Units registered since start", value=svc.units_registered
        )
        state = GaugeMetricFamily(
            "knittrans_job_state", "1 for the job's lifecycle state, 0 for the others", labels=["job_name", "state"]
        )
        fill = GaugeMetricFamily(
            "knittrans_quota_fill_ratio", "a[s]/q[s] in the current step", labels=["job_name", "source"]
        )
        groups = GaugeMetricFamily(
            "knittrans_groups", "Groups by status and source", labels=["job_name", "source", "status"]
        )
        pending = GaugeMetricFamily(
            "knittrans_pending_groups", "P[s]: started, not finished", labels=["job_name", "source"]
        )
        version = GaugeMetricFamily("knittrans_policy_version", "Latest reported policy version", labels=["job_name"])
        planned = GaugeMetricFamily("knittrans_next_global_index", "Mini-batches admitted so far", labels=["job_name"])
        in_flight = GaugeMetricFamily(
            "knittrans_in_flight_mini_batches", "Admitted, not yet consumed", labels=["job_name"]
        )
        consumed = GaugeMetricFamily(
            "knittrans_consumed_mini_batches", "Mini-batches every rank acked", labels=["job_name"]
        )
        regenerate = GaugeMetricFamily(
            "knittrans_groups_to_regenerate",
            "Lost or expired groups not yet claimed by a rollout worker for regeneration",
            labels=["job_name"],
        )
        admit_s = GaugeMetricFamily(
            "knittrans_last_admission_seconds",
            "Policy + assignment time of the last admitted mini-batch",
            labels=["job_name"],
        )
        admit_wait = GaugeMetricFamily(
            "knittrans_last_admission_wait_seconds",
            "How long the last admitted mini-batch waited for its groups",
            labels=["job_name"],
        )
        stale = GaugeMetricFamily(
            "knittrans_staleness_versions",
            "Staleness of consumed trajectories in policy versions (job lifetime)",
            labels=["job_name", "source", "reading", "kind", "stat"],
        )
        for job in svc.jobs.values():
            step = job.next_n // job.K
            for st in JOB_STATES:
                state.add_metric([job.name, st], 1 if job.state == st else 0)
            q = job.quotas_for_step(step)
            a = job.admitted_in_step(step)
            for s, quota in q.items():
                fill.add_metric([job.name, s], a.get(s, 0) / quota if quota else 1.0)
            for (s, status), c in sorted(job.group_counts.items()):
                if c:
                    groups.add_metric([job.name, s, status], c)
            for s, p in job.pending().items():
                pending.add_metric([job.name, s], p)
            version.add_metric([job.name], job.version)
            planned.add_metric([job.name], job.next_n)
            in_flight.add_metric([job.name], len(job.in_flight()))
            consumed.add_metric([job.name], job.consumed_mini_batches)
            regenerate.add_metric([job.name], len(job.to_regenerate))
            if job.admissions:
                admit_s.add_metric([job.name], job.admissions[-1]["seconds"])
                admit_wait.add_metric([job.name], job.admissions[-1].get("wait_s") or 0.0)
            for reading in READINGS:
                report = job.consumed.report(reading)
                scopes = [("all", report)] + [(s, r) for s, r in report["by_source"].items()]
                for source, part in scopes:
                    for kind in ("staleness", "architectural"):
                        stats = part[kind].to_dict()
                        if not stats["count"]:
                            continue
                        for stat in ("mean", "p50", "p99", "max", "pos_mean"):
                            stale.add_metric([job.name, source, reading, kind, stat], float(stats[stat]))
        yield from (
            state,
            fill,
            groups,
            pending,
            regenerate,
            version,
            planned,
            in_flight,
            consumed,
            admit_s,
            admit_wait,
            stale,
        )
        yield from self._ranks()
        yield from self._rollout()

    def _ranks(self) -> Iterator[CounterMetricFamily]:
        labels = ["job_name", "rank"]
        mbs = CounterMetricFamily(
            "knittrans_rank_mini_batches", "Mini-batches the rank acked with transfer figures", labels=labels
        )
        exposed = CounterMetricFamily(
            "knittrans_rank_exposed_transfer_seconds",
            "Seconds the rank's training loop blocked waiting for rows (transfer not hidden by compute)",
            labels=labels,
        )
        fetch = CounterMetricFamily(
            "knittrans_rank_fetch_seconds",
            "Seconds the rank spent fetching rows and media (overlapped with compute where prefetch works)",
            labels=labels,
        )
        logical = CounterMetricFamily(
            "knittrans_rank_logical_bytes",
            "Row bytes plus media bytes as referenced by the rows (per-trajectory copies)",
            labels=labels,
        )
        physical = CounterMetricFamily(
            "knittrans_rank_physical_bytes",
            "Row bytes plus media bytes actually fetched (each content hash once)",
            labels=labels,
        )
        for (job, rank), t in sorted(self.observed.ranks.items()):
            key = [job, str(rank)]
            mbs.add_metric(key, t.mini_batches)
            exposed.add_metric(key, t.exposed_s)
            fetch.add_metric(key, t.fetch_s)
            logical.add_metric(key, t.row_bytes + t.media_logical_bytes)
            physical.add_metric(key, t.row_bytes + t.media_physical_bytes)
        yield from (mbs, exposed, fetch, logical, physical)

    def _rollout(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["job_name", "worker"]
        version = GaugeMetricFamily(
            "knittrans_rollout_weights_version", "Policy version the rollout worker generates with", labels=labels
        )
        loads = CounterMetricFamily("knittrans_rollout_weight_loads", "Weights files the worker loaded", labels=labels)
        late = CounterMetricFamily(
            "knittrans_rollout_weights_late",
            "Versions whose weights file was not there within the worker's wait (it generated with older weights)",
            labels=labels,
        )
        wait = CounterMetricFamily(
            "knittrans_rollout_weights_wait_seconds", "Seconds the worker waited for weights files", labels=labels
        )
        for (job, worker), r in sorted(list(self.observed.rollout.items())):
            key = [job, worker]
            version.add_metric(key, r.version)
            loads.add_metric(key, r.loads)
            late.add_metric(key, r.late)
            wait.add_metric(key, r.wait_s)
        yield from (version, loads, late, wait)


def make_registry(service: ControlPlane, observed: Observations | None = None) -> CollectorRegistry:
    """A fresh registry holding only this service's collector (with ``observed``: store usage, rank transfer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service, observed))
    return registry
