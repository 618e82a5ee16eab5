"""Which paths each listening port serves, so NetworkPolicies (by port) guard paths.

NetworkPolicy works on addresses and ports, not URLs. The web pods therefore listen on one
port per audience (see deploy/README.md): the webhooks for the API server, the ingest endpoint
for the node agents, the metrics for monitoring, and the rest (portal, API) for users. This
middleware makes the split real: a path prefix assigned to a port is served only on that
port, and a port with assignments serves nothing else. Probes (`/healthz`, `/readyz`) are
served on every port.

`TALLY_LISTENERS` (comma-separated `port=/prefix`, e.g.
`8443=/admission/,8444=/ingest/,9090=/metrics`) sets the assignments; unset, every port
serves everything (development). The port is the one the request arrived on: gunicorn sets
`SERVER_PORT` from the listening socket, never from the `Host` header.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, HttpResponseNotFound

PROBE_PATHS = frozenset({"/healthz", "/readyz"})


def parse_listeners(entries: list[str]) -> dict[str, tuple[str, ...]]:
    """`["8443=/admission/", ...]` as port → prefixes; a malformed entry names itself."""
    routes: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        port, _, prefix = entry.partition("=")
        port, prefix = port.strip(), prefix.strip()
        if not port.isdigit() or not prefix.startswith("/"):
            raise ImproperlyConfigured(
                f"TALLY_LISTENERS entry {entry!r} must look like 8443=/admission/"
            )
        routes[port] = (*routes.get(port, ()), prefix)
    return routes


class ListenerMiddleware:
    """Answer 404 for a path that the port the request came in on does not serve."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.routes = parse_listeners(list(getattr(settings, "TALLY_LISTENERS", [])))
        self.assigned = tuple(prefix for prefixes in self.routes.values() for prefix in prefixes)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        # What the URL router routes (a SCRIPT_NAME in front is not part of it), so that
        # `/x/metrics` under SCRIPT_NAME `/x` is judged as the `/metrics` it is served as.
        port = str(request.META.get("SERVER_PORT", ""))
        if self.routes and not self.serves(port, request.path_info):
            return HttpResponseNotFound("not served on this port\n", content_type="text/plain")
        return self.get_response(request)

    def serves(self, port: str, path: str) -> bool:
        if path in PROBE_PATHS:
            return True
        prefixes = self.routes.get(port)
        if prefixes is not None:
            return path.startswith(prefixes)
        return not path.startswith(self.assigned)
