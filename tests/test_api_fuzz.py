"""OpenAPI-driven fuzzing of the control plane: random bodies never cause a 5xx and errors stay JSON."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from api_support import app_client, job_spec, single_group_units
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import knittrans.api.routes as routes_pkg
from knittrans.api import Settings, create_app

_APP = create_app(Settings(db_path=":memory:"))
_SCHEMA = _APP.openapi()
_PARAMS = {"job": "job1", "node": "n0", "n": "0", "rank": "0", "worker": "w0"}

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _body_schema(op: dict[str, Any]) -> dict[str, Any] | None:
    content = op.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        return None
    schema: dict[str, Any] = content["schema"]
    while "$ref" in schema:
        schema = _SCHEMA["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


ENDPOINTS = [
    (method.upper(), path, _body_schema(op))
    for path, ops in _SCHEMA["paths"].items()
    for method, op in ops.items()
    if method in ("post", "put")
]


def _bodies(schema: dict[str, Any] | None) -> st.SearchStrategy[Any]:
    if schema is None or "properties" not in schema:
        return JSON
    fields = {name: JSON for name in schema["properties"]}
    return st.fixed_dictionaries({}, optional=fields) | JSON  # type: ignore[arg-type]


def test_every_mutating_endpoint_is_fuzzed() -> None:
    """The fuzz list covers every POST/PUT route of every router module in ``knittrans.api.routes`` (read
    from the routers, not from the OpenAPI document the list is made from), so a route left out of the
    schema, or a router the app forgot to include, would not escape fuzzing."""
    served: set[tuple[str, str]] = set()
    for info in pkgutil.iter_modules(routes_pkg.__path__):
        router = getattr(importlib.import_module(f"{routes_pkg.__name__}.{info.name}"), "router", None)
        for route in getattr(router, "routes", []):
            if isinstance(route, APIRoute):
                served |= {(method, route.path) for method in route.methods or () if method in ("POST", "PUT")}
    assert served and served == {(method, path) for method, path, _ in ENDPOINTS}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    db = Path(tmp_path_factory.mktemp("fuzz")) / "cp.db"
    with app_client(db) as c:
        c.post("/v1/jobs", json=job_spec())
        c.post("/v1/nodes", json={"node_id": "n0", "endpoint": "grpc://127.0.0.1:1"})
        c.post("/v1/jobs/job1/units", json={"units": single_group_units(["math", "code"])})
        yield c


@pytest.mark.parametrize(("method", "path", "schema"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_bodies_get_4xx_json_never_5xx(
    client: TestClient, method: str, path: str, schema: dict[str, Any] | None, data: st.DataObject
) -> None:
    """Whatever JSON arrives, the answer is < 500, and any error is {"error", "detail"}."""
    body = data.draw(_bodies(schema))
    url = path.format(**_PARAMS)
    r = client.request(method, url, json=body)
    assert r.status_code < 500, (url, body, r.text)
    if r.status_code >= 400:
        assert set(r.json()) == {"error", "detail"}, r.text
    assert client.get("/v1/health").status_code == 200
