"""Login limits for the portal and the admin: django-axes' handler (AXES_HANDLER) and the page
that answers a refused login (AXES_LOCKOUT_CALLABLE).

django-axes records each failed login (AccessAttempt: username, address, failures, last
failure), in the database that every worker shares. Its own lock is per username and address,
so guesses spread over many addresses were never slowed (issue 40, finding 6). From the same
records, within the cool-off (TALLY_LOGIN_COOLOFF_MINUTES) after each one's last failure:

- a username and an address together: TALLY_LOGIN_FAILURE_LIMIT failures lock the pair for the
  cool-off (axes' lock, kept);
- an address: TALLY_LOGIN_ADDRESS_FAILURE_LIMIT failures, whatever usernames they named, lock
  the address for the cool-off;
- a username, every address together: from TALLY_LOGIN_FAILURE_LIMIT failures on, the next
  attempt waits 1 s after the last failure, then 2, 4, ... at most TALLY_LOGIN_MAX_DELAY_SECONDS.
  A delay, not a lock: whoever guesses gets one guess per delay, and the person whose name it
  is waits at most that long, from any address.

A refused attempt is answered without checking its password and is not counted
(AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT off), so attempts made while refused lengthen
no wait, the person's least of all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from axes.handlers.database import AxesDatabaseHandler
from axes.helpers import get_client_ip_address, get_client_username
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import Max, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone


@dataclass(frozen=True)
class LoginRefusal:
    """Why a login is refused without a password check, and from when it may be tried again."""

    reason: str
    retry_at: datetime


def username_delay(failures: int) -> timedelta:
    """How long after its last failure a username may be tried again, given its failures
    from every address: none below the failure limit, then doubling from one second."""
    if failures < settings.AXES_FAILURE_LIMIT:
        return timedelta(0)
    exponent = min(failures - settings.AXES_FAILURE_LIMIT, 32)  # 2**32 s is past any cap
    return timedelta(seconds=min(2**exponent, settings.TALLY_LOGIN_MAX_DELAY_SECONDS))


def login_refusal(*, username: str, address: str, now: datetime) -> LoginRefusal | None:
    """The refusal that holds for a login as `username` from `address` at `now`, the one
    that ends last where several do; None when the password may be checked."""
    cooloff = settings.AXES_COOLOFF_TIME
    of_username, of_address = Q(username=username), Q(ip_address=address)
    counts = (
        AccessAttempt.objects.filter(attempt_time__gt=now - cooloff)
        .filter(of_username | of_address)
        .aggregate(
            pair_failures=Sum("failures_since_start", filter=of_username & of_address),
            pair_last=Max("attempt_time", filter=of_username & of_address),
            address_failures=Sum("failures_since_start", filter=of_address),
            address_last=Max("attempt_time", filter=of_address),
            username_failures=Sum("failures_since_start", filter=of_username),
            username_last=Max("attempt_time", filter=of_username),
        )
    )
    refusals = []
    if (counts["pair_failures"] or 0) >= settings.AXES_FAILURE_LIMIT:
        refusals.append(
            LoginRefusal(
                reason=f"this account is locked for logins from your address after "
                f"{settings.AXES_FAILURE_LIMIT} failed attempts",
                retry_at=counts["pair_last"] + cooloff,
            )
        )
    if (counts["address_failures"] or 0) >= settings.TALLY_LOGIN_ADDRESS_FAILURE_LIMIT:
        refusals.append(
            LoginRefusal(
                reason=f"your address is locked for logins after "
                f"{settings.TALLY_LOGIN_ADDRESS_FAILURE_LIMIT} failed attempts",
                retry_at=counts["address_last"] + cooloff,
            )
        )
    delay = username_delay(counts["username_failures"] or 0)
    if delay:
        refusals.append(
            LoginRefusal(
                reason=f"this account has had {counts['username_failures']} failed logins "
                f"lately, so each new attempt waits a little longer (at most "
                f"{settings.TALLY_LOGIN_MAX_DELAY_SECONDS} seconds)",
                retry_at=counts["username_last"] + delay,
            )
        )
    live = [refusal for refusal in refusals if refusal.retry_at > now]
    return max(live, key=lambda refusal: refusal.retry_at) if live else None


def _refusal_for(request: HttpRequest, credentials: dict[str, Any] | None) -> LoginRefusal | None:
    return login_refusal(
        username=get_client_username(request, credentials) or "",
        address=getattr(request, "axes_ip_address", None) or get_client_ip_address(request),
        now=timezone.now(),
    )


class LoginLimitsHandler(AxesDatabaseHandler):
    """axes' database handler, locking by the three limits above instead of the pair's alone."""

    def is_locked(self, request: HttpRequest, credentials: dict[str, Any] | None = None) -> bool:
        return _refusal_for(request, credentials) is not None


def lockout_response(
    request: HttpRequest, original_response: HttpResponse | None, credentials: Any
) -> HttpResponse:
    """The page for a refused login, the portal's and the admin's alike: why, and when to try
    again (status 429 with Retry-After)."""
    now = timezone.now()
    refusal = _refusal_for(request, credentials) or LoginRefusal(
        # The failure that reached a limit just now: the pair's lock, from now.
        reason=f"this account is locked for logins from your address after "
        f"{settings.AXES_FAILURE_LIMIT} failed attempts",
        retry_at=now + settings.AXES_COOLOFF_TIME,
    )
    wait_seconds = max(1, math.ceil((refusal.retry_at - now).total_seconds()))
    response = render(
        request,
        "registration/locked_out.html",
        {
            "reason": refusal.reason,
            "wait_seconds": wait_seconds,
            "wait_minutes": math.ceil(wait_seconds / 60),
            "retry_at": refusal.retry_at,
        },
        status=429,
    )
    response["Retry-After"] = str(wait_seconds)
    return response
