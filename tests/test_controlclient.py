"""ControlClient's retries of 503 answers, its reading of error answers that are not the control plane's JSON,
its argument checks, and the admin calls no other test makes (each against a real control plane)."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_support import ENDPOINT, job_spec, server, single_group_units

from knittrans.controlclient import ControlClient
from knittrans.errors import Conflict, KnitTransError, Unavailable
from knittrans.retry import RetryPolicy

FAST = RetryPolicy(budget_s=5.0, first_backoff_s=0.001, max_backoff_s=0.01, jitter=0)


@contextlib.contextmanager
def _answering(answers: list[tuple[int, str, str]]) -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on 127.0.0.1 (a restarting control plane, a proxy in front of one) whose requests get
    ``answers`` (status, content type, body) in turn, the last one from then on; yields its URL and the request
    lines it saw."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(f"{self.command} {self.path}")
            status, kind, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
        finally:
            httpd.shutdown()
            thread.join()


TEXT, JSON = "text/plain", "application/json"


def test_503_answers_are_retried_until_one_is_not() -> None:
    """A 503 (a control plane restarting) is retried; the next answer is the call's."""
    busy = (503, TEXT, "restarting")
    with _answering([busy, busy, (200, JSON, '{"status": "ok"}')]) as (url, seen), ControlClient(url, retry=FAST) as c:
        assert c.health() == {"status": "ok"}
    assert seen == ["GET /v1/health"] * 3


def test_503_answers_past_the_retries_raise_unavailable_naming_the_answer() -> None:
    with (
        _answering([(503, TEXT, "restarting")]) as (url, seen),
        ControlClient(url, retry=FAST, retries=2) as c,
        pytest.raises(Unavailable, match=r"GET /v1/health failed after 3 attempts: 503 restarting"),
    ):
        c.health()
    assert len(seen) == 3


def test_error_answers_that_are_not_a_json_object_raise_by_status() -> None:
    """A proxy's HTML page, or JSON that is not an object, is still raised as the error of its status."""
    with (
        _answering([(502, "text/html", "<html>bad gateway</html>")]) as (url, _),
        ControlClient(url, retry=FAST) as c,
        pytest.raises(KnitTransError, match=r"HTTP 502: <html>bad gateway</html>"),
    ):
        c.health()
    with (
        _answering([(409, JSON, '["not", "an", "object"]')]) as (url, _),
        ControlClient(url, retry=FAST) as c,
        pytest.raises(Conflict, match=r"\[\"not\""),
    ):
        c.health()


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
