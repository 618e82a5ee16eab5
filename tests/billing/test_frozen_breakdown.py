"""A closed period is its frozen statement on every surface (issue 33, finding 7): per person
and per job, a closed month showed its usage rows priced now (3,369.88 for nlp under a frozen
18.07, the rest billed as a December adjustment; 1,572.00 for recsys, which has no November
statement). Now the breakdowns share out the frozen lines, and add up to them exactly."""

from __future__ import annotations

from datetime import timedelta

import pytest

from billing import services
from billing.models import LineKind, Statement, StatementLine
from billing.selectors import billed_usage
from metering.hours import MS_PER_HOUR
from teams.models import Team
from tests.billing.test_ledger import hold, month, seed_billing
from tests.factories import DeviceFactory

pytestmark = pytest.mark.django_db

DECEMBER, JANUARY = month(2024, 12), month(2025, 1)


def test_a_closed_periods_people_and_jobs_are_its_frozen_statement() -> None:
    nlp = Team.objects.create(slug="nlp", name="NLP")
    recsys = Team.objects.create(slug="recsys", name="Recsys")
    seed_billing([nlp])  # December closed with 3 hours; 2 more of its hours came after
    hold(DeviceFactory.create(), recsys, DECEMBER + timedelta(hours=9), hours=4)  # after too
    frozen = StatementLine.objects.filter(
        statement__team=nlp, statement__period__start=DECEMBER, kind=LineKind.USAGE
    )
    (line,) = frozen
    assert line.allocated_gpu_hours == 3

    usage = billed_usage(teams=[nlp, recsys], since=DECEMBER, until=JANUARY)

    assert {row.team for row in usage.people} == {"nlp"}  # recsys: no December statement
    for rows in (usage.people, usage.jobs):
        assert sum(row.billed or 0 for row in rows) == line.amount
        assert sum(row.allocated_ms for row in rows) == 3 * MS_PER_HOUR
    # The late hours are billed where they were: January's adjustments, not December's rows.
    services.bill_period(period_start=JANUARY, now=JANUARY + timedelta(days=1))
    adjustment = StatementLine.objects.get(
        statement__team=nlp, kind=LineKind.ADJUSTMENT, corrects_period__start=DECEMBER
    )
    assert adjustment.allocated_gpu_hours == 2
    assert not Statement.objects.filter(team=recsys, period__start=DECEMBER).exists()
