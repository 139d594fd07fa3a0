"""rollout."""
