"""Billing tasks through a real Celery worker and the real Redis broker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Sum

from billing import tasks
from billing.models import UsageHour
from tests.billing.test_chargeback import SLICE, T10, claim, send_samples, snapshot

pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]


def test_rollup_tasks_run_in_a_worker_and_twice_changes_nothing(worker: None) -> None:
    snapshot([SLICE, claim("train", "gpu-0", T10)], T10)
    snapshot([], T10 + timedelta(hours=1), kinds=["ResourceClaim"])
    send_samples("GPU-H", T10, 60, 25.0)
    hour = T10.isoformat()
    assert tasks.rollup_hour.delay(hour).get(timeout=30) == 1
    first = UsageHour.objects.aggregate(Sum("utilised_gpu_ms"))
    assert first["utilised_gpu_ms__sum"] == 900_000  # an hour at 25%
    assert tasks.rollup_hour.delay(hour).get(timeout=30) == 1  # delivered twice
    assert UsageHour.objects.aggregate(Sum("utilised_gpu_ms")) == first
    assert UsageHour.objects.count() == 1
