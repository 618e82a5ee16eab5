"""The team page per person and per job: billed cost as the statements bill it, CSV links to
the same figures, who holds idle devices now, and usage per unit (never GPU-hours + TPU
chip-hours added up). The week of tests/api/test_people_usage.py, ending a week ago."""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.conf import LazySettings
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing.selectors import IDLE_LOOKBACK
from inventory.models import Unit
from metering import ingest
from metering.hours import HOUR, MS_PER_HOUR, epoch_ms, hour_start
from metering.ingest import SampleRow
from quota.models import Budget
from teams.models import IdleAlertPolicy
from tests.api.cast import Cast, cast
from tests.api.test_people_usage import (
    EXPECTED_JOBS,
    EXPECTED_PEOPLE,
    Week,
    _allocation,
    _hours,
    week_scenario,
)

pytestmark = pytest.mark.django_db

__all__ = ["cast"]


def last_monday_but_one(now: datetime) -> datetime:
    """A Monday at least 14 days ago: its week is inside the page's 30-day window."""
    day = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    day -= timedelta(days=14)
    return day - timedelta(days=day.weekday())


@pytest.fixture
def week(cast: Cast, settings: LazySettings) -> Week:
    settings.TALLY_BILLING_PERIOD = "week"
    return week_scenario(cast.alpha, cast.beta, monday=last_monday_but_one(timezone.now()))


def _page(cast: Cast, who: str = "lead_a") -> tuple[Client, str, Any]:
    client = Client()
    client.force_login(getattr(cast, who))
    response = client.get(reverse("team", args=["alpha"]) + "?days=30")
    assert response.status_code == 200
    return client, response.content.decode(), response.context


def _table_row(html: str, table: str, text: str) -> str:
    found = re.search(rf'<table id="{table}".*?</table>', html, re.S)
    assert found is not None, f"no table {table}"
    rows = [row for row in re.findall(r"<tr>.*?</tr>", found[0], re.S) if text in row]
    assert len(rows) == 1, (table, text, rows)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", rows[0])).strip()


def test_people_and_jobs_are_billed_as_the_statements_bill(cast: Cast, week: Week) -> None:
    _, html, context = _page(cast)
    billing = context["billing"]
    got = {
        (row.username, row.unit): (f"{row.billed}", f"{row.billed_idle}") for row in billing.people
    }
    assert got == {key: (values[7], values[5]) for key, values in EXPECTED_PEOPLE.items()}
    assert {row.job: f"{row.billed}" for row in billing.jobs} == {
        job: values[4] for job, values in EXPECTED_JOBS.items()
    }
    # The people add up to the week's statement, to the cent.
    assert billing.billed == {"USD": week.statements["alpha"].total} == {"USD": Decimal("721.04")}
    assert billing.billed_idle == {"USD": Decimal("258.84")}  # 41.76 + 204.48 + 12.60
    assert _table_row(html, "people", "ben") == (
        "ben 168.00 GPU-hours 24.00 144.00 0.00 274.08 USD 204.48 USD"
    )
    assert _table_row(html, "people", "dan") == (
        "dan 8.00 TPU chip-hours 8.00 0.00 0.00 10.80 USD 0.00 USD"
    )
    assert _table_row(html, "people", "unknown").startswith("unknown 10.00 GPU-hours")
    assert _table_row(html, "jobs", "Deployment/notebook") == (
        "alpha-ml/ Deployment/notebook ana, ben 172.00 GPU-hours 28.00 144.00 0.00 "
        "286.48 USD 204.48 USD"
    )


def test_idle_cost_billed_first_list_price_only_as_context(cast: Cast, week: Week) -> None:
    _, html, context = _page(cast)
    found = re.search(r'<p class="stat" id="idle-billed">(.*?)</p>', html, re.S)
    assert found is not None
    stat = re.sub(r"\s+", " ", found[1])
    assert "billed <strong>258.84 USD</strong> (of 721.04 USD billed" in stat
    # At the last day's list price: 180 idle H100-hours x 3.10 + 24 idle slice-hours x 1.05.
    assert context["idle"].totals == {"USD": Decimal("583.20")}
    note = re.search(r'<p class="note" id="idle-list-price">(.*?)</p>', html, re.S)
    assert note is not None and "583.20 USD" in note[1] and "not what is billed" in note[1]
    # The list price is larger than what idle is billed: never the headline.
    assert "worth" not in stat


def test_csv_links_give_the_tables_figures(cast: Cast, week: Week) -> None:
    client, html, context = _page(cast)
    for key, column in (("people", "username"), ("jobs", "job")):
        url = context["billing_csv"][key]
        assert f'href="{url}"'.replace("&", "&amp;") in html
        response = client.get(url)
        assert response.status_code == 200, response.content
        rows = list(csv.DictReader(io.StringIO(response.content.decode())))
        assert sum(Decimal(row["billed"]) for row in rows) == Decimal("721.04")
        shown = getattr(context["billing"], key)
        assert [row[column] for row in rows] == [getattr(row, column) for row in shown]


def test_usage_is_shown_per_unit(cast: Cast, week: Week) -> None:
    _, html, context = _page(cast)
    units = {usage.unit: usage for usage in context["usage_units"]}
    assert list(units) == [Unit.GPU, Unit.TPU]
    assert (units[Unit.TPU].allocated, units[Unit.TPU].utilised) == (Decimal(8), Decimal(8))
    # 144 + 168 + 4 + 24 (the slice) + 10 GPU-hours; TPU chip-hours apart.
    assert units[Unit.GPU].allocated == Decimal(350)
    assert "<strong>8.00</strong> of 8.00 allocated TPU chip-hours utilised." in html
    assert "<strong>148.00</strong> of 350.00 allocated GPU-hours utilised." in html
    assert 'id="usage-table-tpu"' in html and 'id="usage-table"' in html
    # The chart is of GPU-hours only.
    assert sum(context["chart_data"]["usage"]["allocated"]) == 350


def test_budget_counts_its_own_unit(cast: Cast, week: Week) -> None:
    Budget.objects.create(team=week.alpha, gpu_hours=Decimal(100), unit=Unit.TPU)
    _, html, context = _page(cast)
    burn = context["burn"]
    assert burn.hours == "TPU chip-hours"
    assert "of 100 TPU chip-hours used" in html
    assert "Remaining (TPU chip-h)" in html
    # The team's GPU-hours never count toward it; its TPU hours were rolled up in an earlier
    # week, so only what its open TPU allocation has held since the hour before this one
    # counts (the hour just ended may not be rolled up yet).
    assert all(day.used in (None, Decimal(0)) for day in burn.days)
    assert 0 <= burn.used <= 2


def test_who_holds_idle_devices_now(cast: Cast, week: Week) -> None:
    now = timezone.now()
    current = hour_start(now)
    # gil: busy until five hours ago, then four idle hours (1% utilised).
    gil = _allocation("alpha-ml", "gil-train", start=current - timedelta(hours=9))
    _hours(
        gil,
        week.alpha,
        start=current - timedelta(hours=9),
        hours=4,
        username="gil",
        job="Job/gil-train",
        utilised=MS_PER_HOUR,
    )
    _hours(
        gil,
        week.alpha,
        start=current - timedelta(hours=5),
        hours=4,
        username="gil",
        job="Job/gil-train",
        utilised=MS_PER_HOUR // 100,
    )
    # hal: idle hours too, but computing again since (a sample after its last hour).
    hal = _allocation("alpha-ml", "hal-train", start=current - timedelta(hours=9))
    _hours(
        hal,
        week.alpha,
        start=current - timedelta(hours=3),
        hours=2,
        username="hal",
        job="Job/hal-train",
    )
    ingest.ingest(
        node="node-a",
        samples=[SampleRow(hal.meter_id, epoch_ms(current - HOUR) + 60_000, 87.0, None, None)],
        received_at=now,
    )
    _, html, context = _page(cast)
    holders = {holder.claim_name: holder for holder in context["idle_now"]}
    assert "hal-train" not in holders
    assert holders["gil-train"].idle_since == current - timedelta(hours=5)
    assert holders["gil-train"].username == "gil" and holders["gil-train"].job == "Job/gil-train"
    assert holders["gil-train"].devices == [gil.device_name]
    # ben's notebook has idled since the week's Tuesday; when that is further back than the
    # hours read, since the first of them ("before").
    notebook = holders["notebook"]
    tuesday = week.period.start + timedelta(days=1)
    assert notebook.username == "ben" and notebook.job == "Deployment/notebook"
    if notebook.since_clipped:
        # (On a Tuesday's first hour the hours read begin at that Tuesday's midnight itself.)
        assert notebook.idle_since == current - IDLE_LOOKBACK >= tuesday
    else:
        assert notebook.idle_since == tuesday
    # Busy or unmeasured at the end: not idle.
    assert {"resnet-0", "resnet-1", "sweep", "tpu", "legacy", "notebook-ana"}.isdisjoint(holders)
    row = _table_row(html, "idle-holders", "gil-train")
    assert row.startswith("gil Job/gil-train alpha-ml/ gil-train")
    assert f"{(current - timedelta(hours=5)):%Y-%m-%d %H:%M}" in row


def test_the_teams_idle_alert_threshold_says_what_idle_is(cast: Cast, week: Week) -> None:
    """The team's `idleAlert.belowPercent` decides which hours count as idle on the page, as
    it does for the alerts: gil's hours at 1% are idle under 5% (the default), not under 0.5%."""
    current = hour_start(timezone.now())
    gil = _allocation("alpha-ml", "gil-train", start=current - timedelta(hours=4))
    _hours(
        gil,
        week.alpha,
        start=current - timedelta(hours=4),
        hours=4,
        username="gil",
        job="Job/gil-train",
        utilised=MS_PER_HOUR // 100,
    )
    _, _, context = _page(cast)
    assert context["idle_below_percent"] == 5
    assert "gil-train" in {holder.claim_name for holder in context["idle_now"]}

    IdleAlertPolicy.objects.create(team=week.alpha, below_percent=Decimal("0.5"), for_hours=4)
    _, _, context = _page(cast)
    assert context["idle_below_percent"] == Decimal("0.5")
    assert "gil-train" not in {holder.claim_name for holder in context["idle_now"]}


def test_the_page_costs_a_few_queries_more(
    cast: Cast, week: Week, django_assert_max_num_queries: Any
) -> None:
    client = Client()
    client.force_login(cast.lead_a)
    # test_pages pins the page at 28 with the seeded portal; the week's data costs no more.
    with django_assert_max_num_queries(28):
        assert client.get(reverse("team", args=["alpha"])).status_code == 200
