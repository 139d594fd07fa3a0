"""Collectives for ``scale.py``'s simulated trainer: the ``Collective`` of ``knittrans.trainer.feed``.

:class:`VirtualGroup` stands for a trainer of ``size`` ranks of which only rank 0 runs here: a
broadcast hands rank 0 its own value (the others would get it over the trainer's gloo group, which
``gloo_broadcast.py`` measures with real processes), and a gather returns rank 0's item once per rank
(every rank reports what rank 0 does). What the control plane sees is then exactly what a trainer of
``size`` ranks sends it with the client's default (one manifest request, one ``fetched`` and one
``ack`` per mini-batch). A thousand rank threads would instead measure this process's GIL: on two cores
their lock hand-offs alone took longer than the 120 ms training step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["VirtualGroup"]


class VirtualGroup:
    """Rank 0 of a trainer of ``size`` ranks (the only member that runs)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size
        self.last: Any = None
        """The last value broadcast (what every rank would hold)."""

    def broadcast(self, item: Any) -> Any:
        self.last = item
        return item

    def gather(self, item: Any) -> list[Any] | None:
        return [item] * self.size
