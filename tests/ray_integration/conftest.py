"""Ray tests run only where Ray is installed (CI: the bench venv).

``.venv-bench/bin/python -m pytest tests/ray_integration``

In the main venv (no Ray) these modules are not collected at all, and the header says so; this
is not a skip: the bench-venv CI step runs them and they fail there if anything is wrong.
"""

from __future__ import annotations

import importlib.util

_SPEC = importlib.util.find_spec("ray")
HAVE_RAY = _SPEC is not None and _SPEC.origin is not None  # not a namespace package of the same name

collect_ignore_glob = [] if HAVE_RAY else ["test_*.py"]


def pytest_report_header() -> str:
    if HAVE_RAY:
        return "tests/ray_integration: Ray found, Ray integration tests collected"
    return (
        "tests/ray_integration: Ray not installed here, not collected "
        "(run them with .venv-bench/bin/python -m pytest tests/ray_integration)"
    )
