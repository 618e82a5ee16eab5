"""The admin in a real headless Chromium at a 1280 px window: the team and statement change
pages fit it (no sideways scrolling), and memory and money read as people write them.
Screenshots go to tests/artifacts/admin-*.png."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse
from pytest_django.live_server_helper import LiveServer

from tests.admin.conftest import Seeded, seed_admin
from tests.frontend.conftest import watched_page

pytestmark = pytest.mark.browser

WINDOW = {"width": 1280, "height": 900}
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


@pytest.fixture
def live_seeded(transactional_db: None) -> Seeded:
    """The seed in committed rows, for the live server's thread to read."""
    return seed_admin()


@pytest.fixture
def page(chromium: Any, live_server: LiveServer, operator: Any) -> Iterator[Any]:
    """A 1280 px page logged in as the operator (a session made here, not through the form)."""
    client = Client()
    client.force_login(operator)
    context = chromium.new_context(viewport=WINDOW)
    context.set_default_timeout(15_000)
    context.add_cookies(
        [
            {
                "name": settings.SESSION_COOKIE_NAME,
                "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
                "url": live_server.url,
            }
        ]
    )
    with watched_page(context) as page:
        yield page


def _width(page: Any, url: str, name: str) -> int:
    page.goto(url)
    page.wait_for_load_state("networkidle")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"admin-{name}.png"), full_page=True)
    width: int = page.evaluate("document.documentElement.scrollWidth")
    return width


def test_team_and_statement_pages_fit_a_1280_px_window(
    page: Any, live_server: LiveServer, live_seeded: Seeded
) -> None:
    team_url = reverse("admin:teams_team_change", args=[live_seeded.team.pk])
    statement_url = reverse("admin:billing_statement_change", args=[live_seeded.statement.pk])
    widths = {
        "team": _width(page, f"{live_server.url}{team_url}", "team"),
        "statement": _width(page, f"{live_server.url}{statement_url}", "statement"),
    }
    wider = {name: width for name, width in widths.items() if width > WINDOW["width"]}
    assert not wider, f"wider than the {WINDOW['width']} px window: {wider}"
