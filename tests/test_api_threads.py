"""The concurrency rule of the control plane: only the state thread touches the service's state.

The service and its ``JobState`` objects take no locks; that is sound because every route is
``async def`` and hands its work to the one :class:`StateRunner` thread. These tests fail when a
route is a plain ``def`` (FastAPI would run it in its thread pool) or when state is touched off the
state thread while the app runs.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api_support import job_spec
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from knittrans.api import Settings, create_app
from knittrans.api.routes.deps import Run, Service, StateRunner


def _api_routes(routes: Iterable[Any]) -> Iterator[APIRoute]:
    """Every API route, looking into included routers (FastAPI keeps them as one entry each)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None) or (route if hasattr(route, "routes") else None)
        if inner is not None:
            yield from _api_routes(inner.routes)


def test_every_route_is_async(tmp_path: Path) -> None:
    """No route of the app is a plain ``def`` (it would run in a thread pool, beside the state thread)."""
    app = create_app(Settings(db_path=str(tmp_path / "cp.db")))
    routes = list(_api_routes(app.routes))
    paths = {r.path for r in routes}
    assert {"/v1/jobs/{job}/minibatches/{n}", "/v1/jobs/{job}/units", "/v1/nodes/{node}/heartbeat"} <= paths
    plain = sorted(f"{sorted(r.methods)} {r.path}" for r in routes if not inspect.iscoroutinefunction(r.endpoint))
    assert plain == [], f"routes that are plain `def` (make them `async def` and use `await run(...)`): {plain}"


def test_state_off_the_state_thread_is_refused(tmp_path: Path) -> None:
    """While the app runs, touching a job from a thread-pool route or from the event loop raises;
    the same call through the runner answers."""
    app = create_app(Settings(db_path=str(tmp_path / "cp.db")))

    @app.get("/test/pool")
    def in_pool(svc: Service) -> dict[str, Any]:  # the mistake the rule forbids: runs in FastAPI's thread pool
        return svc.get_job("job1")

    @app.get("/test/loop")
    async def on_loop(svc: Service) -> dict[str, Any]:  # blocks the event loop, races the state thread
        return svc.get_job("job1")

    @app.get("/test/runner")
    async def via_runner(svc: Service, run: Run) -> dict[str, Any]:
        return await run(svc.get_job, "job1")

    with TestClient(app) as c:
        assert c.post("/v1/jobs", json=job_spec()).status_code == 201
        assert c.get("/test/runner").json()["state"] == "running"
        for path in ("/test/pool", "/test/loop"):
            with pytest.raises(RuntimeError, match="state thread"):
                c.get(path)
        with pytest.raises(RuntimeError, match="state thread"):  # a test thread, too, while the app runs
            app.state.service.set_state("job1", "pause")
        with pytest.raises(RuntimeError, match="state thread"):  # a change of no job (a node's) checks it too
            app.state.service.register_node("n9", "grpc://127.0.0.1:9000", "127.0.0.1")
        with pytest.raises(RuntimeError, match="state thread"):  # and so does a sweep that finds no node to lose
            app.state.service.sweep()
        with pytest.raises(RuntimeError, match="state thread"):  # and a look at what a job publishes
            app.state.service.published("job1")
        assert c.get("/v1/jobs/job1").json()["state"] == "running"  # nothing changed
        assert c.get("/v1/nodes").json() == []


def test_runner_check_follows_its_thread() -> None:
    """``StateRunner.check`` passes on any one thread before start and after close, only on its thread between."""
    runner = StateRunner()
    runner.check()  # not started: the caller is the only thread
    runner.start()
    try:
        with pytest.raises(RuntimeError, match="state thread"):
            runner.check()
        seen: list[str] = []

        def on_state_thread() -> None:
            runner.check()
            seen.append(threading.current_thread().name)

        assert runner._pool is not None
        runner._pool.submit(on_state_thread).result()
        assert seen and seen[0].startswith("knittrans-state")
    finally:
        runner.close()
    runner.check()
