"""The portal's "Did it help?" page (`frontend.compare`): the figures worked out by hand in
tests/billing/test_compare.py, who may see which scope, defaults, and bad windows on the form."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import time_machine
from django.test import Client

from tests.api.cast import Cast, cast
from tests.api.test_compare_api import WINDOWS, usage_of_both

__all__ = ["cast", "usage_of_both"]

pytestmark = pytest.mark.django_db

URL = "/compare/"


def page(cast: Cast, who: str, **params: str) -> Any:
    client = Client()
    client.force_login(getattr(cast, who))
    return client.get(URL, params)


def test_a_lead_sees_what_changed_the_utilisation(usage_of_both: Cast) -> None:
    response = page(usage_of_both, "lead_a", team="alpha", **WINDOWS)
    assert response.status_code == 200
    html = response.content.decode()
    assert "70.00%" in html and "85.00%" in html
    context = response.context
    assert context["verdict"] == (
        "Utilisation rose (+15.00 points), as much because the same jobs used their devices "
        "better (+7.50 points) as because the work changed: which jobs ran, and how much."
    )
    assert [(part.name, part.points) for part in context["parts"]] == [
        ("mix", "+7.50"),
        ("efficiency", "+7.50"),
        ("entering", "0.00"),
        ("leaving", "0.00"),
    ]
    assert context["change"] == "+15.00"
    assert [(job["job"], job["change"]) for job in context["jobs"]] == [
        ("Job/a", "+11.88"),
        ("Job/b", "+3.12"),
    ]
    assert context["csv_url"] == (
        "/api/v1/compare/?team=alpha&before_start=2026-11-02&before_end=2026-11-09"
        "&after_start=2026-11-09&after_end=2026-11-16T00%3A00Z&unit=gpu&format=csv"
    )
    assert 'href="/compare/" aria-current="page"' in html  # the nav's link


def test_the_verdict_names_the_larger_cause(usage_of_both: Cast) -> None:
    # Beta: one job, 50% -> 100% on the same hours: all efficiency.
    context = page(usage_of_both, "lead_b", team="beta", **WINDOWS).context
    assert context["verdict"] == (
        "Utilisation rose (+50.00 points), mostly because the same jobs used their devices "
        "better (+50.00 points)."
    )


def test_the_fleet_shows_each_jobs_team(usage_of_both: Cast) -> None:
    response = page(usage_of_both, "operator", **WINDOWS)  # no team given: the fleet
    assert response.status_code == 200
    assert response.context["team"] is None
    assert {job["team"] for job in response.context["jobs"]} == {"alpha", "beta", ""}
    assert "Fleet (every team)" in response.content.decode()


@pytest.mark.parametrize(
    ("who", "params", "status"),
    [
        ("lead_a", {"team": "beta"}, 404),
        ("lead_a", {"team": "nope"}, 404),
        ("lead_a", {"team": "al\x00pha"}, 404),  # no slug at all: not found, never a 500
        ("finance", {"team": "\x00"}, 404),
        ("lead_a", {"team": ""}, 403),
        ("member_a", {"team": "alpha"}, 403),
        ("finance", {"team": "beta"}, 200),
        ("finance", {"team": ""}, 200),
    ],
)
def test_who_may_see_which_scope(
    usage_of_both: Cast, who: str, params: dict[str, str], status: int
) -> None:
    assert page(usage_of_both, who, **params, **WINDOWS).status_code == status


def test_anonymous_visitors_go_to_the_login_page(cast: Cast) -> None:
    response = Client().get(URL)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_by_default_the_last_week_against_the_one_before(usage_of_both: Cast) -> None:
    with time_machine.travel(datetime(2026, 11, 16, 9, 30, tzinfo=UTC), tick=False):
        response = page(usage_of_both, "lead_a")
    assert response.status_code == 200
    expected = {"team": "alpha", **WINDOWS, "after_end": "2026-11-16", "unit": "gpu"}
    assert response.context["params"] == expected
    assert response.context["change"] == "+15.00"


def test_bad_windows_are_shown_on_the_form(usage_of_both: Cast) -> None:
    response = page(
        usage_of_both,
        "lead_a",
        team="alpha",
        **{**WINDOWS, "before_start": "last week", "after_end": "2026-11-09"},
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert "&#x27;last week&#x27; is not a UTC date" in html
    assert 'id="before_start" name="before_start" value="last week"' in html
    assert 'aria-invalid="true" aria-describedby="after_end-error"' in html
    assert "the window is empty: after_end equals after_start (2026-11-09T00:00Z)" in html
    assert 'id="result"' not in html
