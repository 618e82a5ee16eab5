"""Fixtures for the portal's tests: the seeded portal, and a real headless Chromium.

Browser tests need Chromium at /usr/bin/chromium (Debian's `chromium` package). On a
developer's machine without it they are skipped with the reason; where
TALLY_BROWSER_TESTS=required (as `.ci/run` sets, after installing it) they fail instead, so a
missing browser can never pass for a green run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.conf import LazySettings

from tests.frontend.seed import Portal, seed_portal

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


@pytest.fixture(autouse=True)
def _portal_settings(settings: LazySettings) -> None:
    # Plain static files even where a developer ran `collectstatic` (hashed names then).
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    # The browser tests log in through the form; a fast hasher keeps the seed quick.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def portal(db: None) -> Portal:
    return seed_portal()


@pytest.fixture
def live_portal(transactional_db: None) -> Portal:
    """The seeded portal in committed rows, for the live server's thread to read."""
    return seed_portal()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@contextmanager
def watched_page(context: Any) -> Iterator[Any]:
    """A new page of the browser `context`, whose JavaScript errors fail the test; the context
    is closed after it."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium driven by Playwright's sync API, for one test module."""
    if not CHROMIUM.exists():
        reason = (
            f"{CHROMIUM} is missing: the browser tests need Debian's chromium "
            "(apt-get install -y chromium)"
        )
        if os.environ.get("TALLY_BROWSER_TESTS") == "required":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread, which makes Django refuse
    # ORM calls from it; the test's own ORM calls (the seed) are synchronous and safe.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
            )
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def wide(chromium: Any) -> Iterator[Any]:
    """A page at a laptop's width (`browsing.WIDE`)."""
    from tests.frontend.browsing import WIDE, open_page

    yield from open_page(chromium, WIDE)


@pytest.fixture
def phone(chromium: Any) -> Iterator[Any]:
    """A page at a phone's width (`browsing.PHONE`)."""
    from tests.frontend.browsing import PHONE, open_page

    yield from open_page(chromium, PHONE)
