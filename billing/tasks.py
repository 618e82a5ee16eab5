"""Billing jobs for Celery. Each takes ids or ISO dates, calls one service, owns its retries.

All are idempotent: rerunning any of them, or Celery delivering one twice, changes nothing.
"""

from __future__ import annotations

import time
from datetime import datetime

from celery import shared_task
from django.utils import timezone

from billing import ingest, pricing, rollup
from config import metrics


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def rollup_hour(hour: str) -> int:
    """Recompute one hour's usage rows (`hour`: ISO 8601)."""
    return rollup.rollup_hour(hour=datetime.fromisoformat(hour))


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def rollup_pending() -> list[str]:
    """Roll up the hours marked dirty and the hour just ended, then refresh open statements."""
    now = timezone.now()
    ingest.adopt_unknown_samples(now=now)  # devices the sync has learnt since
    hours = rollup.rollup_pending(now=now)
    pricing.refresh_statements(period=pricing.period_for(now))
    metrics.BILLING_LAST_SUCCESS.set(time.time())
    return [hour.isoformat() for hour in hours]


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def refresh_statements(period_start: str) -> int:
    """Recompute an open period's statements (`period_start`: ISO 8601)."""
    period = pricing.period_for(datetime.fromisoformat(period_start))
    return len(pricing.refresh_statements(period=period))


@shared_task(
    autoretry_for=(Exception,),
    dont_autoretry_for=(pricing.PricingError,),
    retry_backoff=True,
    max_retries=5,
    acks_late=True,
)
def close_previous_period(now: str | None = None) -> str | None:
    """Close the previous period once TALLY_CLOSE_PERIOD_DAY of the new one has come, after a
    final rollup and statement refresh; the period's name, or None when nothing was due.

    Beat runs it every hour: all but the first run on or after the day find nothing to do.
    `now` (ISO 8601) stands in for the clock. A `PricingError` (a period length changed
    under stored periods) is not retried: it needs a person.
    """
    moment = datetime.fromisoformat(now) if now else timezone.now()
    run = pricing.close_due_period(now=moment, actor="celery beat (TALLY_CLOSE_PERIOD_DAY)")
    return None if run is None else pricing.period_label(run.period.start, run.period.end)
