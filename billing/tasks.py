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
