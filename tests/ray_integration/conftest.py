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


if HAVE_RAY:
    import threading
    import time
    from collections.abc import Iterator

    import pytest

    def _named(thread: threading.Thread) -> str:
        target = getattr(thread, "_target", None)  # what it runs: "Thread-2" alone names nothing
        where = f"{target.__module__}.{target.__qualname__}" if callable(target) else type(thread).__qualname__
        return f"{thread.name} ({where})"

    def _ours_to_stop(thread: threading.Thread) -> bool:
        # pyzmq's zero-copy garbage collector thread is pyzmq's own, stopped by pyzmq's atexit hook
        return (
            thread is not threading.main_thread()
            and thread.is_alive()
            and type(thread).__qualname__ != "GarbageCollectorThread"
        )

    @pytest.fixture(scope="session", autouse=True)
    def no_threads_left_at_exit() -> Iterator[None]:
        """After the last test, only the main thread may be left (5 s of grace for threads that are ending).

        A TransferQueue client nobody closed keeps an event-loop thread and its storage manager's notify
        thread, with live ZMQ sockets, until the interpreter's finalization; CI saw that end in a
        segmentation fault once, after every test had passed. This names such a leak instead.
        """
        yield
        deadline = time.monotonic() + 5.0
        for thread in [t for t in threading.enumerate() if _ours_to_stop(t)]:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [_named(t) for t in threading.enumerate() if _ours_to_stop(t)]
        assert not left, f"threads still running after the Ray tests: {left}"
