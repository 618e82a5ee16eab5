"""Operational endpoints: liveness, readiness and metrics.

- `/healthz`: the process is up and serving (liveness; touches nothing else, so a database
  outage never gets healthy pods restarted).
- `/readyz`: the database answers, and Redis does where it is the broker (`REDIS_URL`, or a
  `redis://`/`rediss://` `CELERY_BROKER_URL`), each within a short timeout. 200 or 503 with a
  JSON body naming each check's result, so a failing probe says what failed.
- `/metrics`: Prometheus exposition (see `core.metrics`). Not public: with
  `TALLY_METRICS_TOKEN` set it needs `Authorization: Bearer <token>`; without one it refuses
  every scrape unless `TALLY_METRICS_ANONYMOUS` (DEBUG's default) lets loopback and private
  addresses in (`config.metrics_auth`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, URLResolver, path
from django.views.decorators.cache import never_cache

from config.metrics_auth import metrics_refusal
from core import metrics

log = logging.getLogger(__name__)

REDIS_TIMEOUT_SECONDS = 1.0
REDIS_SCHEMES = ("redis://", "rediss://")


@never_cache
def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


def check_database() -> None:
    # A failed check closes the connection: the next probe connects afresh instead of
    # reusing a broken one (CONN_MAX_AGE keeps connections between requests).
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:
        connection.close()
        raise


def redis_url() -> str | None:
    """The Redis the processes depend on, or None when the broker is not Redis."""
    for url in (settings.CELERY_BROKER_URL, settings.REDIS_URL):
        if url and url.startswith(REDIS_SCHEMES):
            return str(url)
    return None


def check_redis(url: str) -> None:
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
        socket_timeout=REDIS_TIMEOUT_SECONDS,
        retry_on_timeout=False,
    )
    try:
        client.ping()
    finally:
        client.close()


def readiness_checks() -> dict[str, Callable[[], None]]:
    checks: dict[str, Callable[[], None]] = {"database": check_database}
    url = redis_url()
    if url is not None:
        checks["redis"] = lambda: check_redis(url)
    return checks


@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    results: dict[str, str] = {}
    for name, check in readiness_checks().items():
        try:
            check()
        except (DatabaseError, redis.RedisError, OSError) as exc:
            # The exception names the host and the reason, never a password.
            log.warning("readiness: %s unavailable: %s: %s", name, type(exc).__name__, exc)
            results[name] = f"unavailable: {type(exc).__name__}"
        else:
            results[name] = "ok"
    failed = sorted(name for name, result in results.items() if result != "ok")
    return JsonResponse(
        {"status": "unavailable" if failed else "ok", "checks": results, "failed": failed},
        status=503 if failed else 200,
    )


@never_cache
def metrics_view(request: HttpRequest) -> HttpResponse:
    refusal = metrics_refusal(request)
    if refusal is not None:
        return refusal
    try:
        body = metrics.render()
    except DatabaseError as exc:
        # The process metrics still matter most when the database is down.
        log.warning("metrics: database collector failed: %s", exc)
        connection.close()
        body = metrics.render(include_database=False)
    return HttpResponse(body, content_type=metrics.CONTENT_TYPE)


urlpatterns: list[URLPattern | URLResolver] = [
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
]
