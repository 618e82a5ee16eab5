"""Celery tasks of the teams app: clearing what has expired of logins."""

from __future__ import annotations

from importlib import import_module

from celery import shared_task
from django.conf import settings

from teams.tokens import delete_expired_tokens


@shared_task
def clear_expired_logins() -> None:
    """Delete expired sessions (Django's `clearsessions`) and expired API tokens."""
    import_module(settings.SESSION_ENGINE).SessionStore.clear_expired()
    delete_expired_tokens()
