"""Shared test set-up.

`DATABASE_URL` decides the database: SQLite by default, PostgreSQL when it names one (as
`.ci/run` always does). Tests marked `postgres` need the real server and are skipped only when
no PostgreSQL is configured.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

REPO = Path(__file__).resolve().parent.parent
UPSTREAM = REPO.parent / "shared" / "upstream"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if connection.vendor == "postgresql":
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL: set DATABASE_URL=postgres://...")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_process_caches() -> Iterator[None]:
    """Per-process caches (the fleet's shapes, budgets, the cluster) hold rows of the test
    database; each test starts and ends without them."""
    from quota import admission, selectors, services

    def forget() -> None:
        selectors.forget_fleet_shapes()
        services.forget_caches()
        admission.forget_caches()

    forget()
    yield
    forget()


@pytest.fixture
def upstream() -> Path:
    """The folder of real DRA objects beside the repo (`../shared/upstream`)."""
    if not UPSTREAM.is_dir():
        pytest.fail(f"{UPSTREAM} is missing: the tests read the shared upstream objects in place")
    return UPSTREAM


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
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            yield
    finally:
        task_postrun.disconnect(_close_connections)  # type: ignore[attr-defined]  # celery-types lacks it


def _close_connections(**_: object) -> None:
    from django.db import connections

    connections.close_all()


# A small GPU fleet and device classes, for quota and billing tests.
from tests.quota.fixtures import fleet  # noqa: E402

__all__ = ["fleet", "upstream", "worker"]
