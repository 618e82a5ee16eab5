"""Admission history ages out: decisions after TALLY_DECISION_RETENTION_DAYS, released
reservations (and gang holds) with their lines after TALLY_RESERVATION_RETENTION_DAYS.

Only history goes: a reservation still reserved or allocated, or a gang hold still held, is
never touched, whatever its age, so the rules' usage and its recount are unchanged. Deleted in
batches (`metering.retention.delete_in_batches`), each its own transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from metering.retention import delete_in_batches
from quota.models import AdmissionDecision, GangReservation, Reservation, ReservationState


@dataclass(frozen=True)
class Purged:
    """How many rows one `purge_history` deleted, by kind."""

    decisions: int
    reservations: int
    gang_reservations: int


def purge_history(*, now: datetime) -> Purged:
    """Delete decisions older than TALLY_DECISION_RETENTION_DAYS and reservations and gang
    holds released longer than TALLY_RESERVATION_RETENTION_DAYS ago (their lines cascade);
    how many of each. Idempotent."""
    decided_before = now - timedelta(days=int(settings.TALLY_DECISION_RETENTION_DAYS))
    released_before = now - timedelta(days=int(settings.TALLY_RESERVATION_RETENTION_DAYS))
    released = Q(state=ReservationState.RELEASED, released_at__lt=released_before)
    return Purged(
        decisions=delete_in_batches(Q(at__lt=decided_before), model=AdmissionDecision),
        reservations=delete_in_batches(released, model=Reservation),
        gang_reservations=delete_in_batches(released, model=GangReservation),
    )
