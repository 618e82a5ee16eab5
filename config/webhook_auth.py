"""Only the Kubernetes API server may call the admission webhooks: it must present a client
certificate that Tally's CA verified.

The TLS layer verifies: gunicorn (deploy/gunicorn.conf.py) loads TALLY_WEBHOOK_CLIENT_CA_FILE
as its only trusted CA with `cert_reqs = CERT_OPTIONAL`, so a client that presents a
certificate from another CA fails the handshake, and one that presents none gets through to
here. `WebhookCallerMiddleware` then refuses, on the webhook paths, a request whose
connection carries no verified certificate, or one whose names (subject CN and DNS SANs) are
not in TALLY_WEBHOOK_CLIENT_NAMES when that list is set: 403, one line saying why, and a
warning in the log. The view is never called, so nothing is decided or reserved for it.

Without a CA configured the webhooks serve anyone who reaches them, as before; the deployment
check `tally.W001` (`manage.py check --deploy`) and gunicorn at start-up say so.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.http import HttpRequest, HttpResponse

from core.logging import ADMISSION_PREFIX

log = logging.getLogger(__name__)
# gunicorn puts the client's socket (an ssl.SSLSocket under TLS) in the WSGI environ.
SOCKET_KEY = "gunicorn.socket"
NO_CA_WARNING = (
    "TALLY_WEBHOOK_CLIENT_CA_FILE is not set: the admission webhooks do not authenticate "
    "their caller, so anyone who reaches the webhook port can reserve a team's quota"
)


class CallerRefused(Exception):
    """The connection may not call the webhooks; the message says why, in one line."""


def peer_certificate(environ: dict[str, Any]) -> dict[str, Any]:
    """The client certificate the TLS layer verified on this request's connection."""
    connection = environ.get(SOCKET_KEY)
    if not isinstance(connection, ssl.SSLSocket):
        raise CallerRefused("no client certificate: the connection is not TLS")
    certificate = connection.getpeercert()
    if not certificate:
        # CERT_OPTIONAL: no certificate presented (one from another CA fails the handshake).
        raise CallerRefused("no client certificate presented")
    return certificate


def certificate_names(certificate: dict[str, Any]) -> list[str]:
    """The subject's commonName(s), then the DNS subjectAltNames, as `getpeercert()` gives
    them."""
    names = [
        value
        for relative_name in certificate.get("subject", ())
        for key, value in relative_name
        if key == "commonName"
    ]
    names += [value for kind, value in certificate.get("subjectAltName", ()) if kind == "DNS"]
    return names


def authenticate(environ: dict[str, Any], allowed_names: Iterable[str]) -> str:
    """The caller's first name if its verified certificate may call the webhooks (any
    name, when `allowed_names` is empty); `CallerRefused` otherwise."""
    names = certificate_names(peer_certificate(environ))
    allowed = set(allowed_names)
    if not allowed:
        return names[0] if names else ""
    for name in names:
        if name in allowed:
            return name
    shown = ", ".join(names) or "no name"
    raise CallerRefused(f"client certificate ({shown}) is not an allowed webhook caller")


class WebhookCallerMiddleware:
    """On the webhook paths, answer 403 to a caller without an allowed, verified client
    certificate (only when TALLY_WEBHOOK_CLIENT_CA_FILE is set)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.required = bool(settings.TALLY_WEBHOOK_CLIENT_CA_FILE)
        self.allowed_names = tuple(settings.TALLY_WEBHOOK_CLIENT_NAMES)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        # The routed path, not `request.path`: a SCRIPT_NAME in front must not move a webhook
        # out of this check while the router still sends it to the webhook's view.
        if self.required and request.path_info.startswith(ADMISSION_PREFIX):
            try:
                authenticate(request.META, self.allowed_names)
            except CallerRefused as exc:
                log.warning(
                    "webhook caller refused: %s (from %s, %s %s)",
                    exc,
                    request.META.get("REMOTE_ADDR", "?"),
                    request.method,
                    request.path,
                )
                return HttpResponse(
                    f"webhook caller not authenticated: {exc}\n",
                    status=403,
                    content_type="text/plain",
                )
        return self.get_response(request)


def check_webhook_authentication(**_: Any) -> list[checks.CheckMessage]:
    """`tally.W001` when the webhooks do not authenticate their caller."""
    if settings.TALLY_WEBHOOK_CLIENT_CA_FILE:
        return []
    return [
        checks.Warning(
            NO_CA_WARNING,
            hint="Mount the CA that issued the API server's webhook client certificate and "
            "set TALLY_WEBHOOK_CLIENT_CA_FILE to it (deploy/README.md: the webhook's callers).",
            id="tally.W001",
        )
    ]


class WebhookAuthConfig(AppConfig):
    """Registers the deployment check; `config` holds no models."""

    name = "config"
    label = "tally_webhook_auth"
    verbose_name = "Webhook caller authentication"

    def ready(self) -> None:
        checks.register(check_webhook_authentication, checks.Tags.security, deploy=True)
