"""Users with passwords for the login, token and session tests, and the API's cast."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from pytest_django.fixtures import SettingsWrapper

from tests.api.cast import cast

__all__ = ["cast", "fast_passwords", "password_user"]

PASSWORD = "correct horse battery staple"


@pytest.fixture(autouse=True)
def fast_passwords(settings: SettingsWrapper) -> None:
    """A cheap hasher: these tests log in tens of times, and PBKDF2 takes ~0.3 s each."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def password_user(db: None) -> User:
    """A staff user (so the admin's login and password change are open to it) with PASSWORD."""
    return User.objects.create_user("pat", password=PASSWORD, is_staff=True)
