"""Discrete-event staleness simulator driving the real ``knittrans.sched`` admission and assignment."""
