"""The team page's per-person and per-job tables in a real headless Chromium: a lead reads who
is billed what and who holds idle devices, downloads the CSV, and the tables fit a phone."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.conf import LazySettings
from django.utils import timezone
from pytest_django.live_server_helper import LiveServer

from tests.api.cast import Cast, cast
from tests.api.test_people_usage import Week, week_scenario
from tests.frontend.seed import PASSWORD
from tests.frontend.test_browser import OVERFLOWING
from tests.frontend.test_people_pages import last_monday_but_one

pytestmark = pytest.mark.browser

__all__ = ["cast"]


@pytest.fixture
def live_week(transactional_db: None, cast: Cast, settings: LazySettings) -> Week:
    settings.TALLY_BILLING_PERIOD = "week"
    cast.lead_a.set_password(PASSWORD)
    cast.lead_a.save()
    return week_scenario(cast.alpha, cast.beta, monday=last_monday_but_one(timezone.now()))


def _open_team_page(page: Any, live_server: LiveServer, cast: Cast) -> None:
    page.goto(f"{live_server.url}/login/")
    page.get_by_label("Username").fill(cast.lead_a.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_load_state()
    page.goto(f"{live_server.url}/teams/alpha/?days=30")


def test_lead_sees_who_is_billed_what_and_downloads_it(
    wide: Any, live_server: LiveServer, live_week: Week, cast: Cast, tmp_path: Path
) -> None:
    _open_team_page(wide, live_server, cast)
    assert wide.get_by_role("heading", name="Per person, last 30 days").is_visible()
    ben = wide.locator("#people tbody tr", has_text="ben")
    assert ben.count() == 1
    assert "274.08 USD" in ben.inner_text() and "204.48 USD" in ben.inner_text()
    notebook = wide.locator("#jobs tbody tr", has_text="Deployment/notebook")
    assert "ana, ben" in notebook.inner_text() and "286.48 USD" in notebook.inner_text()
    idle = wide.locator("#idle-billed")
    assert "258.84 USD" in idle.inner_text()
    holder = wide.locator("#idle-holders tbody tr", has_text="notebook")
    assert holder.count() == 1 and "Deployment/notebook" in holder.inner_text()
    assert holder.locator("th").inner_text() == "ben"

    with wide.expect_download() as download:
        wide.locator("#people-heading").locator("xpath=..").get_by_role("link").click()
    saved = tmp_path / "people.csv"
    download.value.save_as(saved)
    rows = list(csv.DictReader(io.StringIO(saved.read_text())))
    assert sum(Decimal(row["billed"]) for row in rows) == live_week.statements["alpha"].total
    assert {row["username"] for row in rows} == {"ana", "ben", "cara", "dan", ""}

    wide.locator("#people-heading").scroll_into_view_if_needed()
    shot = tmp_path / "team-people.png"
    wide.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def test_people_tables_fit_a_phone(
    phone: Any, live_server: LiveServer, live_week: Week, cast: Cast, tmp_path: Path
) -> None:
    _open_team_page(phone, live_server, cast)
    assert phone.locator("#people tbody tr", has_text="cara").is_visible()
    assert phone.locator("#jobs tbody tr", has_text="JobSet/sweep").is_visible()
    spilling = [
        box
        for box in phone.evaluate(OVERFLOWING)
        if any(name in box for name in ("people", "jobs", "idle-now", "idle-holders"))
    ]
    assert spilling == []
    phone.screenshot(path=str(tmp_path / "team-people-phone.png"), full_page=True)
