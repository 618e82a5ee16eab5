"""What the browser tests share: the two widths pages are tried at, a page of a fresh browser
context (JavaScript errors fail the test, downloads allowed), and logging in."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pytest_django.live_server_helper import LiveServer

from tests.frontend.conftest import watched_page
from tests.frontend.seed import PASSWORD

WIDE = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def open_page(chromium: Any, viewport: dict[str, int]) -> Iterator[Any]:
    """A page of a new context of `chromium` at `viewport`, closed after the test."""
    context = chromium.new_context(viewport=viewport, accept_downloads=True)
    context.set_default_timeout(15_000)
    with watched_page(context) as page:
        yield page


def log_in(page: Any, live_server: LiveServer, username: str) -> None:
    page.goto(f"{live_server.url}/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_load_state()
