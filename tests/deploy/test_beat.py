"""Celery beat's schedule lives in the database (django-celery-beat), editable in the admin.

The entries of CELERY_BEAT_SCHEDULE are created when missing; what the admin made of them
stays when beat restarts (the stock scheduler would write the settings over it).

The database tests run outside a test transaction, as beat does: the scheduler closes a
connection it finds inside a transaction (`close_old_connections`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from celery.utils.imports import symbol_by_name
from django.conf import settings
from django.test import Client
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from config.celery import app

REPO = Path(__file__).resolve().parents[2]
ENTRIES = {
    "quota-expire-reservations": "quota.tasks.expire_reservations",
    "quota-reconcile": "quota.tasks.reconcile_quotas",
    "billing-rollup-pending": "billing.tasks.rollup_pending",
    "billing-close-period": "billing.tasks.close_previous_period",
    "logins-clear-expired": "teams.tasks.clear_expired_logins",
}


@pytest.fixture
def start_beat() -> Callable[[], DatabaseScheduler]:
    """Start the configured scheduler as beat does (reading and seeding the database)."""

    def start() -> DatabaseScheduler:
        scheduler = symbol_by_name(app.conf.beat_scheduler)(app=app)
        scheduler._finalize.cancel()  # no sync at exit, after the test database is gone
        return scheduler

    return start


def test_the_beat_process_uses_no_schedule_file() -> None:
    entrypoint = (REPO / "deploy" / "entrypoint.sh").read_text()
    (beat,) = re.findall(r"^\s*beat\)(.*)$", entrypoint, flags=re.MULTILINE)
    assert beat.strip() == 'exec celery --app config beat --loglevel "${LOG_LEVEL:-info}" "$@" ;;'
    assert "django_celery_beat" in settings.INSTALLED_APPS
    assert issubclass(symbol_by_name(settings.CELERY_BEAT_SCHEDULER), DatabaseScheduler)


@pytest.mark.django_db(transaction=True)
def test_beat_seeds_the_settings_entries_into_the_database(
    start_beat: Callable[[], DatabaseScheduler],
) -> None:
    scheduler = start_beat()
    stored = {task.name: task for task in PeriodicTask.objects.all()}
    assert {name: stored[name].task for name in ENTRIES} == ENTRIES
    rollup = stored["billing-rollup-pending"].interval
    assert rollup is not None
    assert (rollup.every, rollup.period) == (settings.TALLY_ROLLUP_EVERY_SECONDS, "seconds")
    close = stored["billing-close-period"].crontab
    assert close is not None and (close.minute, close.hour) == ("20", "*")
    assert set(ENTRIES) <= set(scheduler.schedule)


@pytest.mark.django_db(transaction=True)
def test_edits_in_the_admin_survive_a_restart_of_beat(
    start_beat: Callable[[], DatabaseScheduler],
) -> None:
    start_beat()
    every_ten_minutes, _ = IntervalSchedule.objects.get_or_create(every=600, period="seconds")
    PeriodicTask.objects.filter(name="billing-rollup-pending").update(interval=every_ten_minutes)
    PeriodicTask.objects.filter(name="billing-close-period").update(enabled=False)
    PeriodicTask.objects.filter(name="quota-expire-reservations").delete()
    scheduler = start_beat()
    rollup = PeriodicTask.objects.get(name="billing-rollup-pending")
    assert rollup.interval == every_ten_minutes
    assert not PeriodicTask.objects.get(name="billing-close-period").enabled
    assert "billing-close-period" not in scheduler.schedule
    # A deleted entry comes back from the settings.
    assert PeriodicTask.objects.get(name="quota-expire-reservations").interval is not None


@pytest.mark.django_db(transaction=True)
def test_the_schedules_are_listed_and_editable_in_the_admin(
    start_beat: Callable[[], DatabaseScheduler], admin_client: Client
) -> None:
    start_beat()
    listing = admin_client.get("/admin/django_celery_beat/periodictask/")
    assert listing.status_code == 200
    for name in ENTRIES:
        assert name in listing.content.decode()
    task = PeriodicTask.objects.get(name="billing-rollup-pending")
    page = admin_client.get(f"/admin/django_celery_beat/periodictask/{task.pk}/change/")
    assert page.status_code == 200
    assert 'name="interval"' in page.content.decode()
