"""Logging through a real request: each line once, even with DEBUG on, whatever the format;
a refusal (403) one warning line without a traceback."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import Any

import pytest
from django.conf import LazySettings
from django.contrib.auth.models import User
from django.test import Client
from django.utils.log import configure_logging

from core.logging import logging_config, quiet_django

pytestmark = pytest.mark.django_db


@contextmanager
def logging_to(config: dict[str, Any], settings: LazySettings) -> Iterator[io.StringIO]:
    """Logging configured as Django does at start (its defaults, then `config`), its console
    handlers writing to the buffer yielded; the session's configuration again afterwards."""
    buffer = io.StringIO()
    with redirect_stderr(buffer):
        configure_logging(settings.LOGGING_CONFIG, config)
    try:
        yield buffer
    finally:
        configure_logging(settings.LOGGING_CONFIG, settings.LOGGING)


def _configs(settings: LazySettings) -> dict[str, dict[str, Any]]:
    return {"settings": settings.LOGGING, "json": quiet_django(logging_config("INFO"))}


@pytest.mark.parametrize("log_format", ["settings", "json"])
def test_each_line_is_logged_once_with_debug_on(settings: LazySettings, log_format: str) -> None:
    settings.DEBUG = True
    with logging_to(_configs(settings)[log_format], settings) as output:
        assert Client().get("/no-such-page/").status_code == 404
    lines = output.getvalue().splitlines()
    assert len([line for line in lines if "Not Found: /no-such-page/" in line]) == 1, lines


@pytest.mark.parametrize("log_format", ["settings", "json"])
def test_a_403_is_one_warning_line_without_traceback(
    settings: LazySettings, log_format: str
) -> None:
    settings.DEBUG = True
    clerk = User.objects.create_user("clerk", is_staff=True)  # staff without permissions
    client = Client()
    client.force_login(clerk)
    with logging_to(_configs(settings)[log_format], settings) as output:
        assert client.get("/admin/teams/team/").status_code == 403
    text = output.getvalue()
    forbidden = [line for line in text.splitlines() if "Forbidden (Permission denied)" in line]
    assert len(forbidden) == 1 and "WARNING" in forbidden[0], text
    assert "Traceback" not in text and "PermissionDenied" not in text
