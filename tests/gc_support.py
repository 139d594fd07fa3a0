"""Tests that objects are freed by reference counting: the cyclic GC off for a while, then the cycles left."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

OURS = ("knittrans", "httpx", "httpcore")
"""Modules whose objects a test asks to be free of reference cycles (ours and our HTTP client's)."""


@contextmanager
def cyclic_gc_off() -> Iterator[None]:
    """Collect what earlier code left, then run the block with the cyclic GC off (on again afterwards)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def assert_no_cycles_of_ours() -> None:
    """Fail, naming every type found, when unreachable objects of :data:`OURS` wait for the cyclic GC."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        cyclic = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not [t for t in cyclic if t.startswith(OURS)], cyclic
