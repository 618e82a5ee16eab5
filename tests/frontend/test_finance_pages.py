"""Finance's home and its close action, and the operators' home (issue 35, finding 7: both were
bare team lists; finance, not staff, could close a period only through the API)."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from itertools import pairwise

import pytest
from django.test import Client
from django.urls import reverse

from billing import pricing
from billing.models import Period, Statement
from billing.pricing import round_money
from frontend.finance import TREND_CSV_COLUMNS, TREND_PERIODS
from teams.models import AuditEntry
from tests.frontend.seed import Portal


def _client(portal: Portal, who: str, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(portal.users[who])
    return client


def _reopen(period: Period) -> None:
    Period.objects.filter(pk=period.pk).update(closed_at=None, closed_by="")


def _total(team_id: int, period: Period) -> str:
    statement = Statement.objects.get(team_id=team_id, period=period)
    return f"{round_money(statement.total, statement.currency)} {statement.currency}"


def test_finance_home_shows_each_teams_spend_in_the_open_and_the_last_period(
    portal: Portal,
) -> None:
    response = _client(portal, "finance").get(reverse("home"))
    assert response.status_code == 200
    page = response.content.decode()
    open_period = pricing.period_holding(portal.now)
    spend = {row.team.slug: row for row in response.context["spend"]}
    assert set(spend) == {"vision", "nlp"}
    for team in (portal.team_a, portal.team_b):
        row = spend[team.slug]
        assert f"{row.open['USD']} USD" == _total(team.pk, open_period)
        assert f"{row.last['USD']} USD" == _total(team.pk, portal.closed_period)
        assert _total(team.pk, open_period) in page
        assert _total(team.pk, portal.closed_period) in page
    # Each period's state and closing day.
    states = response.context["periods"]
    assert [period.label for period in states[:2]] == [
        open_period.label,
        portal.closed_period.label,
    ]
    assert states[0].state == "open" and states[0].closes_on is not None
    assert states[1].state == "closed" and states[1].closed_by == "finance"
    assert f"{states[0].closes_on:%Y-%m-%d}" in page
    # Nothing to close: the last period is closed already.
    assert reverse("period-close", args=[portal.closed_period.pk]) not in page


def test_finance_trend_covers_six_periods_and_its_csv_is_the_same_table(portal: Portal) -> None:
    client = _client(portal, "finance")
    periods = client.get(reverse("home")).context["periods"]
    assert len(periods) == TREND_PERIODS
    # Newest first, each period ending where the next one starts.
    assert all(newer.start == older.end for newer, older in pairwise(periods))
    closed = next(period for period in periods if period.label == portal.closed_period.label)
    expected = sum(
        (s.total for s in Statement.objects.filter(period=portal.closed_period)), Decimal(0)
    )
    assert closed.totals == {"USD": round_money(expected, "USD")}
    assert closed.bars["USD"] > 0
    # Periods before the seed's billed nothing: no row stored, no statement, still listed.
    assert periods[-1].stored is None and periods[-1].totals == {}

    response = client.get(reverse("period-trend-csv"))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert tuple(rows[0]) == TREND_CSV_COLUMNS
    assert [row["period"] for row in rows] == [period.label for period in periods]
    by_label = {row["period"]: row for row in rows}
    assert by_label[closed.label]["total"] == f"{closed.totals['USD']:f}"
    assert by_label[closed.label]["state"] == "closed"
    assert by_label[periods[-1].label]["total"] == "0"
    assert by_label[periods[-1].label]["state"] == "not billed"
    assert by_label[periods[-1].label]["closes_on"] == ""


def test_finance_closes_an_ended_period_after_a_confirmation_and_it_is_audited(
    portal: Portal,
) -> None:
    period = portal.closed_period
    _reopen(period)
    client = _client(portal, "finance", csrf=True)
    home = client.get(reverse("home")).content.decode()
    url = reverse("period-close", args=[period.pk])
    assert url in home  # offered, as it has ended and is open

    confirm = client.get(url)
    assert confirm.status_code == 200
    page = confirm.content.decode()
    # What will be frozen: each team's statement as it stands, and the form that posts.
    assert _total(portal.team_a.pk, period) in page and _total(portal.team_b.pk, period) in page
    assert "csrfmiddlewaretoken" in page and f'action="{url}"' in page
    period.refresh_from_db()
    assert not period.is_closed  # a GET closes nothing

    # Without the form's token the POST is refused and nothing closes.
    assert client.post(url).status_code == 403
    period.refresh_from_db()
    assert not period.is_closed

    token = confirm.context["csrf_token"]
    done = client.post(url, {"csrfmiddlewaretoken": str(token)}, follow=True)
    assert done.status_code == 200
    assert f"Closed {period.label}" in done.content.decode()
    period.refresh_from_db()
    assert period.is_closed and period.closed_by == "finance"
    entry = AuditEntry.objects.filter(object_type="period", actor="finance").latest("at")
    assert entry.action == "update" and entry.after is not None
    assert entry.after["closed_by"] == "finance"


def test_closing_an_open_or_closed_period_says_why_and_changes_nothing(portal: Portal) -> None:
    client = _client(portal, "finance")
    closed = portal.closed_period
    answer = client.get(reverse("period-close", args=[closed.pk]))
    assert answer.status_code == 400
    assert "cannot be closed" in answer.content.decode()
    assert "close-form" not in answer.content.decode()

    running = pricing.period_for(portal.now)
    answer = client.get(reverse("period-close", args=[running.pk]))
    assert answer.status_code == 400 and "has not ended yet" in answer.content.decode()
    done = client.post(reverse("period-close", args=[running.pk]), follow=True)
    assert "was not closed" in done.content.decode()
    running.refresh_from_db()
    assert not running.is_closed

    assert client.get(reverse("period-close", args=[999_999])).status_code == 404


@pytest.mark.parametrize("who", ["lead_a", "member_a", "operator"])
def test_only_finance_closes_in_the_portal(portal: Portal, who: str) -> None:
    period = portal.closed_period
    _reopen(period)
    client = _client(portal, who)
    url = reverse("period-close", args=[period.pk])
    assert client.get(url).status_code == 403
    assert client.post(url).status_code == 403
    assert client.get(reverse("period-trend-csv")).status_code == 403
    period.refresh_from_db()
    assert not period.is_closed


def test_anonymous_users_log_in_before_the_close(portal: Portal) -> None:
    url = reverse("period-close", args=[portal.closed_period.pk])
    response = Client().post(url)
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_operators_home_summarises_the_fleet(portal: Portal) -> None:
    response = _client(portal, "operator").get(reverse("home"))
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="fleet-summary"' in page
    [summary] = response.context["clusters"]
    assert summary.cluster == portal.cluster
    gpus = summary.units[0]
    assert gpus["units"] == gpus["allocated"] + gpus["free"] > 0
    assert f"{gpus['units']} GPUs: {gpus['allocated']} allocated" in page
    # The seed's decisions in the last day: every third denied.
    assert response.context["denials"] == 20
    assert reverse("fleet-week") in page and reverse("fleet-deviations") in page
    # The teams are still listed.
    assert reverse("team", args=["vision"]) in page
