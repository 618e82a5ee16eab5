"""The portal's Celery jobs (`CELERY_BEAT_SCHEDULE` in config/settings.py).

The week report's round lives here, not in billing: it reads each team's budget, which is
quota's (billing sits below quota and never imports it).
"""

from __future__ import annotations

import logging
from datetime import datetime

from celery import shared_task
from django.utils import timezone

from frontend.week import send_last_week_reports

log = logging.getLogger(__name__)


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def send_week_reports(now: str | None = None) -> list[str]:
    """Email each team's last complete week to its leads, once per team and week, from Monday
    TALLY_WEEK_REPORT_HOUR UTC on (`frontend.week.send_last_week_reports`); the slugs of the
    teams sent to. Beat runs it hourly: every run after the first that sent finds nothing to
    do, and one run twice, or two at once, sends nothing twice. `now` (ISO 8601) stands in for
    the clock."""
    moment = datetime.fromisoformat(now) if now else timezone.now()
    sent = send_last_week_reports(now=moment)
    log.info(
        "week reports: sent to %d team(s)%s", len(sent), f" ({', '.join(sent)})" if sent else ""
    )
    return sent
