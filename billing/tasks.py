"""Billing jobs for Celery beat (`CELERY_BEAT_SCHEDULE` in config/settings.py). Each takes ISO
dates, calls one service, and owns its retries.

All are idempotent: rerunning one, or Celery delivering one twice, changes nothing. Each run
logs what it did in one INFO line (beat itself logs only "Sending due task").
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from celery import shared_task
from django.utils import timezone

from billing import alerts, services
from billing.periods import PricingError
from core import metrics

log = logging.getLogger(__name__)


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def rollup_pending() -> list[str]:
    """Roll up the hours marked dirty and the hour just ended, then refresh the open period's
    statements (`services.refresh_usage`); the hours rolled up, ISO 8601. Hours a
    Prometheus-compatible engine did not answer for (`metering.prometheus`) are not among them:
    they stay marked, for the next run, and are never billed as idle meanwhile."""
    hours = services.refresh_usage(now=timezone.now())
    metrics.BILLING_LAST_SUCCESS.set(time.time())
    span = f" ({min(hours):%Y-%m-%d %H:00} to {max(hours):%Y-%m-%d %H:00} UTC)" if hours else ""
    log.info("rollup: %d hour(s) rolled up%s; open period's statements refreshed", len(hours), span)
    return [hour.isoformat() for hour in hours]


@shared_task(
    autoretry_for=(Exception,),
    dont_autoretry_for=(PricingError,),
    retry_backoff=True,
    max_retries=5,
    acks_late=True,
)
def close_previous_period(now: str | None = None) -> str | None:
    """Close every ended period that is due: the previous one once TALLY_CLOSE_PERIOD_DAY of
    the new one has come, and any older one left open, each after a final rollup and
    statement refresh (`services.close_due_periods`); the names of the periods closed, oldest
    first, comma-separated (`2025-01, 2026-10`), or None when nothing was due.

    Beat runs it every hour: all but the first run on or after the day find nothing to do.
    `now` (ISO 8601) stands in for the clock. A `PricingError` (a period length changed
    under stored periods) is not retried: it needs a person.
    """
    moment = datetime.fromisoformat(now) if now else timezone.now()
    runs = services.close_due_periods(now=moment, actor="celery beat (TALLY_CLOSE_PERIOD_DAY)")
    closed = ", ".join(run.period.label for run in runs) or None
    log.info("close periods: %s", f"closed {closed}" if closed else "none due")
    return closed


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=3, acks_late=True)
def evaluate_alerts() -> dict[str, Any]:
    """Raise and resolve the alerts live now (idle claims, stranded gangs, undocumented
    version outliers), then send the notifications due (`alerts.run_alerts`); per kind what
    was raised, firing and resolved, and what was sent. Beat runs it every
    TALLY_ALERT_EVERY_SECONDS; reruns raise and send nothing more."""
    summary = alerts.run_alerts(now=timezone.now()).summary()
    kinds = "; ".join(
        f"{kind} {counts['raised']} raised, {counts['firing']} firing, "
        f"{counts['resolved']} resolved"
        for kind, counts in summary.items()
        if isinstance(counts, dict)
    )
    log.info(
        "alerts: %s; notifications %d sent, %d retrying, %d failed",
        kinds,
        summary["sent"],
        summary["retrying"],
        summary["failed"],
    )
    return summary
