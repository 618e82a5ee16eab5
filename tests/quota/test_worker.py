"""The expiry task through a real Celery worker and the real Redis broker."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from celery.contrib.testing.worker import start_worker
from django.test import Client

from config.celery import app
from quota.models import QuotaRule, Reservation
from quota.tasks import expire_reservations
from tests.quota.fixtures import AT, claim, decide, gpu_request, make_team

REDIS_URL = os.environ.get("REDIS_URL", "")
pytestmark = [
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fleet"),
]


@pytest.fixture
def worker() -> Iterator[None]:
    if not REDIS_URL.startswith("redis"):
        pytest.skip("needs Redis: set REDIS_URL=redis://...")
    app.conf.update(broker_url=REDIS_URL, result_backend=REDIS_URL, task_always_eager=False)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        yield


def test_expiry_runs_in_a_worker_through_redis(client: Client, worker: None) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 4}])
    assert decide(client, claim("ghost", [gpu_request(2)]))["allowed"]
    Reservation.objects.update(expires_at=AT)
    assert expire_reservations.delay().get(timeout=20) == 1
    assert Reservation.objects.get().state == "released"
    assert QuotaRule.objects.get().in_use == 0
    assert expire_reservations.delay().get(timeout=20) == 0  # delivered twice: no change
