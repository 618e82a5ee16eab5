"""The portal in a real headless Chromium against the live server: log in through the form,
charts drawn by Chart.js with the seeded figures, the statement CSV downloaded, another
team's page refused, the fleet's outlier node found. Full-page screenshots of the main pages
go to tests/artifacts/ for a person to look at."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pytest_django.live_server_helper import LiveServer

from frontend import selectors
from tests.frontend.seed import OUTLIER_NODE, PASSWORD, Portal

pytestmark = pytest.mark.browser

NARROW = {"width": 375, "height": 812}
WIDE = {"width": 1280, "height": 900}


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:
    context = chromium.new_context(viewport=WIDE, accept_downloads=True)
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _log_in(page: Any, live_server: LiveServer, username: str) -> None:
    page.goto(f"{live_server.url}/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_load_state()


def _shot(page: Any, artifacts: Path, name: str) -> None:
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1000, f"{path} is empty"


def _chart(page: Any, canvas_id: str) -> dict[str, Any]:
    """What Chart.js drew on the canvas: its size, and the chart's labels and datasets."""
    result: dict[str, Any] = page.evaluate(
        """(id) => {
            const canvas = document.getElementById(id);
            const chart = Chart.getChart(canvas);
            return {
                width: canvas.width,
                height: canvas.height,
                exists: chart !== undefined,
                labels: chart ? chart.data.labels : [],
                datasets: chart
                    ? chart.data.datasets.map(d => ({label: d.label, data: d.data}))
                    : [],
            };
        }""",
        canvas_id,
    )
    return result


def test_team_lead_sees_charts_and_downloads_the_statement(
    page: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    page.goto(f"{live_server.url}/login/")
    _shot(page, artifacts, "login")
    _log_in(page, live_server, "lead_a")
    # A lead of one team lands on it.
    assert page.url == f"{live_server.url}/teams/vision/"
    assert page.get_by_role("heading", level=1).inner_text() == "Vision"
    assert page.evaluate("Chart.getChart(document.querySelector('canvas')) !== undefined")

    page.get_by_role("link", name="30 days").click()
    page.wait_for_load_state()
    usage = _chart(page, "usage-chart")
    assert usage["exists"] and usage["width"] > 0 and usage["height"] > 0
    assert len(usage["labels"]) == 30
    allocated = dict(zip(usage["labels"], usage["datasets"][0]["data"], strict=True))
    utilised = dict(zip(usage["labels"], usage["datasets"][1]["data"], strict=True))
    today = live_portal.now.date()
    seeded_days = [today - timedelta(days=n) for n in range(1, 30)]
    for day in seeded_days:
        seeded_allocated, seeded_utilised = live_portal.daily[day]
        assert Decimal(str(allocated[day.isoformat()])) == seeded_allocated.quantize(
            selectors.HOURS
        )
        assert Decimal(str(utilised[day.isoformat()])) == seeded_utilised.quantize(selectors.HOURS)
    assert allocated[today.isoformat()] == 0
    # The same figures are in the table beside the chart.
    page.get_by_text("Usage per day as a table").click()
    first_day = seeded_days[-1].isoformat()
    row = page.locator("#usage-table tbody tr", has_text=first_day)
    assert row.locator("td").first.inner_text() == str(
        live_portal.daily[seeded_days[-1]][0].quantize(selectors.HOURS)
    )

    burn = _chart(page, "burn-chart")
    assert burn["exists"] and burn["width"] > 0
    assert [dataset["label"] for dataset in burn["datasets"]] == ["Remaining budget", "Steady burn"]
    assert burn["datasets"][1]["data"][0] < 2000
    assert page.locator("#live-claims tbody tr").count() == live_portal.live_devices
    _shot(page, artifacts, "team")

    with page.expect_download() as download_info:
        page.locator("#statements a", has_text="CSV").last.click()
    download = download_info.value
    assert download.suggested_filename == (
        f"tally-vision-{live_portal.closed_period.start:%Y-%m}.csv"
    )
    rows = list(csv.reader(io.StringIO(Path(download.path()).read_text())))
    assert tuple(rows[0]) == selectors.CSV_COLUMNS
    line = dict(zip(rows[0], rows[1], strict=True))
    assert line["period_start"] == f"{live_portal.closed_period.start:%Y-%m-%d}"
    assert line["currency"] == "USD" and Decimal(line["amount"]) > 0

    # Another team's page is not found, not forbidden: its existence is not revealed.
    response = page.goto(f"{live_server.url}/teams/nlp/")
    assert response is not None and response.status == 404
    assert page.get_by_role("heading", name="Page not found").is_visible()
    _shot(page, artifacts, "not-found")

    # At a phone's width the page still fits: tables scroll inside their box.
    page.set_viewport_size(NARROW)
    page.goto(f"{live_server.url}/teams/vision/")
    assert page.evaluate("document.documentElement.scrollWidth") <= NARROW["width"]
    assert _chart(page, "usage-chart")["width"] > 0
    _shot(page, artifacts, "team-narrow")


def test_operator_finds_the_outlier_node(
    page: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    _log_in(page, live_server, "operator")
    assert page.get_by_role("heading", name="Teams").is_visible()
    page.get_by_role("link", name="Fleet", exact=True).click()
    page.wait_for_load_state()
    assert page.locator(".outlier-node").all_inner_texts() == [OUTLIER_NODE]
    outlier_row = page.locator("#nodes tbody tr.row-outlier")
    assert outlier_row.count() == 1
    assert outlier_row.locator("th").inner_text().startswith(OUTLIER_NODE)
    assert page.locator("#version-matrix tr.row-outlier").count() == 1
    _shot(page, artifacts, "fleet")

    page.get_by_role("link", name="Admission decisions").click()
    page.wait_for_load_state()
    assert page.locator("#decisions tbody tr").count() == 50
    _shot(page, artifacts, "decisions")
    page.get_by_role("link", name="Older").click()
    assert page.locator("#decisions tbody tr").count() == 10
