"""`/api/v1/billed/unowned/`: usage of no team, for finance and operators (issue 33, finding 1):
the hours of a namespace no team owned, per namespace and cluster, at list price; with the
teams' usage, the fleet's."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum

from metering.models import UsageHour
from tests.api.cast import Seeded, seed_usage

pytestmark = pytest.mark.django_db


def test_finance_sees_the_hours_no_team_owned_and_leads_do_not(seeded: Seeded) -> None:
    last = seeded.last
    # A namespace no team owns: its hours are nobody's (the rollup writes them with no team).
    seed_usage(seeded.cast.alpha, "scratch", last.start + timedelta(days=4), hours=2)
    UsageHour.objects.filter(namespace="scratch").update(team=None)
    url = "/api/v1/billed/unowned/"

    response = seeded.cast.client("finance").get(url, {"period": last.label})

    assert response.status_code == 200, response.content
    rows = response.json()["results"]
    assert [(row["namespace"], row["cluster"], row["currency"]) for row in rows] == [
        ("scratch", "cluster-0", "EUR")
    ]
    assert Decimal(rows[0]["allocated_gpu_hours"]) == 2
    assert rows[0]["list_price"] == "3.75"  # 2 h at 2.50, half of it idle at half price
    in_period = UsageHour.objects.filter(hour__gte=last.start, hour__lt=last.end)
    fleet = in_period.aggregate(ms=Sum("allocated_gpu_ms"))["ms"]
    teams = in_period.exclude(team=None).aggregate(ms=Sum("allocated_gpu_ms"))["ms"]
    assert teams + 2 * 3_600_000 == fleet  # team totals plus unowned: the fleet's
    for who, status in (("lead_a", 403), ("member_a", 403), ("operator", 200), (None, 401)):
        assert seeded.cast.client(who).get(url).status_code == status, who
