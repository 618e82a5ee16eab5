"""Pending demand and stranded gangs in a real headless Chromium: an operator finds them on
the fleet page, and a lead's team page shows them without a spilling card at phone width."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from pytest_django.live_server_helper import LiveServer

from tests.frontend.browsing import log_in
from tests.frontend.seed import Portal
from tests.frontend.test_browser import OVERFLOWING
from tests.frontend.test_queue_pages import add_queue

pytestmark = pytest.mark.browser


def test_operator_finds_the_queue_and_the_stranded_gang(
    wide: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    add_queue(live_portal, timezone.now())
    log_in(wide, live_server, "operator")
    wide.goto(f"{live_server.url}/fleet/")
    assert wide.get_by_role("heading", name="Pending demand").is_visible()
    waiting = wide.locator("#pending-claims tbody tr", has_text="waiting-four")
    assert waiting.count() == 1
    assert "4 \N{MULTIPLICATION SIGN} gpu.nvidia.com" in waiting.inner_text()
    assert waiting.locator("td").last.inner_text().startswith("3 h")
    gang = wide.locator("#stranded-gangs tbody tr", has_text="JobSet/train")
    assert gang.count() == 1
    assert "1 of 2" in gang.inner_text() and "USD" in gang.inner_text()
    assert wide.locator("#stranded-gangs th", has_text="Team").count() == 1
    wide.locator("#stranded-heading").scroll_into_view_if_needed()
    wide.screenshot(path=str(artifacts / "fleet-queue.png"), full_page=True)


def test_team_page_queue_fits_a_phone(
    phone: Any, live_server: LiveServer, live_portal: Portal
) -> None:
    add_queue(live_portal, timezone.now())
    log_in(phone, live_server, "lead_a")
    phone.goto(f"{live_server.url}/teams/vision/")
    assert phone.locator("#stranded-gangs tbody tr", has_text="JobSet/train").is_visible()
    assert phone.locator("#pending-claims tbody tr", has_text="waiting-four").is_visible()
    spilling = [box for box in phone.evaluate(OVERFLOWING) if "pending" in box or "stranded" in box]
    assert spilling == []
