"""Admission history ages out (`quota.retention`): decisions past
TALLY_DECISION_RETENTION_DAYS, reservations and gang holds released longer than
TALLY_RESERVATION_RETENTION_DAYS ago with their lines; what still holds quota never."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.test import override_settings
from django.utils import timezone

from quota.models import (
    AdmissionDecision,
    GangReservation,
    GangReservationLine,
    Reservation,
    ReservationLine,
    ReservationState,
)
from quota.retention import purge_history
from quota.tasks import purge_history as purge_history_task
from tests.quota.factories import QuotaRuleFactory, ReservationFactory

pytestmark = pytest.mark.django_db

NOW = timezone.now()
OLD, RECENT = NOW - timedelta(days=31), NOW - timedelta(days=29)


def decision(at: datetime) -> AdmissionDecision:
    return AdmissionDecision.objects.create(
        at=at, uid="u", namespace="ns", name="claim", allowed=True
    )


@override_settings(
    TALLY_DECISION_RETENTION_DAYS=30, TALLY_RESERVATION_RETENTION_DAYS=30, TALLY_RETENTION_BATCH=2
)
def test_history_past_its_retention_goes_and_nothing_that_holds_quota() -> None:
    rule = QuotaRuleFactory.create()
    old_decisions = [decision(OLD) for _ in range(3)]
    recent_decision = decision(RECENT)
    released_long_ago = [
        ReservationFactory.create(
            team=rule.team, state=ReservationState.RELEASED, created_at=OLD, released_at=OLD
        )
        for _ in range(3)
    ]
    for reservation in released_long_ago:
        ReservationLine.objects.create(reservation=reservation, rule=rule, amount=Decimal(1))
    released_lately = ReservationFactory.create(
        team=rule.team, state=ReservationState.RELEASED, created_at=OLD, released_at=RECENT
    )
    # Made long ago, still held: quota usage, never history.
    live = ReservationFactory.create(team=rule.team, created_at=OLD)
    allocated = ReservationFactory.create(
        team=rule.team, state=ReservationState.ALLOCATED, created_at=OLD
    )
    ReservationLine.objects.create(reservation=live, rule=rule, amount=Decimal(2))
    gang = {
        state: GangReservation.objects.create(
            cluster="cluster-0",
            namespace="ns",
            key=f"JobSet/{state}",
            source="jobset",
            size=4,
            team=rule.team,
            state=state,
            created_at=OLD,
            released_at=OLD if state == ReservationState.RELEASED else None,
        )
        for state in (ReservationState.RELEASED, ReservationState.RESERVED)
    }
    for hold in gang.values():
        GangReservationLine.objects.create(gang_reservation=hold, rule=rule, amount=Decimal(3))

    purged = purge_history(now=NOW)

    assert (purged.decisions, purged.reservations, purged.gang_reservations) == (3, 3, 1)
    assert list(AdmissionDecision.objects.values_list("pk", flat=True)) == [recent_decision.pk]
    assert not AdmissionDecision.objects.filter(pk__in=[d.pk for d in old_decisions]).exists()
    assert set(Reservation.objects.values_list("pk", flat=True)) == {
        released_lately.pk,
        live.pk,
        allocated.pk,
    }
    assert list(ReservationLine.objects.values_list("reservation_id", flat=True)) == [live.pk]
    assert list(GangReservation.objects.values_list("pk", flat=True)) == [
        gang[ReservationState.RESERVED].pk
    ]
    assert GangReservationLine.objects.count() == 1
    # Again: nothing left to do.
    assert purge_history_task.apply().get() == {
        "decisions": 0,
        "reservations": 0,
        "gang_reservations": 0,
    }
