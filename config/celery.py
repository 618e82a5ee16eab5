"""The Celery app; tasks live in each app's `tasks.py`."""

import os
from functools import cache
from typing import Any

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("tally")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
@signals.beat_init.connect
def _serve_metrics(**_: object) -> None:
    """Worker and beat have no web server: serve their metrics on TALLY_WORKER_METRICS_PORT."""
    port = os.environ.get("TALLY_WORKER_METRICS_PORT")
    if port:
        from django.conf import settings

        from core.metrics import start_metrics_server

        start_metrics_server(int(port), token=settings.TALLY_METRICS_TOKEN)


@cache
def _seeding_database_scheduler() -> type:
    # django-celery-beat's models load only once Django is set up, which is after this module
    # is imported (config/__init__.py imports it): so the class is made on first use.
    from django_celery_beat.models import PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    class SeedingDatabaseScheduler(DatabaseScheduler):
        """django-celery-beat's scheduler, with the schedule in settings as seed only.

        The stock scheduler writes every CELERY_BEAT_SCHEDULE entry over the database row of
        the same name whenever beat starts, so an interval changed in the admin would last
        until the next deploy. Here an entry is written only when no row of its name exists:
        the admin's edits (interval, crontab, enabled) stay, and deleting a row there brings
        the entry back from the settings at beat's next start.
        """

        def update_from_dict(self, mapping: dict[str, Any]) -> None:
            stored = set(
                PeriodicTask.objects.filter(name__in=list(mapping)).values_list("name", flat=True)
            )
            missing = {name: entry for name, entry in mapping.items() if name not in stored}
            super().update_from_dict(missing)

    SeedingDatabaseScheduler.__module__ = __name__
    SeedingDatabaseScheduler.__qualname__ = "SeedingDatabaseScheduler"
    return SeedingDatabaseScheduler


def __getattr__(name: str) -> Any:
    """`SeedingDatabaseScheduler` (CELERY_BEAT_SCHEDULER names it), made on first use."""
    if name == "SeedingDatabaseScheduler":
        return _seeding_database_scheduler()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
