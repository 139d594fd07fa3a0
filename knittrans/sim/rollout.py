"""Simulated rollout engines: calls of groups, weight loads, the versions groups used (docs/how-to/simulator.md)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from knittrans.sim.model import VersionTimeline
from knittrans.sim.workload import Workload

__all__ = ["CallGroup", "RolloutPool"]

_IDLE, _WAIT, _LOAD, _GEN = range(4)


@dataclass(slots=True)
class CallGroup:
    """One group of a call: what the workload drew for it, and the versions it was generated with."""

    group_id: str
    source: str
    duration: float
    """Seconds of generation it needs (loads not included)."""
    tokens: tuple[int, ...]
    version_start: int = 0
    version_end: int = 0
    version_weighted: float = 0.0


@dataclass(slots=True)
class _Slot:
    index: int
    version: int = 0
    """Weights loaded in this slot (only tracked when loads take time)."""
    phase: int = _IDLE
    since: float = 0.0
    """When the current phase began."""
    token: int = 0
    """Bumped whenever the slot's pending event is replaced; older events are ignored."""
    call: list[CallGroup] = field(default_factory=list)
    pos: int = 0
    """Index in ``call`` of the group being generated."""
    target: int = 0
    """Version being waited for or loaded."""
    reload: bool = False
    """A newer version arrived during the load: load again when it ends (in-flight updates)."""
    left: float = 0.0
    """Generation seconds the current group still needs."""
    segments: list[tuple[int, float]] = field(default_factory=list)
    """(version, seconds generated with it) of the current group, when loads take time."""


class RolloutPool:
    """All rollout slots of one simulated run; the engine owns the clock and the event heap.

    ``push(t, payload)`` schedules :meth:`on_slot` with ``payload`` at ``t``. The engine calls
    :meth:`on_arrive` when a version reaches rollout, only while :attr:`switches_in_flight` (running groups
    switch weights in flight and loads take time).
    """

    def __init__(self, workload: Workload, timeline: VersionTimeline, push: Callable[[float, object], None]) -> None:
        self.w = workload
        self.timeline = timeline
        self.push = push
        self.slots = [_Slot(index=i) for i in range(workload.rollout_slots)]
        self.idle: list[tuple[int, int]] = [(0, i) for i in range(workload.rollout_slots)]
        """Heap of ``(-loaded version, slot)``: a launch takes the idle slot with the newest weights."""
        self.busy_s = 0.0
        """Slot-seconds spent loading or generating."""
        self.loads = 0
        self.load_s_total = 0.0

    @property
    def idle_slots(self) -> int:
        """Slots without a call."""
        return len(self.idle)

    @property
    def timed_loads(self) -> bool:
        """Whether slots track their weights (a load takes time)."""
        return self.w.load_s > 0

    @property
    def switches_in_flight(self) -> bool:
        """Whether running groups stop to load weights that arrive (in-flight updates with timed loads)."""
        return self.w.in_flight_updates and self.timed_loads

    def launch(self, call: list[CallGroup], now: float) -> None:
        """Start ``call`` on the idle slot holding the newest weights."""
        _, index = heapq.heappop(self.idle)
        slot = self.slots[index]
        slot.call, slot.pos = call, 0
        self._begin_group(slot, now)

    # ------------------------------------------------------------------ phases
    def _schedule(self, slot: _Slot, phase: int, now: float, until: float) -> None:
        slot.phase, slot.since = phase, now
        slot.token += 1
        self.push(until, (slot.index, slot.token))

    def _begin_group(self, slot: _Slot, now: float) -> None:
        """Choose the weights the next group of the call starts with; wait for them or load them first."""
        t = self.timeline
        slot.left, slot.segments = slot.call[slot.pos].duration, []
        if self.w.launch_weights == "published":
            slot.target = t.latest
            if t.available_at[slot.target] > now:  # still on its way to rollout
                self._schedule(slot, _WAIT, now, t.available_at[slot.target])
                return
        else:
            slot.target = t.version_at(now)
        self._load_or_generate(slot, now)

    def _load_or_generate(self, slot: _Slot, now: float) -> None:
        if self.timed_loads and slot.version < slot.target:
            slot.reload = False
            self._schedule(slot, _LOAD, now, now + self.w.load_s)
            return
        slot.version = max(slot.version, slot.target)
        self._schedule(slot, _GEN, now, now + slot.left)

    def on_arrive(self, version: int, now: float) -> None:
        """Version ``version`` reached rollout: running groups stop to load it (in-flight updates, timed loads)."""
        for slot in self.slots:
            if slot.phase == _LOAD:
                slot.reload = slot.reload or version > slot.target
            elif slot.phase == _GEN and slot.version < version and slot.since + slot.left > now:
                self._close_segment(slot, now)
                slot.target = version
                slot.reload = False
                self._schedule(slot, _LOAD, now, now + self.w.load_s)

    def _close_segment(self, slot: _Slot, now: float) -> None:
        """Account the generation since the phase began (the slot stops or the group ends)."""
        ran = now - slot.since
        self.busy_s += ran
        slot.left = max(0.0, slot.left - ran)
        if self.timed_loads:
            slot.segments.append((slot.version, ran))

    def on_slot(self, payload: tuple[int, int], now: float) -> list[CallGroup] | None:
        """A slot's phase ended; returns the call's groups when the call is done (the slot is idle again)."""
        index, token = payload
        slot = self.slots[index]
        if token != slot.token:
            return None  # replaced by an in-flight load
        if slot.phase == _WAIT:
            self._load_or_generate(slot, now)
            return None
        if slot.phase == _LOAD:
            ran = now - slot.since
            self.busy_s += ran
            self.loads += 1
            self.load_s_total += ran
            slot.version = slot.target
            if slot.reload and self.timeline.version_at(now) > slot.version:  # set by on_arrive (in-flight updates)
                slot.target = self.timeline.version_at(now)
            self._load_or_generate(slot, now)
            return None
        group = slot.call[slot.pos]
        started = slot.since  # untimed loads: one generation phase per group
        self._close_segment(slot, now)
        self._tag(slot, group, started, now)
        slot.pos += 1
        if slot.pos < len(slot.call):
            self._begin_group(slot, now)
            return None
        done, slot.call = slot.call, []
        slot.phase = _IDLE
        heapq.heappush(self.idle, (-slot.version, slot.index))
        return done

    def _tag(self, slot: _Slot, group: CallGroup, started: float, now: float) -> None:
        """The versions that produced the group's tokens (untimed loads: the weights in force at rollout, read
        from the timeline; timed loads: the slot's segments)."""
        if not self.timed_loads:
            if self.w.in_flight_updates:
                v0, v1, vw = self.timeline.span(started, now)
            else:
                v0 = self.timeline.version_at(started)
                v1, vw = v0, float(v0)
            group.version_start, group.version_end, group.version_weighted = v0, v1, vw
            return
        made = [(v, s) for v, s in slot.segments if s > 0] or slot.segments[:1]
        total = sum(s for _, s in made)
        group.version_start = made[0][0]
        group.version_end = max(v for v, _ in made)
        group.version_weighted = sum(v * s for v, s in made) / total if total > 0 else float(made[0][0])

    def busy_at_end(self, now: float) -> float:
        """Slot-seconds of loads and generation still in progress at the end of the run."""
        return sum(now - s.since for s in self.slots if s.phase in (_LOAD, _GEN))
