"""The answer to a login that django-axes has locked out (AXES_LOCKOUT_CALLABLE): the portal's
and the admin's alike, a page that says what happened and when to try again, status 429 with
Retry-After."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone


def lockout_response(
    request: HttpRequest, original_response: HttpResponse | None, credentials: Any
) -> HttpResponse:
    """The lockout page. Each refused attempt counts as a failure, so the cool-off runs
    from now."""
    cooloff = settings.AXES_COOLOFF_TIME
    response = render(
        request,
        "registration/locked_out.html",
        {
            "failure_limit": settings.AXES_FAILURE_LIMIT,
            "cooloff_minutes": math.ceil(cooloff.total_seconds() / 60),
            "retry_at": timezone.now() + cooloff,
        },
        status=429,
    )
    response["Retry-After"] = str(math.ceil(cooloff.total_seconds()))
    return response
