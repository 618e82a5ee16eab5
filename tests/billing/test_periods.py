"""Billing periods: calendar months in UTC, or ISO weeks with TALLY_BILLING_PERIOD=week, and
the close of the previous period on TALLY_CLOSE_PERIOD_DAY."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from pytest_django.fixtures import SettingsWrapper

from billing import periods, pricing, services, tasks
from billing.models import Period, Statement
from teams.models import AuditEntry, Team
from tests.billing.test_chargeback import T10, scenario

pytestmark = pytest.mark.django_db
__all__ = ["scenario"]


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


@pytest.fixture
def weekly(settings: SettingsWrapper) -> SettingsWrapper:
    settings.TALLY_BILLING_PERIOD = "week"
    return settings


def test_a_month_is_the_calendar_month_in_utc() -> None:
    moment = datetime.fromisoformat("2026-12-31T23:30:00-02:00")  # 2027-01-01 01:30 UTC
    assert periods.period_bounds(moment) == (utc(2027, 1, 1), utc(2027, 2, 1))
    assert periods.period_bounds(utc(2026, 12, 31, 23)) == (utc(2026, 12, 1), utc(2027, 1, 1))
    assert periods.period_label(utc(2026, 11, 1), utc(2026, 12, 1)) == "2026-11"


def test_a_week_starts_monday_0000_utc(weekly: SettingsWrapper) -> None:
    # Thursday 2026-11-19 and Sunday 23:59 are in the week of Monday 2026-11-16 (ISO week 47).
    for moment in (utc(2026, 11, 19, 12), utc(2026, 11, 22, 23, 59), utc(2026, 11, 16)):
        assert periods.period_bounds(moment) == (utc(2026, 11, 16), utc(2026, 11, 23))
    assert periods.period_label(utc(2026, 11, 16), utc(2026, 11, 23)) == "2026-W47"
    # The ISO week of 2027-01-01 (a Friday) is 2026's 53rd.
    assert periods.period_bounds(utc(2027, 1, 1)) == (utc(2026, 12, 28), utc(2027, 1, 4))
    assert periods.period_label(utc(2026, 12, 28), utc(2027, 1, 4)) == "2026-W53"


def test_period_text_names_a_period_of_the_configured_length(settings: SettingsWrapper) -> None:
    assert periods.parse_period("2026-11") == (utc(2026, 11, 1), utc(2026, 12, 1))
    assert periods.parse_period(" 2026-12 ") == (utc(2026, 12, 1), utc(2027, 1, 1))
    with pytest.raises(periods.PricingError, match=r"'2026-W47' names a week, but billing"):
        periods.parse_period("2026-W47")
    settings.TALLY_BILLING_PERIOD = "week"
    assert periods.parse_period("2026-W47") == (utc(2026, 11, 16), utc(2026, 11, 23))
    assert periods.parse_period("2026-w01") == (utc(2025, 12, 29), utc(2026, 1, 5))
    with pytest.raises(periods.PricingError) as raised:
        periods.parse_period("2026-11")
    assert str(raised.value) == (
        "'2026-11' names a month, but billing periods are weeks (TALLY_BILLING_PERIOD=week): "
        "give the period as 2026-W47"
    )


@pytest.mark.parametrize(
    ("length", "text", "message"),
    [
        ("month", "2026-13", "'2026-13' is not a month: month must be in 1..12"),
        ("month", "november", "'november' is not a period; billing periods are months: give"),
        ("month", "2026-1", "'2026-1' is not a period; billing periods are months"),
        ("week", "2027-W53", "'2027-W53' is not a week: Invalid week: 53"),
        ("week", "2026-W00", "'2026-W00' is not a week"),
        ("week", "W47", "'W47' is not a period; billing periods are weeks: give the period as"),
    ],
)
def test_bad_period_text_is_refused_with_the_form_wanted(
    settings: SettingsWrapper, length: str, text: str, message: str
) -> None:
    settings.TALLY_BILLING_PERIOD = length
    with pytest.raises(periods.PricingError) as raised:
        periods.parse_period(text)
    assert str(raised.value).startswith(message)


def test_weekly_periods_are_stored_as_weeks(weekly: SettingsWrapper) -> None:
    period = pricing.period_for(utc(2026, 11, 19, 12))
    assert (period.start, period.end) == (utc(2026, 11, 16), utc(2026, 11, 23))
    assert pricing.period_for(utc(2026, 11, 22, 23)) == period


def test_changing_the_period_length_over_stored_periods_is_an_error(
    settings: SettingsWrapper,
) -> None:
    pricing.period_for(utc(2026, 11, 5))  # November, a month
    settings.TALLY_BILLING_PERIOD = "week"
    with pytest.raises(periods.PricingError) as raised:
        pricing.period_for(utc(2026, 11, 19))
    assert str(raised.value) == (
        "TALLY_BILLING_PERIOD=week makes 2026-W47 the period 2026-11-16..2026-11-23, but the "
        "stored period 2026-11 (2026-11-01..2026-12-01) overlaps it: the period length cannot "
        "change once periods are stored"
    )
    # A week starting on the month's first day (2027-03-01 is a Monday) is no way around it.
    settings.TALLY_BILLING_PERIOD = "month"
    pricing.period_for(utc(2027, 3, 10))
    settings.TALLY_BILLING_PERIOD = "week"
    with pytest.raises(periods.PricingError, match=r"2027-W09 the period 2027-03-01\.\.2027-03-08"):
        pricing.period_for(utc(2027, 3, 2))
    assert Period.objects.count() == 2


def test_the_previous_month_closes_on_the_configured_day(
    scenario: Team, settings: SettingsWrapper
) -> None:
    settings.TALLY_CLOSE_PERIOD_DAY = 3
    # Before the 3rd of November, October stays open.
    assert services.close_due_period(now=utc(2026, 11, 2, 23, 59), actor="beat") is None
    assert not Period.objects.filter(closed_at__isnull=False).exists()
    run = services.close_due_period(now=utc(2026, 11, 3, 0, 20), actor="beat")
    assert run is not None and run.closed
    october = Period.objects.get(start=utc(2026, 10, 1))
    assert (october.closed_by, october.closed_at is not None) == ("beat", True)
    entry = AuditEntry.objects.get(object_type="period")
    assert (entry.actor, entry.action, entry.object_repr) == ("beat", "update", str(october))
    assert run.period_hours == 31 * 24
    (statement,) = Statement.objects.filter(period=october)
    assert statement.total == Decimal("6.00")
    # Every later run that month finds nothing to do, and changes nothing.
    closed_at = october.closed_at
    assert services.close_due_period(now=utc(2026, 11, 20), actor="beat") is None
    october.refresh_from_db()
    assert (october.closed_at, october.closed_by) == (closed_at, "beat")


def test_a_period_finance_closed_first_is_left_alone(
    scenario: Team, settings: SettingsWrapper
) -> None:
    settings.TALLY_CLOSE_PERIOD_DAY = 1
    october = pricing.period_for(T10)
    services.close_period(period=october, actor="finance")
    assert services.close_due_period(now=utc(2026, 11, 1, 0, 20), actor="beat") is None
    october.refresh_from_db()
    assert october.closed_by == "finance"


def test_closing_can_be_turned_off(scenario: Team, settings: SettingsWrapper) -> None:
    settings.TALLY_CLOSE_PERIOD_DAY = 0
    assert services.close_due_period(now=utc(2026, 11, 25), actor="beat") is None
    assert not Period.objects.exists()


def test_the_previous_week_closes_on_the_configured_weekday(
    scenario: Team, weekly: SettingsWrapper
) -> None:
    weekly.TALLY_CLOSE_PERIOD_DAY = 3  # Wednesday
    # T10 (Thursday 2026-10-15) is in ISO week 42, 2026-10-12..2026-10-19.
    assert services.close_due_period(now=utc(2026, 10, 20, 23), actor="beat") is None  # Tuesday
    run = services.close_due_period(now=utc(2026, 10, 21, 1), actor="beat")  # Wednesday
    assert run is not None
    assert periods.period_label(run.period.start, run.period.end) == "2026-W42"
    assert run.totals == {"USD": Decimal("6.00")}
    assert run.period.is_closed


def test_bill_period_refuses_before_writing(scenario: Team) -> None:
    now = timezone.now()
    next_month = periods.period_bounds(periods.period_bounds(now)[1])[0]
    with pytest.raises(periods.PricingError, match="has not started yet"):
        services.bill_period(period_start=next_month, now=now)
    with pytest.raises(periods.PricingError, match="cannot be closed before it ends"):
        services.bill_period(period_start=now, now=now, close=True, actor="x")
    assert not Period.objects.exists()


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"TALLY_BILLING_PERIOD": "fortnight"}, "TALLY_BILLING_PERIOD='fortnight' must be one of"),
        ({"TALLY_CLOSE_PERIOD_DAY": "29"}, "TALLY_CLOSE_PERIOD_DAY=29 must be at most 28"),
        (
            {"TALLY_BILLING_PERIOD": "week", "TALLY_CLOSE_PERIOD_DAY": "8"},
            "TALLY_CLOSE_PERIOD_DAY=8 must be at most 7 when TALLY_BILLING_PERIOD=week",
        ),
    ],
)
def test_bad_period_settings_stop_the_process_naming_the_variable(
    environment: dict[str, str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; settings.INSTALLED_APPS"],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", **environment},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_the_admin_lists_periods_by_the_name_the_commands_take(
    weekly: SettingsWrapper, admin_client: Client
) -> None:
    pricing.period_for(utc(2026, 11, 19))
    listing = admin_client.get("/admin/billing/period/")
    assert listing.status_code == 200
    assert "2026-W47" in listing.content.decode()


def test_period_holding_takes_the_stored_period_whatever_its_length(
    weekly: SettingsWrapper,
) -> None:
    """What a budget counts in: the stored period holding the moment, else the configured
    one less what stored periods hold, never written and never refused."""
    # Nothing stored: the configured week, unsaved.
    week = pricing.period_holding(utc(2026, 11, 19, 12))
    assert (week.pk, week.start, week.end) == (None, utc(2026, 11, 16), utc(2026, 11, 23))
    assert not Period.objects.exists()
    # November stored as a month before billing turned weekly: it holds its days.
    weekly.TALLY_BILLING_PERIOD = "month"
    november = pricing.period_for(utc(2026, 11, 5))
    weekly.TALLY_BILLING_PERIOD = "week"
    assert pricing.period_holding(utc(2026, 11, 19, 12)) == november
    # The week of Monday 2026-11-30 overlaps November: it counts from December on.
    december = pricing.period_holding(utc(2026, 12, 2))
    assert (december.pk, december.start, december.end) == (None, utc(2026, 12, 1), utc(2026, 12, 7))
    assert december.label == "2026-12-01..2026-12-07"
    assert Period.objects.count() == 1


def test_a_period_is_labelled_as_the_commands_name_it() -> None:
    assert Period(start=utc(2026, 11, 1), end=utc(2026, 12, 1)).label == "2026-11"
    assert Period(start=utc(2026, 11, 16), end=utc(2026, 11, 23)).label == "2026-W47"


def test_beat_closes_every_ended_period_left_open_oldest_first(
    scenario: Team, settings: SettingsWrapper
) -> None:
    """`run_billing` for an old period opens it; beat's close then closes it too, not only the
    previous period, so that no ended period stays open for ever."""
    settings.TALLY_CLOSE_PERIOD_DAY = 3
    now = utc(2026, 12, 3, 0, 20)
    services.bill_period(period_start=utc(2026, 11, 1), now=now, close=True, actor="finance")
    services.bill_period(period_start=utc(2025, 1, 1), now=now)  # opened after November closed
    services.bill_period(period_start=T10, now=now)  # October, before the fix left open too

    runs = services.close_due_periods(now=now, actor="beat")

    assert [run.period.label for run in runs] == ["2025-01", "2026-10"]
    assert all(run.closed for run in runs)
    assert list(Period.objects.order_by("start").values_list("closed_by", flat=True)) == [
        "beat",
        "beat",
        "finance",
    ]
    (statement,) = Statement.objects.filter(period__start=utc(2026, 10, 1))
    assert statement.total == Decimal("6.00")
    # The next hourly run finds nothing to do.
    assert services.close_due_periods(now=utc(2026, 12, 3, 1, 20), actor="beat") == []


def test_an_old_period_waits_for_its_close_day_and_stays_open_when_closing_is_off(
    scenario: Team, settings: SettingsWrapper
) -> None:
    settings.TALLY_CLOSE_PERIOD_DAY = 0
    services.bill_period(period_start=utc(2025, 1, 1), now=utc(2026, 11, 2))
    assert services.close_due_periods(now=utc(2026, 11, 2), actor="beat") == []
    settings.TALLY_CLOSE_PERIOD_DAY = 3
    # September's close was due on 3 October; October's is not yet on 2 November.
    services.bill_period(period_start=utc(2026, 9, 1), now=utc(2026, 11, 2))
    services.bill_period(period_start=utc(2026, 10, 1), now=utc(2026, 11, 2))
    # Beat's task names them, oldest first.
    assert tasks.close_previous_period(now=utc(2026, 11, 2).isoformat()) == "2025-01, 2026-09"
    assert not Period.objects.get(start=utc(2026, 10, 1)).is_closed


def test_run_billing_of_an_ended_period_says_when_beat_closes_it(
    scenario: Team, settings: SettingsWrapper
) -> None:
    settings.TALLY_CLOSE_PERIOD_DAY = 0
    output = StringIO()
    call_command("run_billing", "--period", "2025-01", stdout=output)
    assert output.getvalue().splitlines()[-1] == (
        "Period 2025-01 has ended but is open: beat does not close periods "
        "(TALLY_CLOSE_PERIOD_DAY=0); to close it now, run "
        "`python manage.py run_billing --period 2025-01 --close`."
    )
