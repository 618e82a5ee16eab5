"""Hours to roll up again follow what the sync saw of claims and their allocations."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import services
from billing.pricing import period_holding
from billing.selectors import team_gpu_hours
from metering import dirty, rollup
from metering.hours import HOUR, MS_PER_HOUR, hour_start
from metering.models import DirtyHour, UsageHour
from teams.models import Team, TeamNamespace
from tests.billing.test_chargeback import SLICE, T10, claim, snapshot

pytestmark = pytest.mark.django_db


def test_claims_seen_mark_the_hours_their_allocations_span_once() -> None:
    # Two claims allocated at 10:00 and 10:30; the first ends at 12:10, the other at 11:20.
    snapshot([SLICE, claim("a", "gpu-0", T10)], T10)
    snapshot(
        [claim("a", "gpu-0", T10), claim("b", "gpu-1-mig-3g40gb-0", T10 + timedelta(minutes=30))],
        T10 + timedelta(minutes=30),
        kinds=["ResourceClaim"],
    )
    snapshot(
        [claim("a", "gpu-0", T10)], T10 + timedelta(hours=1, minutes=20), kinds=["ResourceClaim"]
    )
    snapshot([], T10 + timedelta(hours=2, minutes=10), kinds=["ResourceClaim"])
    hours = sorted(dirty.hour.hour for dirty in DirtyHour.objects.all())
    assert hours == [10, 11, 12]
    done = rollup.rollup_pending(now=T10 + timedelta(days=1))
    assert T10 in done and T10.replace(hour=12) in done
    assert not DirtyHour.objects.filter(hour__lt=T10 + timedelta(days=1)).exists()
    assert UsageHour.objects.filter(hour=T10.replace(hour=11)).count() == 2


def test_a_backlog_of_marked_hours_is_worked_off_newest_first_a_bounded_number_a_run() -> None:
    now = T10 + timedelta(days=1)
    marked = [T10 + timedelta(hours=index) for index in range(5)]
    dirty.mark_dirty(hours=set(marked), at=T10)
    just_ended = hour_start(now) - timedelta(hours=1)

    first = rollup.rollup_pending(now=now, limit=3)
    assert first == [just_ended, marked[4], marked[3]]
    assert sorted(DirtyHour.objects.values_list("hour", flat=True)) == marked[:3]

    second = rollup.rollup_pending(now=now, limit=3)
    assert second == [just_ended, marked[2], marked[1]]
    third = rollup.rollup_pending(now=now, limit=3)
    assert third == [just_ended, marked[0]]
    assert not DirtyHour.objects.exists()


def test_hours_that_ended_while_no_worker_ran_are_rolled_up_at_the_next_run() -> None:
    """Beat's rollup takes the hour just ended at each run; the hours that ended while the
    workers were down (no run took them) are marked at the next run and rolled up with it, so
    the open period's statements miss none of them until it closes."""
    snapshot([SLICE, claim("a", "gpu-0", T10)], T10)  # held from 10:00 on
    DirtyHour.objects.all().delete()
    assert rollup.rolled_through() is None
    assert rollup.rollup_pending(now=T10 + timedelta(hours=1, minutes=5)) == [T10]
    assert rollup.rolled_through() == T10
    # Down from 11:05 to 15:05: 11:00, 12:00 and 13:00 ended with no run.
    done = rollup.rollup_pending(now=T10 + timedelta(hours=5, minutes=5))
    missed = [T10 + timedelta(hours=index) for index in (1, 2, 3)]
    assert done == [T10 + timedelta(hours=4), *reversed(missed)]
    assert rollup.rolled_through() == T10 + timedelta(hours=4)
    assert sorted(UsageHour.objects.values_list("hour", flat=True)) == [
        T10 + timedelta(hours=index) for index in range(5)
    ]
    assert not DirtyHour.objects.exists()
    # A run for an earlier instant (`run_billing --period` of a past period) never moves it back.
    rollup.rollup_pending(now=T10 + timedelta(hours=2, minutes=5))
    assert rollup.rolled_through() == T10 + timedelta(hours=4)


def _vision() -> Team:
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace="vision")
    return team


def test_an_hour_rolled_up_only_to_now_stays_marked_even_when_its_rows_land_late() -> None:
    """`run_billing` for the open period, begun within 11:00 (its rows of 11:00 only to then),
    commits after beat has rolled 11:00 up whole: the hour stays marked, so the budget does
    not count it whole and beat's next run rolls it up again."""
    team = _vision()
    snapshot([SLICE, claim("a", "gpu-0", T10)], T10)  # held from 10:00 on
    eleven = T10 + HOUR
    rollup.rollup_pending(now=T10 + timedelta(hours=1, minutes=5))
    rollup.rollup_pending(now=T10 + timedelta(hours=2, minutes=1))  # 11:00 whole
    services.bill_period(period_start=T10, now=eleven + timedelta(minutes=30))  # landed late
    assert UsageHour.objects.get(hour=eleven).allocated_gpu_ms == MS_PER_HOUR // 2
    assert DirtyHour.objects.filter(hour=eleven).exists()
    # Before beat's next run, past 11:00's next hour: 10:00 to now, the half rows not trusted.
    now = T10 + timedelta(hours=3, minutes=10)
    held = team_gpu_hours(team=team, period=period_holding(now), now=now)
    assert held == Decimal(3 * 60 + 10) / 60
    rollup.rollup_pending(now=T10 + timedelta(hours=3, minutes=1))
    assert UsageHour.objects.get(hour=eleven).allocated_gpu_ms == MS_PER_HOUR
    assert not DirtyHour.objects.filter(hour=eleven).exists()


def test_a_run_for_a_later_now_records_no_more_than_the_clocks_hour_just_ended() -> None:
    """A worker whose clock is ahead (or a command given a later `now`) rolls up hours that
    have not ended by the database's reckoning: the next run takes them again."""
    clock = timezone.now()
    rollup.rollup_pending(now=clock + timedelta(hours=5))
    assert rollup.rolled_through() == hour_start(clock) - HOUR
