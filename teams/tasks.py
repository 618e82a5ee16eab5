"""Celery tasks of the teams app: clearing what has expired of logins."""

from __future__ import annotations

from datetime import timedelta
from importlib import import_module

from axes.models import AccessAttempt, AccessLog
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from teams.tokens import delete_expired_tokens


@shared_task
def clear_expired_logins() -> None:
    """Delete expired sessions (Django's `clearsessions`), expired API tokens, failed-login
    counts older than the cool-off (django-axes drops them only when the same user tries
    again) and login records older than `TALLY_LOGIN_LOG_DAYS` (one row per login, else kept
    for ever)."""
    now = timezone.now()
    import_module(settings.SESSION_ENGINE).SessionStore.clear_expired()
    delete_expired_tokens()
    AccessAttempt.objects.filter(attempt_time__lte=now - settings.AXES_COOLOFF_TIME).delete()
    AccessLog.objects.filter(
        attempt_time__lte=now - timedelta(days=settings.TALLY_LOGIN_LOG_DAYS)
    ).delete()
