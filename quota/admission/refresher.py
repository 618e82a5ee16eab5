"""Work a web worker does off the request path: in one background thread at a time.

A request that finds a cache due for refreshing starts the work and is served what the cache
holds; the next request past due while the work runs starts nothing. The thread has its own
database connection (Django's are per thread), closed when the work ends, so an idle worker
holds no extra connection. Threads are made per run, after gunicorn has forked the worker: a
forked child never inherits one running (a parent's thread is not alive in the child).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import connections

log = logging.getLogger(__name__)


class Refresher:
    """Runs one piece of work at a time in a background thread named `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, work: Callable[[], None]) -> bool:
        """Start `work` in the background unless work is running already; whether it did."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            self._thread = threading.Thread(
                target=self._run, args=(work,), name=self.name, daemon=True
            )
            self._thread.start()
            return True

    def join(self, timeout: float | None = None) -> None:
        """Wait until the work running now, if any, has ended (tests, benchmarks)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception:
            log.exception("%s: the background work failed", self.name)
        finally:
            connections.close_all()  # this thread's own
