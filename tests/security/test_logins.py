"""Login lockout (django-axes): TALLY_LOGIN_FAILURE_LIMIT wrong passwords for one username from
one address, and even the right password is refused there, with a page that says why and when
to retry, on the portal and the admin alike; other addresses, and the same one after the
cool-off, are not locked."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client

from tests.security.conftest import PASSWORD

pytestmark = pytest.mark.django_db

ATTACKER = "198.51.100.7"
VICTIM = "198.51.100.8"


def post_login(client: Client, url: str, password: str, address: str) -> Any:
    return client.post(url, {"username": "pat", "password": password}, REMOTE_ADDR=address)


def fail_until_locked(client: Client, url: str) -> None:
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        response = post_login(client, url, "wrong", ATTACKER)
        assert response.status_code == 200  # the form again, with its error
        assert "_auth_user_id" not in client.session
    # The last failure the limit allows is answered with the lockout page already.
    assert_locked_out(post_login(client, url, "wrong", ATTACKER), client)


def assert_locked_out(response: Any, client: Client) -> None:
    assert response.status_code == 429
    assert response["Retry-After"] == str(int(settings.AXES_COOLOFF_TIME.total_seconds()))
    page = " ".join(response.content.decode().split())
    assert "Too many failed logins" in page
    assert f"after {settings.AXES_FAILURE_LIMIT} failed attempts" in page
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    assert f"Try again in {minutes} minutes" in page
    assert "_auth_user_id" not in client.session


def test_the_portal_refuses_the_right_password_after_the_failure_limit(
    password_user: User,
) -> None:
    attacker = Client()
    fail_until_locked(attacker, "/login/")
    assert_locked_out(post_login(attacker, "/login/", PASSWORD, ATTACKER), attacker)
    # Keyed on username and address: the user logs in from elsewhere...
    elsewhere = Client()
    assert post_login(elsewhere, "/login/", PASSWORD, VICTIM).status_code == 302
    assert elsewhere.session["_auth_user_id"] == str(password_user.pk)
    # ... and from the attacker's address once the cool-off has passed.
    cooled_off = AccessAttempt.objects.get().attempt_time - settings.AXES_COOLOFF_TIME
    AccessAttempt.objects.update(attempt_time=cooled_off - timedelta(seconds=1))
    later = Client()
    assert post_login(later, "/login/", PASSWORD, ATTACKER).status_code == 302
    assert later.session["_auth_user_id"] == str(password_user.pk)


def test_the_admin_refuses_the_right_password_after_the_failure_limit(
    password_user: User,
) -> None:
    attacker = Client()
    fail_until_locked(attacker, "/admin/login/")
    assert_locked_out(post_login(attacker, "/admin/login/", PASSWORD, ATTACKER), attacker)
    assert attacker.get("/admin/").status_code == 302  # to the admin's login


def test_failures_on_the_portal_and_the_admin_add_up(password_user: User) -> None:
    attacker = Client()
    urls = ["/login/", "/admin/login/"] * settings.AXES_FAILURE_LIMIT
    for url in urls[: settings.AXES_FAILURE_LIMIT - 1]:
        assert post_login(attacker, url, "wrong", ATTACKER).status_code == 200
    assert_locked_out(post_login(attacker, "/admin/login/", "wrong", ATTACKER), attacker)
    assert_locked_out(post_login(attacker, "/login/", PASSWORD, ATTACKER), attacker)
