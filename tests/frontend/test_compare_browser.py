""" "Did it help?" in a real headless Chromium: a lead follows the menu to the page, reads the
change and its parts (which add up to it), picks other windows through the form, fetches the
CSV, and the page fits a phone. Screenshots go to tests/artifacts/."""

from __future__ import annotations

import csv
import io
from datetime import UTC, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pytest_django.live_server_helper import LiveServer

from billing.compare import ROW_COLUMNS
from tests.frontend.browsing import log_in
from tests.frontend.seed import Portal
from tests.frontend.test_browser import OVERFLOWING

pytestmark = pytest.mark.browser


def _points(text: str) -> Decimal:
    return Decimal(text.strip())


def test_a_lead_finds_out_whether_it_helped(
    wide: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    log_in(wide, live_server, "lead_a")
    wide.get_by_role("link", name="Did it help?").click()
    wide.wait_for_load_state()
    assert wide.get_by_role("heading", name="Did it help?", level=1).is_visible()
    assert wide.locator("#team").input_value() == "vision"
    # The seed's jobs keep their own efficiency; what moves is how many hours each ran.
    verdict = wide.locator("#verdict").inner_text()
    assert verdict.startswith("Utilisation ") and "points)" in verdict
    parts = [
        _points(wide.locator(f"#part-{name} td").first.inner_text())
        for name in ("mix", "efficiency", "entering", "leaving")
    ]
    change = _points(wide.locator("#part-change td").first.inner_text())
    assert sum(parts) == change
    jobs = wide.locator("#compare-jobs tbody tr")
    assert jobs.count() == 3
    names = jobs.locator("th").all_inner_texts()
    assert all(name.startswith(("vision/Pod/", "research/Pod/")) for name in names), names
    wide.screenshot(path=str(artifacts / "compare.png"), full_page=True)

    # Other windows through the form: the last day against the one before.
    today = live_portal.now.astimezone(UTC).date()
    wide.get_by_label("From").first.fill((today - timedelta(days=2)).isoformat())
    wide.get_by_label("Until (exclusive)").first.fill((today - timedelta(days=1)).isoformat())
    wide.get_by_label("From").last.fill((today - timedelta(days=1)).isoformat())
    wide.get_by_label("Until (exclusive)").last.fill(today.isoformat())
    wide.get_by_role("button", name="Compare").click()
    wide.wait_for_load_state()
    assert f"before_start={today - timedelta(days=2)}" in wide.url
    assert (
        wide.locator("#window-before th")
        .inner_text()
        .startswith(f"Before {today - timedelta(days=2)} 00:00")
    )

    csv_url = wide.locator("#compare-csv").get_attribute("href")
    response = wide.request.get(f"{live_server.url}{csv_url}")
    assert response.ok and response.headers["content-type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(response.text())))
    assert tuple(rows[0]) == ROW_COLUMNS
    assert rows[1][0] == "total" and len(rows) == 5

    # A bad bound is named on the form, next to its field.
    wide.get_by_label("From").first.fill("last tuesday")
    wide.get_by_role("button", name="Compare").click()
    wide.wait_for_load_state()
    assert "is not a UTC date" in wide.locator("#before_start-error").inner_text()
    assert wide.locator("#result").count() == 0
    wide.screenshot(path=str(artifacts / "compare-error.png"), full_page=True)


def test_the_comparison_fits_a_phone(
    phone: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    log_in(phone, live_server, "lead_a")
    phone.goto(f"{live_server.url}/compare/")
    assert phone.locator("#compare-jobs tbody tr").first.is_visible()
    spilling = phone.evaluate(OVERFLOWING)
    assert spilling == [], spilling
    phone.screenshot(path=str(artifacts / "compare-phone.png"), full_page=True)
