"""The week report and the fleet's week heatmap in a real headless Chromium, with screenshots:
a lead reads their week and downloads its CSV, an operator reads the heatmap, and the week
page fits a phone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from pytest_django.live_server_helper import LiveServer

from teams.selectors import OPERATORS_GROUP
from tests.billing.test_week_report import build_week_scenario
from tests.frontend.browsing import log_in
from tests.frontend.seed import PASSWORD
from tests.frontend.test_browser import OVERFLOWING

pytestmark = pytest.mark.browser

START = "?start=2026-11-16"


@pytest.fixture
def week_portal(transactional_db: None) -> None:
    build_week_scenario()
    lead = User.objects.get(username="lead_a")
    lead.set_password(PASSWORD)
    lead.save()
    operator = User.objects.create_user("operator", password=PASSWORD)
    operator.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])


def test_a_lead_reads_the_week_and_downloads_it(
    wide: Any, live_server: LiveServer, week_portal: None, artifacts: Path
) -> None:
    log_in(wide, live_server, "lead_a")
    wide.goto(f"{live_server.url}/teams/vision/week/{START}")
    assert wide.get_by_role("heading", name="Vision: the week from Mon 16 Nov 2026").is_visible()
    ben = wide.locator("#week-people tbody tr", has_text="ben")
    assert "43.40 USD" in ben.inner_text() and "+30.00" in ben.inner_text()
    idle = wide.locator("#week-idle tbody tr").first
    assert "ben-notebook" in idle.inner_text() and "28 h" in idle.inner_text()
    assert "68.29 of 200 GPU-hours" in wide.locator("#week-budget").inner_text()
    wide.screenshot(path=str(artifacts / "week-report.png"), full_page=True)
    with wide.expect_download() as download:
        wide.get_by_role("link", name="Download CSV").click()
    text = Path(download.value.path()).read_text()
    assert text.startswith("section,name,unit,hours,allocated_hours")
    assert "person,ana,gpu,GPU-hours,28.29" in text
    wide.get_by_role("link", name="Week before").click()
    wide.wait_for_load_state()
    assert wide.get_by_role("heading", name="Vision: the week from Mon 9 Nov 2026").is_visible()


def test_an_operator_reads_the_heatmap(
    wide: Any, live_server: LiveServer, week_portal: None, artifacts: Path
) -> None:
    log_in(wide, live_server, "operator")
    wide.goto(f"{live_server.url}/fleet/")
    wide.get_by_role("link", name="Fleet week").click()
    wide.wait_for_load_state()
    wide.goto(f"{live_server.url}/fleet/week/{START}")
    row = wide.locator('#heatmap-allocated tr[data-node="gpu-h100-1"]')
    assert row.locator("td.heat").count() == 7 * 24
    first = row.locator("td.heat").first
    assert first.get_attribute("title") == "gpu-h100-1 Mon 16 00:00: 1.00 of 2"
    # Shaded by the share held: half the node is a mid blue, an idle hour no colour.
    assert first.evaluate("cell => getComputedStyle(cell).backgroundColor") == (
        "rgba(10, 88, 202, 0.5)"
    )
    saturday = row.locator("td.heat").nth(24 * 5)
    assert saturday.evaluate("cell => getComputedStyle(cell).backgroundColor") in (
        "rgba(10, 88, 202, 0)",
        "rgba(0, 0, 0, 0)",
    )
    wide.screenshot(path=str(artifacts / "fleet-week.png"), full_page=True)


def test_the_week_fits_a_phone(
    phone: Any, live_server: LiveServer, week_portal: None, artifacts: Path
) -> None:
    log_in(phone, live_server, "lead_a")
    phone.goto(f"{live_server.url}/teams/vision/week/{START}")
    assert phone.locator("#week-jobs tbody tr", has_text="StatefulSet/nb").is_visible()
    assert phone.evaluate(OVERFLOWING) == []
    phone.screenshot(path=str(artifacts / "week-report-phone.png"), full_page=True)
