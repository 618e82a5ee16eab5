"""API tokens (django-rest-knox through teams/tokens.py): stored hashed, expiring, revocable,
made and revoked by `manage.py api_token` and the admin; and wrong tokens throttled per client
address, so a flood of guesses gets 429 with Retry-After while valid tokens from the same
address are served."""

from __future__ import annotations

import io
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from knox.models import AuthToken
from pytest_django.fixtures import SettingsWrapper
from rest_framework.test import APIClient

from config.cache import FailOpenRedisCache
from db.embedded import postgres_url
from teams.models import AuditEntry
from teams.throttles import FailedTokenThrottle
from teams.tokens import create_token, default_days
from tests.api.cast import Cast
from tests.test_manage import assert_one_line, manage

pytestmark = pytest.mark.django_db

GUESSER = "203.0.113.9"
OTHER = "203.0.113.10"


def teams_with(token: str, address: str = OTHER) -> int:
    client = APIClient()
    response = client.get(
        "/api/v1/teams/", HTTP_AUTHORIZATION=f"Token {token}", REMOTE_ADDR=address
    )
    return response.status_code


def api_token(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("api_token", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def throttle_reset() -> Iterator[None]:
    """The failed-token counts of the test's addresses start and end empty (they live in the
    shared cache, Redis when REDIS_URL is set)."""

    def reset() -> None:
        for address in (GUESSER, OTHER):
            cache.delete(
                FailedTokenThrottle.cache_format % {"scope": "failed_token", "ident": address}
            )

    reset()
    yield
    reset()


@pytest.mark.usefixtures("throttle_reset")
def test_a_flood_of_wrong_tokens_is_throttled(cast: Cast) -> None:
    limit = FailedTokenThrottle().num_requests
    client = APIClient()
    statuses = []
    for guess in range(300):
        response = client.get(
            "/api/v1/teams/",
            HTTP_AUTHORIZATION=f"Token {guess:064x}",
            REMOTE_ADDR=GUESSER,
            # Not trusted (TALLY_TRUSTED_PROXIES=0): a forged address changes nothing.
            HTTP_X_FORWARDED_FOR=f"10.0.{guess // 256}.{guess % 256}",
        )
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert 0 < int(response["Retry-After"]) <= 60
            assert "throttled" in response.json()["detail"].lower()
    assert statuses == [401] * limit + [429] * (300 - limit)
    # A valid token is checked first: the guesser's failures never refuse it, at that address
    # (finance behind the same NAT as the guesser) or elsewhere (issue 40, finding 6) ...
    good = create_token(user=cast.finance, days=1, actor="test").token
    assert teams_with(good, GUESSER) == 200
    assert teams_with(good, OTHER) == 200
    # ... while the address's wrong tokens are still refused.
    assert teams_with(f"{300:064x}", GUESSER) == 429


@pytest.mark.usefixtures("throttle_reset")
def test_a_token_is_stored_hashed_and_works(cast: Cast) -> None:
    out, err = api_token("create", "la", "--expires-in", "30")
    token = out.strip()
    assert len(token) == 64 and "\n" not in token
    assert "shown only now" in err and token not in err
    with connection.cursor() as cursor:
        cursor.execute("SELECT row_to_json(t)::text FROM knox_authtoken t")
        (row,) = cursor.fetchall()
    assert token not in row[0]  # only its hash and its first 15 characters
    stored = AuthToken.objects.get()
    assert stored.token_key == token[:15] and stored.digest != token
    assert timedelta(days=29, hours=23) < stored.expiry - timezone.now() <= timedelta(days=30)
    assert AuditEntry.objects.filter(actor="api_token", action="create").count() == 1
    assert teams_with(token) == 200
    # What knox could not have made is refused before its decoding and the database.
    for forged in (token[:63] + "\xe9", token[:20] + "\x00" + token[21:], token.upper()):
        assert teams_with(forged) == 401


@pytest.mark.usefixtures("throttle_reset")
def test_an_expired_token_is_refused(cast: Cast) -> None:
    token = create_token(user=cast.lead_a, days=1, actor="test").token
    assert teams_with(token) == 200
    AuthToken.objects.update(expiry=timezone.now() - timedelta(seconds=1))
    assert teams_with(token) == 401


@pytest.mark.usefixtures("throttle_reset")
def test_revoked_tokens_are_refused(cast: Cast) -> None:
    first = api_token("create", "la")[0].strip()
    second = api_token("create", "la")[0].strip()
    third = api_token("create", "la")[0].strip()
    listing = api_token("list", "la")[0]
    assert [line.split()[0] for line in listing.splitlines()] == [
        third[:15],
        second[:15],
        first[:15],
    ]
    assert all(" valid" in line for line in listing.splitlines())
    expires = (timezone.now() + timedelta(days=default_days())).date()
    assert f"expires {expires:%Y-%m-%d}" in listing
    assert api_token("revoke", "la", first[:15])[0] == "revoked 1 token(s) of la\n"
    assert teams_with(first) == 401
    assert teams_with(second) == 200
    assert api_token("revoke", "la", "--all")[0] == "revoked 2 token(s) of la\n"
    assert teams_with(second) == 401 and teams_with(third) == 401
    assert api_token("list", "la")[0] == "la has no API token\n"
    assert AuditEntry.objects.filter(actor="api_token", action="delete").count() == 3


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["create", "nobody"], "no user named 'nobody'"),
        (["list", "nobody"], "no user named 'nobody'"),
        (["create", "la", "--expires-in", "0"], "a token is valid from 1 to 3650 days, not 0"),
        (["revoke", "la", "short"], "a token's key is its first 15 characters"),
        (["revoke", "la", "0123456789abcde"], "user 'la' has no token '0123456789abcde'"),
    ],
)
def test_command_errors_name_the_problem(cast: Cast, args: list[str], says: str) -> None:
    with pytest.raises(CommandError, match=says.replace("(", r"\(")):
        api_token(*args)
    assert not AuthToken.objects.exists()


def test_command_errors_are_one_line_without_traceback(db: None) -> None:
    # The test database, migrated and empty (this test's rows are not committed).
    url = postgres_url(connection.settings_dict)
    result = manage("api_token", "create", "nobody", DATABASE_URL=url)
    assert_one_line(result, code=1, says="no user named 'nobody'")


@pytest.mark.usefixtures("throttle_reset")
def test_the_admin_shows_a_new_token_once_and_revokes_it(cast: Cast) -> None:
    operator = User.objects.create_superuser("root", password="x")
    admin = Client()
    admin.force_login(operator)
    response = admin.post(
        "/admin/knox/authtoken/add/", {"user": cast.finance.pk, "days": 7}, follow=True
    )
    assert response.status_code == 200
    (token,) = [
        str(m).removeprefix("TOKEN ")
        for m in response.context["messages"]
        if str(m).startswith("TOKEN ")
    ]
    assert teams_with(token) == 200
    stored = AuthToken.objects.get()
    assert stored.expiry is not None
    assert abs(stored.expiry - timezone.now() - timedelta(days=7)) < timedelta(minutes=1)
    assert token not in admin.get("/admin/knox/authtoken/").content.decode()
    page = admin.get(f"/admin/knox/authtoken/{stored.pk}/change/").content.decode()
    assert token not in page and stored.token_key in page
    response = admin.post(f"/admin/knox/authtoken/{stored.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert teams_with(token) == 401
    entries = AuditEntry.objects.filter(actor="root").order_by("at", "pk")
    assert [(e.actor, e.action, e.object_repr) for e in entries] == [
        ("root", "create", stored.token_key),
        ("root", "delete", stored.token_key),
    ]
    assert stored.digest not in str(list(entries.values()))


@pytest.mark.parametrize("days", ["", "0", "3651", "-1"])
def test_the_admin_makes_no_token_without_a_bounded_expiry(cast: Cast, days: str) -> None:
    """knox's own form took a blank expiry (a token valid for ever) or one in the past."""
    admin = Client()
    admin.force_login(User.objects.create_superuser("root", password="x"))
    response = admin.post("/admin/knox/authtoken/add/", {"user": cast.finance.pk, "days": days})
    assert response.status_code == 200  # the form again, with its error
    assert response.context["adminform"].form.errors["days"]
    assert not AuthToken.objects.exists()


@pytest.mark.parametrize("silent", [False, True], ids=["refused", "silent"])
def test_the_api_answers_while_the_throttles_cache_is_down(
    cast: Cast,
    settings: SettingsWrapper,
    silent: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redis that refuses connections, or accepts and never answers: the API still
    answers (uncounted), in about the socket timeout, with a warning, never a 500."""
    monkeypatch.setattr(FailOpenRedisCache, "_warned_at", float("-inf"))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        if silent:
            server.listen()  # accepts, never answers
        port = server.getsockname()[1]
        settings.CACHES = {
            "default": {
                "BACKEND": "config.cache.FailOpenRedisCache",
                "LOCATION": f"redis://127.0.0.1:{port}/0",
                "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
            }
        }
        good = create_token(user=cast.lead_a, days=1, actor="test").token
        began = time.monotonic()
        assert teams_with(good) == 200
        assert teams_with(f"{0:064x}") == 401
        assert time.monotonic() - began < 10
    assert "API throttles are not counting" in caplog.text


def test_the_audit_names_a_token_by_its_key_not_its_digest(cast: Cast) -> None:
    token = api_token("create", "la")[0].strip()
    api_token("revoke", "la", token[:15])
    entries = AuditEntry.objects.filter(actor="api_token").order_by("at", "pk")
    assert [(entry.action, entry.object_repr) for entry in entries] == [
        ("create", token[:15]),
        ("delete", token[:15]),
    ]
    for entry in entries:
        snapshot = entry.after or entry.before
        assert snapshot is not None and "digest" not in snapshot, snapshot
        assert snapshot["token_key"] == token[:15]
