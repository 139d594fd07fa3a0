"""Scheduling core (pure code, no I/O): admission policies and timing, rank assignment, staleness accounting."""
