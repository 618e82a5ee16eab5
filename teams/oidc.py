"""Single sign-on with OpenID Connect: the one module that talks to the identity provider.

mozilla-django-oidc runs the authorization code flow (state, nonce, PKCE, the ID token's
signature from the provider's JWKS). This module gives it the provider's endpoints from the
discovery document of `TALLY_OIDC_ISSUER` (fetched at the first sign-in, not at start-up, so a
provider that is down stops no process and no password login), and decides who the user is:
the `TALLY_OIDC_USERNAME_CLAIM` (preferred_username) names the Django user, created at the
first sign-in; the `TALLY_OIDC_GROUPS_CLAIM` (groups) gives teams and roles through the policy
file's `sso.groups` at every sign-in (`teams.sso.apply_sso_groups`).

A user whose username is already a local account's signs in as that account: the identity
provider is trusted to say who is who (the policy file's `leads:` name such accounts).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlencode

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.http import HttpRequest
from django.urls import reverse
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from teams.sso import apply_sso_groups

log = logging.getLogger(__name__)

# The discovery document's keys Tally needs (OpenID Connect Discovery 1.0, section 3).
REQUIRED_METADATA = ("authorization_endpoint", "token_endpoint", "userinfo_endpoint", "jwks_uri")
# Issuer -> its discovery document; fetched once per process.
_metadata: dict[str, dict[str, Any]] = {}


class ProviderUnavailable(Exception):
    """The identity provider's discovery document could not be read or is not usable."""


def is_enabled() -> bool:
    return bool(settings.TALLY_OIDC_ISSUER)


def provider_metadata() -> dict[str, Any]:
    """The discovery document of `TALLY_OIDC_ISSUER`, checked: its `issuer` is the one
    configured (as the specification requires) and it names every endpoint Tally calls."""
    issuer = settings.TALLY_OIDC_ISSUER
    if issuer in _metadata:
        return _metadata[issuer]
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except (requests.RequestException, ValueError) as exc:
        raise ProviderUnavailable(f"{url}: {exc}") from exc
    if not isinstance(document, dict) or document.get("issuer", "").rstrip("/") != issuer:
        found = document.get("issuer") if isinstance(document, dict) else document
        raise ProviderUnavailable(f"{url} names the issuer {found!r}, not {issuer!r}")
    missing = [key for key in REQUIRED_METADATA if not document.get(key)]
    if missing:
        raise ProviderUnavailable(f"{url} names no {', '.join(missing)}")
    _metadata[issuer] = document
    return document


def endpoint(key: str) -> str:
    return str(provider_metadata()[key])


def provider_logout_url(request: HttpRequest) -> str | None:
    """Where to end the provider's session too after a single sign-on user logs out (RP-
    initiated logout), back to the login page; None for a password login or a provider
    without an `end_session_endpoint`."""
    id_token = request.session.get("oidc_id_token")
    if not is_enabled() or not id_token:
        return None
    try:
        end_session = provider_metadata().get("end_session_endpoint")
    except ProviderUnavailable as exc:
        log.warning("sso logout: %s", exc)
        return None
    if not end_session:
        return None
    query = urlencode(
        {
            "id_token_hint": id_token,
            "client_id": settings.OIDC_RP_CLIENT_ID,
            "post_logout_redirect_uri": request.build_absolute_uri(reverse(settings.LOGIN_URL)),
        }
    )
    return f"{end_session}?{query}"


def claimed_groups(claims: dict[str, Any]) -> list[str]:
    """The groups claim as a list of names; a claim of another shape gives none (logged)."""
    value = claims.get(settings.TALLY_OIDC_GROUPS_CLAIM, [])
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    log.warning(
        "sso: the %r claim is not a list of names; no groups", settings.TALLY_OIDC_GROUPS_CLAIM
    )
    return []


class OidcBackend(OIDCAuthenticationBackend):
    """mozilla-django-oidc's backend with the provider's endpoints discovered, users matched
    and created by username, and roles given by the groups claim at each sign-in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Django builds every backend for every password login and session: no discovery here.
        self.UserModel = get_user_model()
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None

    @property
    def OIDC_OP_TOKEN_ENDPOINT(self) -> str:  # the library's attribute name
        return endpoint("token_endpoint")

    @property
    def OIDC_OP_USER_ENDPOINT(self) -> str:
        return endpoint("userinfo_endpoint")

    @property
    def OIDC_OP_JWKS_ENDPOINT(self) -> str:
        return endpoint("jwks_uri")

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> Any:
        # Only the callback's call (which passes the nonce) is a sign-in; a password login's
        # request with `code` and `state` in its query string must not reach the provider.
        if not is_enabled() or "nonce" not in kwargs:
            return None
        return super().authenticate(request, **kwargs)

    def username(self, claims: dict[str, Any]) -> str | None:
        """The claimed username, when it is one the user model accepts."""
        value = claims.get(settings.TALLY_OIDC_USERNAME_CLAIM)
        if not isinstance(value, str) or not value:
            return None
        field = self.UserModel._meta.get_field(self.UserModel.USERNAME_FIELD)
        assert isinstance(field, models.Field)
        try:
            field.run_validators(value)
        except ValidationError:
            return None
        return value

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        if self.username(claims) is None:
            log.warning(
                "sso: refused: the %r claim is missing or not a valid username",
                settings.TALLY_OIDC_USERNAME_CLAIM,
            )
            return False
        return True

    def filter_users_by_claims(self, claims: dict[str, Any]) -> Any:
        return self.UserModel.objects.filter(
            **{self.UserModel.USERNAME_FIELD: self.username(claims)}
        )

    def describe_user_by_claims(self, claims: dict[str, Any]) -> str:
        return f"username {self.username(claims)!r}"

    def create_user(self, claims: dict[str, Any]) -> Any:
        username = self.username(claims)
        assert username is not None  # verify_claims refused the sign-in otherwise
        try:
            with transaction.atomic():  # a savepoint, in case the user is created meanwhile
                return self.UserModel.objects.create_user(username, email=claims.get("email") or "")
        except IntegrityError:
            # Created since the lookup, by `apply_policy` naming them in a team or by a second
            # sign-in of theirs: that user is the one signing in, not a failed login.
            user = self.filter_users_by_claims(claims).first()
            if user is None:
                raise
            return user

    def get_or_create_user(self, access_token: str, id_token: str, payload: dict[str, Any]) -> Any:
        user = super().get_or_create_user(access_token, id_token, payload)
        if user is not None:
            # The userinfo answer was read once by the parent; the ID token's claims are the
            # same person's, and some providers put `groups` only there.
            claims = {**payload, **self._userinfo}
            apply_sso_groups(
                user=user, groups=claimed_groups(claims), actor=f"sso:{user.get_username()}"
            )
        return user

    def get_userinfo(self, access_token: str, id_token: str, payload: dict[str, Any]) -> Any:
        self._userinfo: dict[str, Any] = super().get_userinfo(access_token, id_token, payload)
        return self._userinfo
