"""Who may read `/metrics` on the web pods, and the deployment check that says when nobody can.

- `TALLY_METRICS_TOKEN` (or `_FILE`) set: a scrape needs `Authorization: Bearer <token>` (401
  without; deploy/ mounts the token and the ServiceMonitor sends it).
- No token: `TALLY_METRICS_ANONYMOUS` (default: on with DEBUG only) lets loopback and private
  (RFC 1918/4193) addresses scrape without one; off, every scrape is refused with a 403 that
  says what to set, and `manage.py check --deploy` warns (`tally.W002`). Inside a cluster every
  pod has a private address, so "internal only" is no protection there.

The worker's and the syncer's own metrics ports (`core.metrics.start_metrics_server`) serve
plain HTTP and want the same token when it is set (401 without); the `tally-metrics`
NetworkPolicy also admits only the monitoring namespace to them.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.http import HttpRequest, HttpResponse

from core.metrics import BEARER_CHALLENGE, BEARER_REFUSAL, bearer_matches

NO_TOKEN_REFUSAL = (
    "metrics need a bearer token, and none is configured: set TALLY_METRICS_TOKEN (or "
    "TALLY_METRICS_TOKEN_FILE) and give the scraper the token\n"
)
NO_TOKEN_WARNING = (
    "TALLY_METRICS_TOKEN is not set: /metrics refuses every scrape (or, with "
    "TALLY_METRICS_ANONYMOUS, answers any pod of the cluster without a token)."
)


def _is_internal(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private


def metrics_refusal(request: HttpRequest) -> HttpResponse | None:
    """Why `request` may not read the metrics, as the answer to send; None when it may."""
    token = getattr(settings, "TALLY_METRICS_TOKEN", None)
    if token:
        if bearer_matches(request.headers.get("Authorization", ""), str(token)):
            return None
        response = HttpResponse(BEARER_REFUSAL, status=401)
        response["WWW-Authenticate"] = BEARER_CHALLENGE
        return response
    if not settings.TALLY_METRICS_ANONYMOUS:
        return HttpResponse(NO_TOKEN_REFUSAL, status=403, content_type="text/plain")
    if _is_internal(str(request.META.get("REMOTE_ADDR", ""))):
        return None
    return HttpResponse("metrics are served to internal addresses only\n", status=403)


def check_metrics_token(**_: Any) -> list[checks.CheckMessage]:
    """`tally.W002` when `/metrics` has no token to check."""
    if getattr(settings, "TALLY_METRICS_TOKEN", None):
        return []
    return [
        checks.Warning(
            NO_TOKEN_WARNING,
            hint="Mount a random token and set TALLY_METRICS_TOKEN_FILE to it; the "
            "ServiceMonitor sends it (docs/operations/access.md: protected metrics).",
            id="tally.W002",
        )
    ]


class MetricsAuthConfig(AppConfig):
    """Registers the deployment check; this module holds no models (an app of its own name:
    `config` is already the webhook check's)."""

    name = "config.metrics_auth"
    label = "tally_metrics_auth"
    verbose_name = "Metrics authentication"

    def ready(self) -> None:
        checks.register(check_metrics_token, checks.Tags.security, deploy=True)
