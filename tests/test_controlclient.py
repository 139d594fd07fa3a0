"""ControlClient's retries of 503 answers, its reading of error answers that are not the control plane's JSON,
its argument checks, and the admin calls no other test makes (each against a real control plane)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_support import ENDPOINT, job_spec, server, single_group_units

from knittrans.controlclient import ControlClient
from knittrans.errors import Conflict, KnitTransError, Unavailable
from knittrans.retry import RetryPolicy

FAST = RetryPolicy(budget_s=5.0, first_backoff_s=0.001, max_backoff_s=0.01, jitter=0)


def _answering(responses: list[httpx.Response], **kwargs: object) -> tuple[ControlClient, list[httpx.Request]]:
    """A client whose requests get ``responses`` in turn (the last one from then on), and the requests seen."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return responses.pop(0) if len(responses) > 1 else responses[0]

    client = ControlClient("http://control-plane", retry=FAST, **kwargs)  # type: ignore[arg-type]
    client._http._transport = httpx.MockTransport(handle)
    return client, seen


def test_503_answers_are_retried_until_one_is_not() -> None:
    """A 503 (a control plane restarting) is retried; the next answer is the call's."""
    busy = httpx.Response(503, text="restarting")
    client, seen = _answering([busy, busy, httpx.Response(200, json={"status": "ok"})])
    with client:
        assert client.health() == {"status": "ok"}
    assert len(seen) == 3


def test_503_answers_past_the_retries_raise_unavailable_naming_the_answer() -> None:
    client, seen = _answering([httpx.Response(503, text="restarting")], retries=2)
    with client, pytest.raises(Unavailable, match=r"GET /v1/health failed after 3 attempts: 503 restarting"):
        client.health()
    assert len(seen) == 3


def test_error_answers_that_are_not_a_json_object_raise_by_status() -> None:
    """A proxy's HTML page, or JSON that is not an object, is still raised as the error of its status."""
    client, _ = _answering([httpx.Response(502, text="<html>bad gateway</html>")])
    with client, pytest.raises(KnitTransError, match=r"HTTP 502: <html>bad gateway</html>"):
        client.health()
    client, _ = _answering([httpx.Response(409, json=["not", "an", "object"])])
    with client, pytest.raises(Conflict, match=r"\[\"not\""):
        client.health()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="retries must be >= 0"):
        ControlClient("http://control-plane", retries=-1)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        ControlClient("http://control-plane", timeout_s=0)
    for bad in ({"budget_s": -1.0}, {"max_backoff_s": float("inf")}, {"first_backoff_s": float("nan")}):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            RetryPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"jitter must be in \[0, 1\]"):
        RetryPolicy(jitter=1.5)


def test_admin_calls_reach_their_routes(tmp_path: Path) -> None:
    """update_quotas, remove_unit, metrics and drain against a real control plane."""
    with server(tmp_path / "cp.db") as cp, ControlClient(cp.url, retries=0) as client:
        client.create_job(job_spec())
        changed = client.update_quotas("job1", {"math": 2, "code": 4})
        assert changed["quota_changes"][-1]["quotas"] == {"math": 2, "code": 4}, changed
        client.register_node("n0", ENDPOINT.format(port=1))
        client.register_units("job1", single_group_units(["math"]))
        removed = client.remove_unit("job1", "u-g0", reason="bad rewards")
        assert removed["removed_groups"] == ["g0"] and removed["admitted"] == []
        assert "knittrans_" in client.metrics()
        assert client.drain("job1")["state"] == "drained"  # nothing admitted: nothing left to train
