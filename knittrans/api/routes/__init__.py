"""One router per resource: jobs, nodes, units (and supply), mini-batches, tokens, the dashboard, health."""
