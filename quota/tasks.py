"""Periodic quota jobs. Each task calls one service, owns its retry policy, and logs what it
did in one INFO line."""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from quota import retention, services

log = logging.getLogger(__name__)


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def expire_reservations() -> int:
    """Release reservations for claims that never appeared; safe to run twice."""
    released = services.expire_reservations(now=timezone.now())
    log.info("expire reservations: %d released (their claims never appeared)", released)
    return released


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def reconcile_quotas() -> int:
    """Recount every quota rule from scratch and fix any drift, logged and counted in the
    drift metrics; safe to run twice. Returns how many rules had drifted."""
    usage = services.reconcile_usage(at=timezone.now(), fix=True)
    drifted = sum(entry.drifted for entry in usage)
    log.info("reconcile quotas: %d rule(s) recounted, %d had drifted (fixed)", len(usage), drifted)
    return drifted


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=3, acks_late=True)
def purge_history() -> dict[str, int]:
    """Delete admission decisions and released reservations past their retention
    (`retention.purge_history`); how many of each. Safe to run twice."""
    purged = retention.purge_history(now=timezone.now())
    log.info(
        "purge history: %d decision(s), %d reservation(s), %d gang reservation(s) deleted",
        purged.decisions,
        purged.reservations,
        purged.gang_reservations,
    )
    return {
        "decisions": purged.decisions,
        "reservations": purged.reservations,
        "gang_reservations": purged.gang_reservations,
    }
