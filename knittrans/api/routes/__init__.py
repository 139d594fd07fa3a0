"""One router per resource: jobs, nodes, units (and supply), mini-batches (manifests, progress, versions), health."""

from __future__ import annotations

from knittrans.api.routes import health, jobs, minibatches, nodes, units

__all__ = ["health", "jobs", "minibatches", "nodes", "units"]
