"""The cast of users and the seeded dataset for every API test (see tests/api/cast.py), and
API tokens for them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import AbstractBaseUser

from teams.tokens import create_token
from tests.api.cast import cast, seeded

__all__ = ["api_token", "cast", "seeded"]


@pytest.fixture
def api_token() -> Callable[[AbstractBaseUser], str]:
    """Make a day's API token (`Authorization: Token <token>`) for a user."""

    def make(user: AbstractBaseUser) -> str:
        return create_token(user=user, days=1, actor="test").token

    return make
