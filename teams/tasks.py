"""Celery tasks of the teams app: clearing what has expired of logins."""

from __future__ import annotations

import logging
from datetime import timedelta
from importlib import import_module

from axes.models import AccessAttempt, AccessLog
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from teams.tokens import delete_expired_tokens

log = logging.getLogger(__name__)


@shared_task
def clear_expired_logins() -> None:
    """Delete expired sessions (Django's `clearsessions`), expired API tokens, failed-login
    counts older than the cool-off (django-axes drops them only when the same user tries
    again) and login records older than `TALLY_LOGIN_LOG_DAYS` (one row per login, else kept
    for ever)."""
    now = timezone.now()
    import_module(settings.SESSION_ENGINE).SessionStore.clear_expired()
    tokens = delete_expired_tokens()
    attempts, _ = AccessAttempt.objects.filter(
        attempt_time__lte=now - settings.AXES_COOLOFF_TIME
    ).delete()
    records, _ = AccessLog.objects.filter(
        attempt_time__lte=now - timedelta(days=settings.TALLY_LOGIN_LOG_DAYS)
    ).delete()
    log.info(
        "clear expired logins: expired sessions cleared; %d token(s), %d failed-login count(s), "
        "%d login record(s) deleted",
        tokens,
        attempts,
        records,
    )
