"""API tokens for finance's scripts (django-rest-knox): only a SHA-512 hash and the first
characters (to tell tokens apart) are stored; the token itself is shown once, at creation.

Each token expires (TALLY_API_TOKEN_DAYS unless told otherwise); revoking deletes it, as
knox's authentication does with an expired one. `manage.py api_token` and the admin (knox's
*Auth tokens*) call these; every create and revoke here is audited.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone
from knox.models import AuthToken
from knox.settings import CONSTANTS, knox_settings

from teams import audit

# The longest a token may be valid for: knox's expiry is a datetime, and a ten-year token is
# no longer a token that expires.
MAX_DAYS = 3650


def default_days() -> int:
    """Days a token is valid when not told: TALLY_API_TOKEN_DAYS (knox's TOKEN_TTL)."""
    return knox_settings.TOKEN_TTL.days


def is_expired(token: AuthToken) -> bool:
    """Whether the token has expired (knox refuses it, and deletes it when presented)."""
    return token.expiry is not None and token.expiry < timezone.now()


class TokenError(ValueError):
    """A token request that cannot be done; the message names the problem."""


@dataclass(frozen=True, kw_only=True)
class NewToken:
    """A token just made: `token` is the only copy of the secret."""

    token: str
    key: str
    expiry: datetime.datetime


def user_named(username: str) -> AbstractBaseUser:
    """The active user of that name, or TokenError."""
    try:
        user: AbstractBaseUser = get_user_model().objects.get_by_natural_key(username)
    except get_user_model().DoesNotExist:
        raise TokenError(f"no user named {username!r}") from None
    if not user.is_active:
        raise TokenError(f"user {username!r} is inactive")
    return user


def create_token(*, user: AbstractBaseUser, days: int, actor: str) -> NewToken:
    """Make a token for `user` valid for `days` days, and audit it."""
    if not 1 <= days <= MAX_DAYS:
        raise TokenError(f"a token is valid from 1 to {MAX_DAYS} days, not {days}")
    with transaction.atomic():
        token, secret = AuthToken.objects.create(user=user, expiry=datetime.timedelta(days=days))
        _audit(actor=actor, action="create", token=token, before=None, after=audit.snapshot(token))
    assert token.expiry is not None
    return NewToken(token=secret, key=token.token_key, expiry=token.expiry)


def _audit(
    *,
    actor: str,
    action: str,
    token: AuthToken,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    """Audit a change to `token`, named by its key (`AuthToken.__str__` is its digest, which
    the entry leaves out too: it is the table's, not the log's)."""

    def without_digest(values: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if values is None else {k: v for k, v in values.items() if k != "digest"}

    audit.record(
        actor=actor,
        action=action,
        obj=token,
        before=without_digest(before),
        after=without_digest(after),
        name=token.token_key,
    )


def list_tokens(*, user: AbstractBaseUser) -> list[AuthToken]:
    """The user's tokens, newest first (expired ones too, until they are cleared)."""
    return list(AuthToken.objects.filter(user=user).order_by("-created"))


def revoke_tokens(*, user: AbstractBaseUser, key: str | None, actor: str) -> int:
    """Revoke the user's token whose key (its first characters, as `list_tokens` shows) is
    `key`, or every token of the user when `key` is None; audited. Returns how many."""
    tokens = AuthToken.objects.filter(user=user)
    if key is not None:
        if len(key) != CONSTANTS.TOKEN_KEY_LENGTH:
            raise TokenError(
                f"a token's key is its first {CONSTANTS.TOKEN_KEY_LENGTH} characters, "
                f"as `api_token list` shows; {key!r} is not one"
            )
        tokens = tokens.filter(token_key=key)
    with transaction.atomic():
        revoked = list(tokens.select_for_update())
        if key is not None and not revoked:
            raise TokenError(f"user {user.get_username()!r} has no token {key!r}")
        for token in revoked:
            _audit(
                actor=actor, action="delete", token=token, before=audit.snapshot(token), after=None
            )
            token.delete()
    return len(revoked)


def delete_expired_tokens() -> int:
    """Delete every expired token (knox deletes one only when it is presented)."""
    deleted, _ = AuthToken.objects.filter(expiry__lt=timezone.now()).delete()
    return deleted
