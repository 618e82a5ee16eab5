"""Which requests may read from the read replica: GET pages of the portal and the API.

With `DATABASE_REPLICA_URL` set, settings add this middleware and `config.routers.ReplicaRouter`.
The middleware marks a request read-only for its duration (a context variable) when it is a GET,
HEAD or OPTIONS of a portal page (a view of `frontend`) or under `/api/`; the router sends that
request's reads to the replica, except inside a transaction. Everything else (the admin, the
webhooks, ingest, probes, tasks, commands) never reads from the replica.

A replica lags the primary, so a browser that has just written (a POST, PUT, PATCH or DELETE to
the portal or the API) gets a cookie that keeps its reads on the primary for
`DATABASE_REPLICA_PIN_SECONDS`: the page it is redirected to shows what it wrote. API clients
that keep no cookies read what the replica has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve

from core.logging import ADMISSION_PREFIX

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Holds the Unix time until which this browser reads from the primary. Forging it only moves
# the forger's own reads to the primary.
PIN_COOKIE = "tally_primary_until"

# Paths that write, or must read what was just written, whatever their method.
NEVER_FROM_REPLICA = (ADMISSION_PREFIX, "/ingest/")

_replica_reads: ContextVar[bool] = ContextVar("tally_replica_reads", default=False)


def replica_reads_allowed() -> bool:
    """Whether the code running now may read from the replica."""
    return _replica_reads.get()


@contextmanager
def replica_reads(allowed: bool = True) -> Iterator[None]:
    """Allow (or, nested, forbid) reads from the replica for the code inside."""
    token = _replica_reads.set(allowed)
    try:
        yield
    finally:
        _replica_reads.reset(token)


def serves_replica_reads(path: str) -> bool:
    """A path of the API or of a portal page: the requests the replica may serve."""
    if path.startswith("/api/"):
        return True
    if path.startswith(NEVER_FROM_REPLICA):
        return False  # the admission webhooks and ingest: no URL resolving on their hot path
    try:
        match = resolve(path)
    except Resolver404:
        return False
    return str(getattr(match.func, "__module__", "")).startswith("frontend.")


def pinned_to_primary(request: HttpRequest) -> bool:
    try:
        return int(request.COOKIES.get(PIN_COOKIE, "0")) > time.time()
    except ValueError:
        return False


class ReplicaReadsMiddleware:
    """Mark GET pages of the portal and the API read-only; pin a writer's reads to the primary."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not serves_replica_reads(request.path_info):
            return self.get_response(request)
        safe = request.method in SAFE_METHODS
        with replica_reads(safe and not pinned_to_primary(request)):
            response = self.get_response(request)
        pin_seconds: int = settings.DATABASE_REPLICA_PIN_SECONDS
        if not safe and pin_seconds:
            response.set_cookie(
                PIN_COOKIE,
                str(int(time.time()) + pin_seconds),
                max_age=pin_seconds,
                httponly=True,
                samesite="Lax",
                secure=settings.SESSION_COOKIE_SECURE,
            )
        return response
