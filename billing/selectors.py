"""Reads of usage and money, for the webhook (budgets), the portal and the API."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db.models import Sum

from billing.hours import MS_PER_HOUR, epoch_ms, hour_start
from billing.models import Period, UsageHour
from inventory.models import Allocation, Unit
from teams.models import Team


def team_gpu_hours(*, team: Team, period: Period, now: datetime, unit: str = Unit.GPU) -> Decimal:
    """Hours of `unit` (GPU-hours by default; TPU chip-hours, Gaudi card-hours) the team has
    held in the period so far: the rolled-up hours of that unit, plus what the open
    allocations of that unit charged to it (`Allocation.team`) have held since the last whole
    hour (not rolled up yet). Hours of other units are left out: they never add up with
    these."""
    current_hour = hour_start(now)
    rolled = (
        UsageHour.objects.filter(
            team=team, unit=unit, hour__gte=period.start, hour__lt=min(period.end, current_hour)
        ).aggregate(total=Sum("allocated_gpu_ms"))["total"]
        or 0
    )
    live = Decimal(0)
    since = max(current_hour, period.start)
    # The unit and share the allocation fixed when it started, as the rollup counts them.
    for start, share in Allocation.objects.filter(
        end__isnull=True, team=team, unit=unit
    ).values_list("start", "gpu_share"):
        held_from = max(start, since)
        if held_from < now:
            live += Decimal(epoch_ms(now) - epoch_ms(held_from)) * share
    return (Decimal(rolled) + live) / MS_PER_HOUR
