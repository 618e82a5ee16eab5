"""Periodic quota jobs. Each task calls one service and owns its retry policy."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from quota import retention, services


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def expire_reservations() -> int:
    """Release reservations for claims that never appeared; safe to run twice."""
    return services.expire_reservations(now=timezone.now())


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=5, acks_late=True)
def reconcile_quotas() -> int:
    """Recount every quota rule from scratch and fix any drift, logged and counted in the
    drift metrics; safe to run twice. Returns how many rules had drifted."""
    usage = services.reconcile_usage(at=timezone.now(), fix=True)
    return sum(entry.drifted for entry in usage)


@shared_task(autoretry_for=(Exception,), retry_backoff=True, max_retries=3, acks_late=True)
def purge_history() -> dict[str, int]:
    """Delete admission decisions and released reservations past their retention
    (`retention.purge_history`); how many of each. Safe to run twice."""
    purged = retention.purge_history(now=timezone.now())
    return {
        "decisions": purged.decisions,
        "reservations": purged.reservations,
        "gang_reservations": purged.gang_reservations,
    }
