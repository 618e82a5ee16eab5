"""Login limits (teams/lockout.py), on the portal and the admin alike.

- A username and an address: TALLY_LOGIN_FAILURE_LIMIT wrong passwords, and even the right one
  is refused there for the cool-off, with a page that says why and when to retry.
- A username from every address together (issue 40, finding 6): guesses spread over 40
  addresses are slowed to one per growing delay, unchecked in between; the person, from an
  address of their own, logs in once the delay (at most TALLY_LOGIN_MAX_DELAY_SECONDS) is
  over, however many attempts were refused meanwhile.
- An address, whatever usernames it names: TALLY_LOGIN_ADDRESS_FAILURE_LIMIT failures lock it.
- A username longer than a username can be is a form error, not a 500 (finding 5).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import Sum
from django.test import Client
from django.utils import timezone

from teams.lockout import username_delay
from tests.security.conftest import PASSWORD

pytestmark = pytest.mark.django_db

ATTACKER = "198.51.100.7"
VICTIM = "198.51.100.8"
URLS = ["/login/", "/admin/login/"]


def post_login(client: Client, url: str, password: str, address: str, username: str = "pat") -> Any:
    return client.post(url, {"username": username, "password": password}, REMOTE_ADDR=address)


def age_attempts(seconds: float) -> None:
    """As if every recorded failure had happened `seconds` earlier."""
    for attempt in AccessAttempt.objects.all():
        attempt.attempt_time -= timedelta(seconds=seconds)
        attempt.save(update_fields=["attempt_time"])


def failures_recorded(**filters: str) -> int:
    """The failed logins django-axes recorded: those whose password was checked."""
    total = AccessAttempt.objects.filter(**filters).aggregate(n=Sum("failures_since_start"))["n"]
    return int(total or 0)


def fail_until_locked(client: Client, url: str) -> None:
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        response = post_login(client, url, "wrong", ATTACKER)
        assert response.status_code == 200  # the form again, with its error
        assert "_auth_user_id" not in client.session
    # The last failure the limit allows is answered with the lockout page already.
    assert_locked_out(post_login(client, url, "wrong", ATTACKER), client)


def assert_refused(response: Any, client: Client, reason: str, wait: float) -> None:
    """A 429 page giving `reason`, with a wait of about `wait` seconds (a little less: the
    clock has moved since the failure it runs from)."""
    assert response.status_code == 429
    assert wait - 5 <= int(response["Retry-After"]) <= wait
    page = " ".join(response.content.decode().split())
    assert "Too many failed logins" in page
    assert f"Login refused: {reason}" in page
    assert "_auth_user_id" not in client.session


def assert_locked_out(response: Any, client: Client) -> None:
    cooloff = settings.AXES_COOLOFF_TIME.total_seconds()
    limit = settings.AXES_FAILURE_LIMIT
    reason = f"this account is locked for logins from your address after {limit} failed attempts"
    assert_refused(response, client, reason, cooloff)
    assert f"Try again in {int(cooloff // 60)} minutes" in " ".join(
        response.content.decode().split()
    )


def assert_logged_in(response: Any, client: Client, user: User) -> None:
    assert response.status_code == 302, response.content.decode()[:2000]
    assert client.session["_auth_user_id"] == str(user.pk)


def test_the_portal_refuses_the_right_password_after_the_failure_limit(
    password_user: User,
) -> None:
    attacker = Client()
    fail_until_locked(attacker, "/login/")
    assert_locked_out(post_login(attacker, "/login/", PASSWORD, ATTACKER), attacker)
    # The user logs in from elsewhere once the username's first delay (1 s) is over...
    age_attempts(1)
    elsewhere = Client()
    assert_logged_in(post_login(elsewhere, "/login/", PASSWORD, VICTIM), elsewhere, password_user)
    # ... and from the attacker's address once the cool-off has passed.
    age_attempts(settings.AXES_COOLOFF_TIME.total_seconds())
    later = Client()
    assert_logged_in(post_login(later, "/login/", PASSWORD, ATTACKER), later, password_user)


def test_the_admin_refuses_the_right_password_after_the_failure_limit(
    password_user: User,
) -> None:
    attacker = Client()
    fail_until_locked(attacker, "/admin/login/")
    assert_locked_out(post_login(attacker, "/admin/login/", PASSWORD, ATTACKER), attacker)
    assert attacker.get("/admin/").status_code == 302  # to the admin's login


def test_failures_on_the_portal_and_the_admin_add_up(password_user: User) -> None:
    attacker = Client()
    urls = URLS * settings.AXES_FAILURE_LIMIT
    for url in urls[: settings.AXES_FAILURE_LIMIT - 1]:
        assert post_login(attacker, url, "wrong", ATTACKER).status_code == 200
    assert_locked_out(post_login(attacker, "/admin/login/", "wrong", ATTACKER), attacker)
    assert_locked_out(post_login(attacker, "/login/", PASSWORD, ATTACKER), attacker)


@pytest.mark.parametrize("url", URLS)
def test_guesses_from_many_addresses_are_slowed_and_the_person_still_logs_in(
    password_user: User, url: str
) -> None:
    """200 guesses from 40 addresses (5 each, under every pair's limit) at one instant: only
    the first TALLY_LOGIN_FAILURE_LIMIT have their password checked."""
    limit = settings.AXES_FAILURE_LIMIT
    addresses = [f"127.0.0.{host}" for host in range(2, 42)]
    attacker = Client()
    with time_machine.travel(timezone.now(), tick=False) as clock:
        for guess in range(200):
            response = post_login(attacker, url, f"guess-{guess}", addresses[guess % 40])
            assert response.status_code == (200 if guess < limit else 429), guess
        assert failures_recorded(username="pat") == limit
        # Refused too, the right password, from the person's own address: it is not checked,
        # so a guess during the delay cannot find it.
        person = Client()
        reason = f"this account has had {limit} failed logins lately"
        assert_refused(post_login(person, url, PASSWORD, VICTIM), person, reason, 1)
        # One more guess per delay, each delay twice the last, up to the cap.
        for number, delay in enumerate((1, 2, 4, 8)):
            clock.shift(delay)
            fresh = f"127.0.1.{number}"  # an address with no failures of its own
            assert post_login(attacker, url, "again", fresh).status_code == 200
            assert post_login(attacker, url, "again", addresses[1]).status_code == 429
        assert failures_recorded(username="pat") == limit + 4
        # Attempts refused meanwhile lengthen nothing: hammered every second, the account
        # opens to the person when the delay (now 16 s) is over.
        delay = int(username_delay(limit + 4).total_seconds())
        assert delay == 16
        for _ in range(delay - 1):
            clock.shift(1)
            assert post_login(attacker, url, "hammer", addresses[2]).status_code == 429
        clock.shift(1)
        assert failures_recorded(username="pat") == limit + 4
        assert_logged_in(post_login(person, url, PASSWORD, VICTIM), person, password_user)


def test_the_delay_doubles_up_to_its_cap() -> None:
    limit, cap = settings.AXES_FAILURE_LIMIT, settings.TALLY_LOGIN_MAX_DELAY_SECONDS
    delays = [username_delay(failures).total_seconds() for failures in range(limit + 8)]
    assert delays == [0] * limit + [min(2**n, cap) for n in range(8)]
    assert username_delay(10**6).total_seconds() == cap  # a flood costs no more than the cap


def test_an_address_that_fails_for_many_usernames_is_locked(password_user: User) -> None:
    """One password tried on many accounts from one address: the address is locked, for
    every username (the right password included); others are not."""
    limit = settings.TALLY_LOGIN_ADDRESS_FAILURE_LIMIT
    sprayer = Client()
    for index in range(limit):
        username = f"user-{index}"
        assert post_login(sprayer, "/login/", "Winter2026!", ATTACKER, username).status_code == 200
    reason = f"your address is locked for logins after {limit} failed attempts"
    cooloff = settings.AXES_COOLOFF_TIME.total_seconds()
    for url in URLS:
        assert_refused(post_login(sprayer, url, PASSWORD, ATTACKER), sprayer, reason, cooloff)
    assert failures_recorded(ip_address=ATTACKER) == limit
    elsewhere = Client()
    assert_logged_in(post_login(elsewhere, "/login/", PASSWORD, VICTIM), elsewhere, password_user)


@pytest.mark.parametrize("url", URLS)
def test_a_username_too_long_to_be_one_is_a_form_error(password_user: User, url: str) -> None:
    client = Client(raise_request_exception=False)
    response = post_login(client, url, "wrong", ATTACKER, username="u" * 300)
    assert response.status_code == 200
    page = " ".join(response.content.decode().split())
    assert "Ensure this value has at most 150 characters (it has 300)." in page
    assert not AccessAttempt.objects.exists()  # no login was attempted, so none counted
