"""GPU-hour budgets in the admission webhook: hard denies, soft and 80% warn."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from pytest_django.fixtures import SettingsWrapper

from billing.hours import MS_PER_HOUR, hour_start
from billing.models import Period, UsageHour
from billing.periods import PricingError, period_bounds, period_label
from billing.pricing import period_for
from billing.selectors import team_gpu_hours
from quota.models import Budget
from teams.models import Team, TeamNamespace
from tests.factories import AllocationFactory, DeviceFactory, ResourceClaimFactory
from tests.quota.fixtures import claim, decide, gpu_request, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]


def used(team_hours: int, *, live_minutes: int = 0) -> None:
    """The team held `team_hours` GPU-hours in earlier hours of this period, and one GPU since
    `live_minutes` ago (not rolled up yet)."""
    now = timezone.now()
    device = DeviceFactory.create()
    claim_row = ResourceClaimFactory.create(cluster=device.cluster, namespace="research")
    allocation = AllocationFactory.create(
        cluster=device.cluster,
        claim=claim_row,
        device=device,
        start=now - timedelta(minutes=live_minutes),
        end=None if live_minutes else now,
        team=Team.objects.get(slug="research"),  # charged to the team owning "research"
    )
    period = period_for(now)
    earlier = max(period.start, hour_start(now) - timedelta(hours=1))
    if team_hours:
        UsageHour.objects.create(
            hour=earlier,
            allocation=allocation,
            cluster=device.cluster,
            device_uuid=device.uuid,
            gpu_share=1,
            namespace="research",
            claim_name=claim_row.name,
            team_id=Team.objects.get(slug="research").pk,
            allocated_gpu_ms=team_hours * MS_PER_HOUR,
            utilised_gpu_ms=0,
            unmeasured_gpu_ms=0,
        )


def test_hard_budget_denies_new_claims(client: Client, settings: Any) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0  # read the budget's use on every admission
    team = make_team([])
    Budget.objects.create(team=team, gpu_hours=Decimal(10), mode="hard")
    used(9)
    warned = decide(client, claim("a", [gpu_request(1)]))
    assert (
        warned["allowed"] and "has used 9.0 of its 10 GPU-hour hard budget" in warned["warnings"][0]
    )
    used(1)
    denied = decide(client, claim("b", [gpu_request(1)]))
    assert not denied["allowed"]
    assert denied["status"]["reason"] == "BudgetExceeded"
    assert (
        'team "research" has used 10.0 of its 10 GPU-hour hard budget'
        in denied["status"]["message"]
    )


def test_soft_budget_warns_past_it(client: Client) -> None:
    team = make_team([])
    Budget.objects.create(team=team, gpu_hours=Decimal(5), mode="soft")
    used(6)
    answer = decide(client, claim("a", [gpu_request(1)]))
    assert answer["allowed"]
    assert answer["warnings"][0].endswith("(past the soft budget)")


def test_usage_counts_open_allocations_not_yet_rolled_up() -> None:
    team = make_team([])
    used(0, live_minutes=30)
    now = timezone.now()
    hours = team_gpu_hours(team=team, period=period_for(now), now=now)
    expected = Decimal(min(30, now.minute + now.second / 60)) / 60
    assert abs(hours - expected) < Decimal("0.01")
    # Its namespace moved to another team since: still charged to the team it started with.
    TeamNamespace.objects.filter(namespace="research").update(team=make_team([], slug="other"))
    assert abs(team_gpu_hours(team=team, period=period_for(now), now=now) - hours) < Decimal("0.01")


def budget_warning(client: Client) -> str:
    """The warning an admission of the research team gets: its budget is 10 GPU-hours, of
    which it has used 9 (so every admission warns, naming the period)."""
    answer = decide(client, claim(f"c-{Period.objects.count()}", [gpu_request(1)]))
    assert answer["allowed"], answer
    (warning,) = [text for text in answer["warnings"] if "budget" in text]
    return str(warning)


@pytest.mark.parametrize(("stored", "configured"), [("month", "week"), ("week", "month")])
def test_stored_periods_of_another_length_never_fail_admission(
    client: Client, settings: SettingsWrapper, stored: str, configured: str
) -> None:
    """After TALLY_BILLING_PERIOD changed, `period_for` refuses the configured period over the
    stored ones; the webhook counts the budget in the stored period holding now instead."""
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    settings.TALLY_BILLING_PERIOD = stored
    Budget.objects.create(team=make_team([]), gpu_hours=Decimal(10), mode="hard")
    used(9)  # stores the period holding now, of the stored length
    now = timezone.now()
    settings.TALLY_BILLING_PERIOD = configured
    with pytest.raises(PricingError, match="the period length cannot change"):
        period_for(now)
    start, end = period_bounds(now, length=stored)
    assert f"has used 9.0 of its 10 GPU-hour hard budget for {period_label(start, end)}" in (
        budget_warning(client)
    )
    assert Period.objects.count() == 1


def test_the_budget_warning_names_a_week_as_the_commands_do(
    client: Client, settings: SettingsWrapper
) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    settings.TALLY_BILLING_PERIOD = "week"
    Budget.objects.create(team=make_team([]), gpu_hours=Decimal(10), mode="hard")
    used(9)
    Period.objects.all().delete()  # admission counts the budget without creating a period
    now = timezone.now()
    week = period_label(*period_bounds(now))
    assert week.startswith(f"{now.isocalendar().year}-W")
    assert f"10 GPU-hour hard budget for {week}" in budget_warning(client)
    assert not Period.objects.exists()
