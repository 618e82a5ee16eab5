"""Shared test set-up.

The suite runs on PostgreSQL: the server `DATABASE_URL` names (as `.ci/run` always does), else
the embedded one in `var/postgres` (`python3 dev.py test` starts and stops it; see
`db/embedded.py`). pytest-django creates and drops its `test_<name>` database there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# Property tests assert what holds, never how fast: on a busy two-core machine (CI, or the
# suite beside other work) one slow draw or example must not fail them. Speed is measured
# in bench/, against a floor in the same run.
hypothesis_settings.register_profile(
    "tally", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
hypothesis_settings.load_profile("tally")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh_process_caches() -> Iterator[None]:
    """Per-process caches (the fleet's shapes, budgets, the cluster) hold rows of the test
    database; each test starts and ends without them."""
    from quota.admission import service

    def forget() -> None:
        service.forget_caches()

    forget()
    yield
    forget()


@pytest.fixture
def worker() -> Iterator[None]:
    """A real Celery worker on the real Redis broker, in a thread (needs REDIS_URL)."""
    from celery.contrib.testing.worker import start_worker
    from celery.signals import task_postrun

    from config.celery import app

    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url.startswith("redis"):
        pytest.skip("needs Redis: set REDIS_URL=redis://...")
    app.conf.update(broker_url=redis_url, result_backend=redis_url, task_always_eager=False)
    # An earlier test may have made the app pick its (disabled) result backend already.
    app._backend_cache = None  # type: ignore[attr-defined]
    app._local.__dict__.pop("backend", None)  # type: ignore[attr-defined]
    # Each task's database connection is the worker thread's own: closed after the task, so
    # none is left open on the test database when it is dropped.
    task_postrun.connect(_close_connections, weak=False)
    ran: list[str] = []

    def remember(task_id: str = "", **_: object) -> None:
        ran.append(task_id)

    task_postrun.connect(remember, weak=False)
    # Tasks a run killed midway left queued would be taken first: the queue starts empty.
    app.control.purge()
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            yield
    finally:
        task_postrun.disconnect(_close_connections)  # type: ignore[attr-defined]  # celery-types lacks it
        task_postrun.disconnect(remember)  # type: ignore[attr-defined]
        # The results were for the test only: none is left in Redis.
        for task_id in ran:
            app.AsyncResult(task_id).forget()


def _close_connections(**_: object) -> None:
    from django.db import connections

    connections.close_all()


# A small GPU fleet and device classes, for quota and billing tests.
from tests.quota.fixtures import fleet  # noqa: E402

__all__ = ["fleet", "worker"]
