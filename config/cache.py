"""Django's Redis cache, failing open: the API's throttles count in it, and a Redis that stops
answering must not stop the API.

While Redis is down (or slower than its socket timeout) a read finds nothing and a write is
dropped, with a warning at most once a minute per process: the throttles let requests through
uncounted until it is back. What must hold during an outage does not live here: login
lockouts are counted in the database (django-axes), sessions and tokens too.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.redis import RedisCache
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
WARN_EVERY_SECONDS = 60.0


class FailOpenRedisCache(RedisCache):
    _warned_at = float("-inf")

    def _unavailable(self, exc: RedisError) -> None:
        now = time.monotonic()
        if now - FailOpenRedisCache._warned_at >= WARN_EVERY_SECONDS:
            FailOpenRedisCache._warned_at = now
            log.warning("cache unavailable (%s): API throttles are not counting", exc)

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        try:
            return super().get(key, default, version)
        except RedisError as exc:
            self._unavailable(exc)
            return default

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        try:
            super().set(key, value, timeout, version)
        except RedisError as exc:
            self._unavailable(exc)

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        try:
            return bool(super().add(key, value, timeout, version))
        except RedisError as exc:
            self._unavailable(exc)
            return False

    def delete(self, key: Any, version: int | None = None) -> bool:
        try:
            return bool(super().delete(key, version))
        except RedisError as exc:
            self._unavailable(exc)
            return False
