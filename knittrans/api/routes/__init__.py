"""One router per resource: jobs, nodes, units (and supply), ranks (plans, acks, versions), health."""

from __future__ import annotations

from knittrans.api.routes import health, jobs, nodes, ranks, units

__all__ = ["health", "jobs", "nodes", "ranks", "units"]
