"""Sessions live in the database (teams/sessions.py): logging out ends a session for every copy
of its cookie, and a password change ends the user's other sessions."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from axes.models import AccessAttempt, AccessLog
from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.test import Client
from django.utils import timezone
from knox.models import AuthToken

from teams.models import Membership, Role, Team
from teams.sessions import SessionStore
from teams.tasks import clear_expired_logins
from teams.tokens import create_token
from tests.api.cast import Cast
from tests.security.conftest import PASSWORD

pytestmark = pytest.mark.django_db

COOKIE = settings.SESSION_COOKIE_NAME


def logged_in(username: str, password: str = PASSWORD) -> Client:
    client = Client()
    response = client.post("/login/", {"username": username, "password": password})
    assert response.status_code == 302, response.content
    return client


def with_cookie(value: str) -> Client:
    client = Client()
    client.cookies[COOKIE] = value
    return client


def api_status(client: Client) -> int:
    return client.get("/api/v1/teams/").status_code


def test_a_cookie_copied_before_logout_is_refused_after_it(cast: Cast) -> None:
    cast.lead_a.set_password(PASSWORD)
    cast.lead_a.save()
    browser = logged_in("la")
    copied = browser.cookies[COOKIE].value
    assert Session.objects.filter(session_key=copied).exists()  # a row, not the data itself
    assert api_status(with_cookie(copied)) == 200
    assert with_cookie(copied).get("/teams/alpha/").status_code == 200
    assert browser.post("/logout/").status_code == 302
    assert not Session.objects.filter(session_key=copied).exists()
    assert api_status(with_cookie(copied)) in {401, 403}
    page: Any = with_cookie(copied).get("/teams/alpha/")
    assert page.status_code == 302 and page["Location"].startswith("/login/")
    # A cookie Django could not have made (a NUL byte) is no session, never a server error.
    assert api_status(with_cookie("abcdefgh\x00ijklmnop")) in {401, 403}


def test_a_password_change_ends_the_users_other_sessions(password_user: User) -> None:
    alpha = Team.objects.create(slug="alpha", name="Alpha", cost_centre="CC-1")
    Membership.objects.create(team=alpha, user=password_user, role=Role.LEAD)
    laptop, phone = logged_in("pat"), logged_in("pat")
    laptop_key = laptop.cookies[COOKIE].value
    assert Session.objects.filter(session_key=laptop_key).exists()
    assert api_status(laptop) == api_status(phone) == 200
    response = phone.post(
        "/admin/password_change/",
        {
            "old_password": PASSWORD,
            "new_password1": "a new passphrase 9",
            "new_password2": "a new passphrase 9",
        },
    )
    assert response.status_code == 302
    assert api_status(phone) == 200  # the session that changed it goes on
    assert api_status(laptop) in {401, 403}
    assert not Session.objects.filter(session_key=laptop_key).exists()
    assert laptop.get("/teams/alpha/").status_code == 302


def test_beat_clears_expired_sessions_and_tokens(cast: Cast) -> None:
    live, stale = SessionStore(), SessionStore()
    for store in (live, stale):
        store["seen"] = True
        store.create()
    Session.objects.filter(session_key=stale.session_key).update(
        expire_date=timezone.now() - timedelta(seconds=1)
    )
    kept = create_token(user=cast.finance, days=1, actor="test")
    create_token(user=cast.finance, days=1, actor="test")
    AuthToken.objects.exclude(token_key=kept.key).update(
        expiry=timezone.now() - timedelta(seconds=1)
    )
    clear_expired_logins()
    assert set(Session.objects.values_list("session_key", flat=True)) == {live.session_key}
    assert list(AuthToken.objects.values_list("token_key", flat=True)) == [kept.key]


def test_beat_clears_stale_login_records(cast: Cast) -> None:
    now = timezone.now()
    # Both models stamp `attempt_time` on creation, so the old ones are dated afterwards.
    stale_failure, live_failure = (
        AccessAttempt.objects.create(username="mallory", ip_address=address, failures_since_start=3)
        for address in ("10.0.0.9", "10.0.0.8")
    )
    AccessAttempt.objects.filter(pk=stale_failure.pk).update(
        attempt_time=now - settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    )
    old_login, recent_login = (AccessLog.objects.create(username="alice") for _ in range(2))
    AccessLog.objects.filter(pk=old_login.pk).update(
        attempt_time=now - timedelta(days=settings.TALLY_LOGIN_LOG_DAYS, seconds=1)
    )
    clear_expired_logins()
    assert set(AccessAttempt.objects.values_list("pk", flat=True)) == {live_failure.pk}
    assert set(AccessLog.objects.values_list("pk", flat=True)) == {recent_login.pk}
