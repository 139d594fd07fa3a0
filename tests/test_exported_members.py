"""The public API: every name in knittrans.__all__ resolves, and the documented names are exported."""

from __future__ import annotations

import subprocess
import sys

import knittrans

DOCUMENTED = {
    "TrajectoryWriter",
    "TrainerClient",
    "TrainerConfig",
    "ControlClient",
    "StoreServer",
    "StoreServerConfig",
    "UnitStore",
    "StoreConfig",
    "Ticket",
    "UnitDescriptor",
    "TrajectoryGroup",
    "Media",
    "DedupEncoder",
    "MediaCache",
    "make_policy",
    "assign_mini_batch",
    "create_app",
    "Fetcher",
    "to_micro_batch",
}


def test_every_export_resolves() -> None:
    """each name in __all__ is importable from the top-level package and is what its module defines."""
    for name in knittrans.__all__:
        value = getattr(knittrans, name)
        assert value is not None, name


def test_documented_names_are_exported() -> None:
    """the names the README and docs use are part of __all__."""
    assert set(knittrans.__all__) >= DOCUMENTED


def test_import_is_light() -> None:
    """`import knittrans` and the CLI module do not import torch or pyarrow (lazy exports)."""
    code = "import sys, knittrans, knittrans.cli; print('torch' in sys.modules, 'pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def test_all_matches_the_lazy_table() -> None:
    """__all__ lists exactly the lazily exported names (plus __version__), and dir() shows them before first use."""
    assert set(knittrans.__all__) == {"__version__", *knittrans._EXPORTS}
    assert dir(knittrans) == sorted(knittrans.__all__)
