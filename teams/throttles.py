"""Throttling of the API's token authentication, and the client address every throttle and the
login lockout (django-axes) key on.

DRF authenticates before it throttles, so a wrong token is answered 401 without ever reaching
a throttle: `ThrottledTokenAuthentication` counts each failed token against the `failed_token`
rate of the client's address, and answers a wrong token 429 (with Retry-After) once that rate
is spent. A valid token is checked first and never refused for its address's failures: a
guesser sharing an address (a NAT, an office's proxy) must not shut out finance's scripts
(issue 40, finding 6). Checking a guess costs one indexed lookup (knox finds a token by its
first characters before comparing digests), and 256-bit tokens are not found by guessing; the
throttle bounds the noise, not the odds. The counts live in Django's cache (Redis in
production), shared by every worker.
"""

from __future__ import annotations

import re
from typing import cast

from django.http import HttpRequest
from drf_spectacular.contrib.knox_auth_token import KnoxTokenScheme
from knox.auth import TokenAuthentication
from knox.settings import knox_settings
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle


def client_ip(request: HttpRequest | Request) -> str:
    """The client's address: the peer's, or X-Forwarded-For's as far as NUM_PROXIES trusts."""
    return BaseThrottle().get_ident(cast(Request, request)) or ""


class FailedTokenThrottle(SimpleRateThrottle):
    """Failed token authentications per client address, at the `failed_token` rate."""

    scope = "failed_token"
    num_requests: int
    duration: int

    def get_cache_key(self, request: Request, view: object) -> str:
        return self.cache_format % {"scope": self.scope, "ident": client_ip(request)}

    def refuse_if_spent(self, request: Request) -> None:
        """Raise Throttled (429, Retry-After) when the address has no failures left."""
        self.key = self.get_cache_key(request, None)
        self.history = self.cache.get(self.key, [])
        self.now = self.timer()
        while self.history and self.history[-1] <= self.now - self.duration:
            self.history.pop()
        if len(self.history) >= self.num_requests:
            raise Throttled(wait=self.wait())

    def record_failure(self) -> None:
        """Count one failure of the address `refuse_if_spent` has just read."""
        self.throttle_success()


_TOKEN = re.compile(rb"[0-9a-f]{%d}" % knox_settings.AUTH_TOKEN_CHARACTER_LENGTH)


class ThrottledTokenAuthentication(TokenAuthentication):
    """knox's `Authorization: Token <token>` (hashed, expiring tokens), with each failure
    counted against the client's address."""

    def authenticate(self, request: Request) -> tuple[object, object] | None:
        if not self._is_token_header(request):
            return None
        try:
            return super().authenticate(request)
        except AuthenticationFailed:
            throttle = FailedTokenThrottle()
            throttle.refuse_if_spent(request)
            throttle.record_failure()
            raise

    def authenticate_credentials(self, token: bytes) -> tuple[object, object]:
        # Only what knox makes (hex) reaches its decoding and the database: a NUL byte or a
        # byte that is no UTF-8 would be a server error there.
        if not _TOKEN.fullmatch(token):
            raise AuthenticationFailed("Invalid token.")
        return super().authenticate_credentials(token)

    def _is_token_header(self, request: Request) -> bool:
        header = request.META.get("HTTP_AUTHORIZATION", "").split()
        return bool(header) and header[0].lower() == self.authenticate_header(request).lower()


class ThrottledTokenScheme(KnoxTokenScheme):
    """The token scheme in the OpenAPI schema: `Authorization: Token <token>`."""

    target_class = "teams.throttles.ThrottledTokenAuthentication"
    name = "apiToken"
