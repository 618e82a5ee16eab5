"""One set of numbers (issue 33, finding 7): the week report's people and jobs add up to its
total to the cent, and each job's cost is what `billed/jobs` shows for the same window. They
were each rounded on their own (rows summing to 1,045.19 under a total of 1,045.17, 7 of 16 jobs
a cent off `billed/jobs`); now each statement line's amount is shared out once, by largest
remainders (`billing.selectors.apportion`)."""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal

import pytest

from billing.models import RateCard
from billing.selectors import billed_usage
from billing.week import team_week
from metering.models import UsageHour
from teams.models import Team
from tests.billing.test_week_report import WEEK, H, _rows
from tests.factories import AllocationFactory, DeviceFactory

pytestmark = pytest.mark.django_db

# An hour of an H100 at 2.80 USD, idle at half price, 12,858 ms busy: 1.4050003 USD exactly,
# 1.41 rounded on its own; three of them are 4.2150009, 4.22 rounded once, not 4.23.
BUSY_MS = 12_858


def test_the_weeks_people_and_jobs_add_up_to_its_total_and_to_billed_jobs() -> None:
    team = Team.objects.create(slug="vision", name="Vision")
    RateCard.objects.create(
        product_name="NVIDIA H100 80GB HBM3",
        per_gpu_hour=Decimal("2.80"),
        idle_factor=Decimal("0.5"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    rows = []
    for person in ("ana", "ben", "cara"):
        allocation = AllocationFactory.create(
            device=DeviceFactory.create(),
            claim__namespace="vision",
            claim__name=f"{person}-gpu",
            start=WEEK,
            end=WEEK + timedelta(hours=1),
            team=team,
        )
        rows += _rows(
            allocation, user=person, job=f"Job/{person}", first=WEEK, hours=[(H, BUSY_MS, 0)]
        )
    UsageHour.objects.bulk_create(rows)

    week = team_week(team=team, start=WEEK, now=WEEK + timedelta(days=8), budget=None)

    (total,) = week.totals
    assert total.week.cost == {"USD": Decimal("4.22")}
    assert sum(row.week.cost["USD"] for row in week.people) == Decimal("4.22")
    assert sum(row.week.cost["USD"] for row in week.jobs) == Decimal("4.22")
    billed = billed_usage(teams=[team], since=WEEK, until=WEEK + timedelta(days=7))
    assert {row.name: row.week.cost["USD"] for row in week.jobs} == {
        row.job: row.billed for row in billed.jobs
    }
    # Largest remainders: two of the three get 1.41, one 1.40.
    assert sorted(row.week.cost["USD"] for row in week.people) == [
        Decimal("1.40"),
        Decimal("1.41"),
        Decimal("1.41"),
    ]
