"""The week report's page and CSV, and the fleet's week heatmap: who sees what, the figures,
and bad input. The scenario is the week report's (tests/billing/test_week_report.py)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import Any

import pytest
import time_machine
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse

from teams.models import Team
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP
from tests.billing.test_week_report import NOW, build_week_scenario

pytestmark = pytest.mark.django_db

START = "?start=2026-11-16"
# The same however much usage: since the week's people, jobs and total take their money from
# the billed usage (issue 33: one rounding rule with the statements), each of the week's
# periods reads its period, rate cards and rows; and the idle rule in force (issue 35).
QUERIES = 25


@pytest.fixture(autouse=True)
def _clock() -> Iterator[None]:
    with time_machine.travel(NOW, tick=False):
        yield


@pytest.fixture
def team() -> Team:
    team = build_week_scenario()
    User.objects.create_user("member_only")  # a member of no team as lead: no role
    for name, group in (("operator", OPERATORS_GROUP), ("finance", FINANCE_GROUP)):
        user = User.objects.create_user(name)
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return team


def _client(username: str) -> Client:
    client = Client()
    client.force_login(User.objects.get(username=username))
    return client


def test_a_lead_sees_their_teams_week(team: Team, django_assert_max_num_queries: Any) -> None:
    client = _client("lead_a")
    # Two reads of usage, a rate card per model and day used (at most 14 days), the budget,
    # the session: never per hour, person or claim.
    with django_assert_max_num_queries(QUERIES):
        response = client.get(reverse("team-week", args=["vision"]) + START)
    assert response.status_code == 200
    page = response.content.decode()
    assert "Vision: the week from Mon 16 Nov 2026" in page
    assert "109.80 USD" in page and "+88.80 USD" in page
    people = page[page.index('id="week-people"') : page.index('id="jobs-heading"')]
    assert people.index(">ben<") < people.index(">ana<")  # most allocated first
    assert "66.40 USD" in people and "+45.40 USD" in people
    idle = page[page.index('id="week-idle"') : page.index('id="budget-heading"')]
    assert "ben-notebook" in idle and "28 h" in idle and "Tue 02:00" in idle
    assert "68.29</strong> of 200 GPU-hours used in 2026-11" in page


def test_the_default_is_the_last_complete_week(team: Team) -> None:
    page = _client("lead_a").get(reverse("team-week", args=["vision"])).content.decode()
    assert "the week from Mon 16 Nov 2026" in page
    assert 'href="?start=2026-11-09" rel="prev"' in page
    assert 'href="?start=2026-11-23" rel="next"' in page  # it has started


def test_a_lead_sees_no_other_team(team: Team) -> None:
    assert _client("lead_b").get(reverse("team-week", args=["vision"])).status_code == 404
    assert _client("lead_b").get(reverse("team-week-csv", args=["vision"])).status_code == 404
    assert _client("lead_a").get(reverse("team-week", args=["nope"])).status_code == 404
    # A member who leads nothing has no role in the portal.
    assert _client("member_a").get(reverse("team-week", args=["vision"])).status_code == 403
    assert _client("member_only").get(reverse("team-week", args=["vision"])).status_code == 403


def test_finance_and_operators_see_every_team(team: Team) -> None:
    for who in ("finance", "operator"):
        assert _client(who).get(reverse("team-week", args=["nlp"])).status_code == 200


def test_anonymous_users_log_in_first() -> None:
    for url in (reverse("team-week", args=["vision"]), reverse("fleet-week")):
        response = Client().get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_the_csv(team: Team) -> None:
    response = _client("lead_a").get(reverse("team-week-csv", args=["vision"]) + START)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert 'filename="tally-vision-week-2026-11-16.csv"' in response["Content-Disposition"]
    rows = {(r["section"], r["name"]): r for r in csv.DictReader(io.StringIO(response.text))}
    assert rows["person", "ben"]["cost"] == "43.40"
    assert rows["job", "Job/train-ana"]["previous_allocated_hours"] == "10.00"


@pytest.mark.parametrize(
    ("start", "message"),
    [
        ("2026-11-31", "start: &#x27;2026-11-31&#x27; is not a day like 2026-11-23"),
        ("2026-12-01", "start: 2026-12-01 is in the future"),
    ],
)
def test_a_bad_start_is_a_400_that_says_why(team: Team, start: str, message: str) -> None:
    client = _client("operator")
    for name, args in (("team-week", ["vision"]), ("fleet-week", [])):
        response = client.get(reverse(name, args=args) + f"?start={start}")
        assert response.status_code == 400
        assert message in response.content.decode()
    csv_response = client.get(reverse("fleet-week-csv") + f"?start={start}")
    assert csv_response.status_code == 400
    assert message.replace("&#x27;", "'") in csv_response.text


def test_only_operators_see_the_fleet_week(team: Team) -> None:
    for who in ("lead_a", "finance"):
        assert _client(who).get(reverse("fleet-week")).status_code == 403
        assert _client(who).get(reverse("fleet-week-csv")).status_code == 403


def test_the_fleet_heatmap(team: Team) -> None:
    response = _client("operator").get(reverse("fleet-week") + START)
    assert response.status_code == 200
    page = response.content.decode()
    allocated = page[page.index('id="heatmap-allocated"') : page.index('id="utilised-heading"')]
    utilised = page[page.index('id="heatmap-utilised"') :]
    # Two H100s on the node: ana's held all Monday (half the node), ben's from Tuesday.
    assert 'rgba(10,88,202,0.50)" title="gpu-h100-1 Mon 16 00:00: 1.00 of 2"' in allocated
    assert 'title="gpu-h100-1 Mon 16 00:00: 0.75 of 2"' in utilised
    assert 'rgba(10,88,202,0.37)" title="gpu-h100-1 Mon 16 00:00: 0.75 of 2"' in utilised
    assert 'title="gpu-h100-1 Sun 22 23:00: 0.00 of 2"' in allocated
    # The A100's 3/7 slice: 0.43 of its one GPU on Thursday 08:00.
    assert 'title="gpu-a100-1 Thu 19 08:00: 0.43 of 1"' in allocated
    assert allocated.count('<td class="heat') == 2 * 7 * 24


def test_the_fleet_csv(team: Team) -> None:
    response = _client("operator").get(reverse("fleet-week-csv") + START)
    assert response.status_code == 200
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert {row["node"] for row in rows} == {"gpu-h100-1", "gpu-a100-1"}
    monday = [r for r in rows if r["hour"] == "2026-11-16T00:00:00+00:00"]
    assert monday == [
        {
            "node": "gpu-h100-1",
            "unit": "gpu",
            "capacity": "2",
            "hour": "2026-11-16T00:00:00+00:00",
            "allocated": "1.00",
            "utilised": "0.75",
            "unmeasured": "0.00",
        }
    ]
    # 24 + 30 hours of the H100s (ben's overlap none of ana's) and 10 of the slice.
    assert len(rows) == 24 + 30 + 10


def test_the_fleet_week_is_in_the_operators_nav(team: Team) -> None:
    page = _client("operator").get(reverse("fleet")).content.decode()
    assert f'href="{reverse("fleet-week")}"' in page
    lead_page = _client("lead_a").get(reverse("team-week", args=["vision"])).content.decode()
    assert reverse("fleet-week") not in lead_page
