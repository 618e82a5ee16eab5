"""The expiry task through a real Celery worker and the real Redis broker."""

from __future__ import annotations

import pytest
from django.test import Client

from quota.models import QuotaRule, Reservation
from quota.tasks import expire_reservations
from tests.quota.fixtures import AT, claim, decide, gpu_request, make_team

pytestmark = [
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fleet"),
]


def test_expiry_runs_in_a_worker_through_redis(client: Client, worker: None) -> None:
    make_team([{"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 4}])
    assert decide(client, claim("ghost", [gpu_request(2)]))["allowed"]
    Reservation.objects.update(expires_at=AT)
    assert expire_reservations.delay().get(timeout=20) == 1
    assert Reservation.objects.get().state == "released"
    assert QuotaRule.objects.get().in_use == 0
    assert expire_reservations.delay().get(timeout=20) == 0  # delivered twice: no change
