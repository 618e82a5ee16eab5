"""Metering jobs for Celery beat (`CELERY_BEAT_SCHEDULE` in config/settings.py). Idempotent:
rerunning one, or Celery delivering one twice, changes nothing; each run logs what it did in
one INFO line.

Their task names are the ones they had in `billing.tasks` (issue 37), so beat's schedules and
queued tasks keep finding them.
"""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from metering import compaction, retention

log = logging.getLogger(__name__)


# Registered under its name from when it was billing's: beat's schedules (the settings' and any
# stored in django-celery-beat) and queued runs name it so.
@shared_task(
    name="billing.tasks.sample_retention",
    autoretry_for=(Exception,),
    retry_backoff=True,
    max_retries=3,
    acks_late=True,
)
def sample_retention() -> dict[str, object]:
    """Keep the samples' day partitions made ahead, move stray rows out of DEFAULT, drop the
    days past TALLY_SAMPLE_RETENTION_DAYS that may go, and delete the samples set aside past
    TALLY_INGEST_UNKNOWN_RETENTION_DAYS (`retention.apply_sample_retention`); what it did, for
    the task's result. Beat runs it hourly; reruns change nothing."""
    report = retention.apply_sample_retention(now=timezone.now())
    log.info(
        "sample retention: %d day partition(s) created, %d dropped, %d kept, %d busy; "
        "%d row(s) moved out of DEFAULT, %d left there; %d unknown-device sample(s) deleted",
        len(report.created),
        len(report.dropped),
        len(report.kept),
        len(report.busy),
        report.moved_from_default,
        sum(report.left_in_default.values()),
        report.unknown_device_samples_deleted,
    )
    return {
        "created": [day.isoformat() for day in report.created],
        "dropped": [day.isoformat() for day in report.dropped],
        "moved_from_default": report.moved_from_default,
        "left_in_default": {day.isoformat(): n for day, n in report.left_in_default.items()},
        "kept": {day.isoformat(): why for day, why in report.kept.items()},
        "busy": [day.isoformat() for day in report.busy],
        "unknown_device_samples_deleted": report.unknown_device_samples_deleted,
    }


@shared_task(
    name="metering.tasks.compact_samples",
    autoretry_for=(Exception,),
    retry_backoff=True,
    max_retries=3,
    acks_late=True,
)
def compact_samples() -> dict[str, object]:
    """Compact the samples of the days older than TALLY_SAMPLE_COMPACT_AFTER_DAYS into blocks
    (`compaction.compact_samples`); what it did, for the task's result. Beat runs it hourly;
    reruns change nothing, and an interrupted run is picked up by the next."""
    report = compaction.compact_samples(now=timezone.now())
    log.info(
        "sample compaction: %d sample(s) into %d block(s) over %d day(s); %d partition(s) "
        "rewritten, %d busy",
        sum(report.moved.values()),
        sum(report.blocks.values()),
        len(report.moved),
        len(report.rewritten),
        len(report.busy),
    )
    return {
        "moved": {day.isoformat(): n for day, n in report.moved.items()},
        "blocks": {day.isoformat(): n for day, n in report.blocks.items()},
        "rewritten": [day.isoformat() for day in report.rewritten],
        "busy": [day.isoformat() for day in report.busy],
    }
