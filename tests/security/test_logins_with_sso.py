"""The login limits (teams/lockout.py) hold for password logins with single sign-on configured
too: the OIDC backend (teams/oidc.py) sits beside the password one, answers no password login
and never calls the provider for one, even one whose query string carries `code` and `state`."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from pytest_django.fixtures import SettingsWrapper

from teams import oidc
from tests.security.conftest import PASSWORD
from tests.security.test_logins import (
    ATTACKER,
    VICTIM,
    age_attempts,
    assert_locked_out,
    assert_logged_in,
    fail_until_locked,
    post_login,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sso_configured(settings: SettingsWrapper) -> None:
    # A provider nobody serves: a password login that reached it would fail loudly.
    settings.TALLY_OIDC_ISSUER = "http://127.0.0.1:9"
    settings.OIDC_RP_CLIENT_ID = "tally"
    settings.OIDC_RP_CLIENT_SECRET = "secret"
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, "teams.oidc.OidcBackend"]
    oidc._metadata.clear()


@pytest.mark.parametrize("url", ["/login/", "/login/?code=x&state=y", "/admin/login/"])
def test_password_logins_keep_their_limits_beside_sso(password_user: User, url: str) -> None:
    attacker = Client()
    fail_until_locked(attacker, url)
    assert_locked_out(post_login(attacker, url, PASSWORD, ATTACKER), attacker)
    age_attempts(1)
    elsewhere = Client()
    assert_logged_in(post_login(elsewhere, url, PASSWORD, VICTIM), elsewhere, password_user)
    assert oidc._metadata == {}  # the provider was never asked


def test_the_login_page_offers_sso() -> None:
    page = Client().get("/login/?next=/fleet/").content.decode()
    assert "Sign in with SSO" in page
    assert 'href="/oidc/authenticate/?next=/fleet/"' in page
