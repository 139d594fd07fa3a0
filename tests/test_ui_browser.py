"""The ``/ui`` dashboard in a real headless chromium against a real control plane: live job, pause button, screenshot.

Needs Debian's ``chromium`` (``apt-get install -y chromium``; ``scripts/test.sh`` installs it) or
``KNITTRANS_CHROMIUM=/path/to/chrome``; playwright drives it and downloads no browser. The
screenshot goes to ``results/ui/dashboard.png`` (``KNITTRANS_ARTIFACTS`` overrides the directory).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import populate, server

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ADMIN, WORKER = "ui-admin-token", "ui-worker-token"


def _chromium() -> str:
    path = os.environ.get("KNITTRANS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail(
            "no chromium found: install Debian's `chromium` package (apt-get install -y chromium) "
            "or set KNITTRANS_CHROMIUM to a Chrome/Chromium executable"
        )
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=_chromium(),
            headless=True,
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        try:
            yield b
        finally:
            b.close()


def _artifacts() -> Path:
    out = Path(os.environ.get("KNITTRANS_ARTIFACTS", ROOT / "results" / "ui"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_dashboard_shows_live_job_and_pauses_it(browser: Any, tmp_path: Path) -> None:
    """The page connects with the admin token, shows the running job, nodes and ranks; Pause pauses the job."""
    with (
        server(tmp_path / "cp.db", "--admin-token", ADMIN, "--worker-token", WORKER) as cp,
        httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10) as api,
    ):
        populate(api)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{cp.url}/ui#token={ADMIN}")
        job = page.locator('.job[data-job="job1"]')
        job.locator('.badge[data-state="running"]').wait_for(timeout=30_000)
        assert "token" not in page.url, "the token must leave the address bar"
        text = job.inner_text()
        assert "Quota fill of the current step" in text and "math" in text and "code" in text
        assert "2 mini-batches consumed" in text
        assert job.locator('path[data-series="all"]').count() == 1, "staleness chart has the all-sources line"
        assert job.locator("svg rect").count() == 2, "one admission bar per admitted mini-batch"
        ranks = [row.split("\t") for row in job.locator("table").last.inner_text().splitlines()[1:]]
        assert [(row[0], row[7]) for row in ranks] == [("0", "n1.a0"), ("1", "n1.a0")]  # each rank's last ack
        nodes = page.locator("#nodes").inner_text()
        assert "n0" in nodes and "n1" in nodes and "alive" in nodes and "1.0 MiB" in nodes
        shot = _artifacts() / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("KNITTRANS_UPDATE_DOCS_IMG") == "1":
            shutil.copyfile(shot, ROOT / "docs" / "img" / "dashboard.png")

        page.click("#pause-job1")
        job.locator('.badge[data-state="paused"]').wait_for(timeout=30_000)
        assert api.get("/v1/jobs/job1").json()["state"] == "paused"
        page.click("#resume-job1")
        job.locator('.badge[data-state="running"]').wait_for(timeout=30_000)
        assert api.get("/v1/jobs/job1").json()["state"] == "running"
        assert not errors, f"JavaScript errors on the page: {errors}"
        page.close()


def test_dashboard_with_wrong_token_shows_the_error(browser: Any, tmp_path: Path) -> None:
    """A wrong token shows the 401 from /v1/overview on the page and no job data."""
    with server(tmp_path / "cp.db", "--admin-token", ADMIN, "--worker-token", WORKER) as cp:
        page = browser.new_page()
        page.goto(f"{cp.url}/ui#token={WORKER}")
        error = page.locator("#error")
        error.wait_for(state="visible", timeout=30_000)
        page.wait_for_function("document.getElementById('error').textContent.includes('401')", timeout=30_000)
        assert "admin bearer token" in error.inner_text()
        assert page.locator(".job").count() == 0
        page.close()
