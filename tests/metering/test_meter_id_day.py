"""A device that gains a UUID in the middle of a day is billed the whole day, to the
millisecond: its agent's samples named by driver and device until then (stored under the
identity formed for it), by UUID after, each counted once in the hours of the allocation that
held it all day. Whether the driver updates its slice in place or deletes it and publishes it
again (a new device row under the same name), through the live sync's watch events,
`/ingest/samples` and the rollup's dirty marks, on PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db.models import Sum
from django.test import Client
from django.urls import path
from django.utils import timezone

from inventory import services
from inventory.models import Allocation, Device
from metering import rollup, views
from metering.models import DirtyHour, Sample, UsageHour
from metering.services import issue_agent_token
from tests.inventory.test_allocation_metering import gpu

urlpatterns = [path("ingest/samples", views.ingest_samples)]

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

DAY = (
    (timezone.now() - timedelta(days=2))
    .astimezone(UTC)
    .replace(hour=0, minute=0, second=0, microsecond=0)
)
NOON = DAY + timedelta(hours=12)
HOUR_MS = 3_600_000
UUID = "GPU-7d1e2c3b-4a5f-4e6d-8c7b-9a0f1e2d3c4b"


def resource_slice(generation: int, uuid: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": generation, "resourceSliceCount": 1},
            "devices": [gpu(uuid)],
        },
    }


def claim() -> dict[str, Any]:
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "vision", "uid": "uid-train"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        },
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def watch(*events: tuple[str, dict[str, Any], datetime]) -> None:
    report = services.apply_watch_events(
        cluster=services.get_cluster("lab"),
        events=[services.WatchEvent(event_type=kind, obj=obj, at=at) for kind, obj, at in events],
    )
    assert not report.errors


def post(token: str, samples: list[dict[str, Any]]) -> None:
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": "node-a", "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    assert response.json()["accepted"] == len(samples)


def minute_means(start: datetime, minutes: int, util: float, **name: str) -> list[dict[str, Any]]:
    """An agent's minute means, each holding exactly its minute."""
    return [
        {
            **name,
            "ts": (start + timedelta(minutes=minute)).isoformat(),
            "gpu_util": util,
            "covered_seconds": 60,
        }
        for minute in range(minutes)
    ]


def roll_up(now: datetime) -> None:
    """What beat does: the hour just ended and every hour marked, until none is left."""
    rollup.rollup_pending(now=now, limit=100)
    while DirtyHour.objects.filter(hour__lt=now).exists():
        rollup.rollup_pending(now=now, limit=100)


def day_totals() -> tuple[int, int, int]:
    totals = UsageHour.objects.filter(hour__gte=DAY, hour__lt=DAY + timedelta(days=1)).aggregate(
        allocated=Sum("allocated_gpu_ms"),
        utilised=Sum("utilised_gpu_ms"),
        unmeasured=Sum("unmeasured_gpu_ms"),
    )
    return totals["allocated"], totals["utilised"], totals["unmeasured"]


@pytest.mark.parametrize("republished", [False, True], ids=["updated-in-place", "republished"])
def test_a_device_that_gains_a_uuid_at_noon_is_billed_the_whole_day(republished: bool) -> None:
    # 00:00: gpu-0 publishes no uuid; a claim holds it all day.
    watch(("ADDED", resource_slice(1), DAY), ("ADDED", claim(), DAY))
    held = Allocation.objects.get()
    formed = held.meter_id
    assert formed.startswith("dra-")
    token = issue_agent_token(cluster=held.cluster, node="node-a", actor="ops")

    # The morning, at 40%, named by driver and device: stored under the formed identity, and
    # rolled up before the change.
    post(token, minute_means(DAY, 720, 40.0, driver="gpu.nvidia.com", device="gpu-0"))
    assert set(Sample.objects.values_list("device_uuid", flat=True)) == {formed}
    roll_up(NOON)
    assert day_totals() == (12 * HOUR_MS, 12 * HOUR_MS * 40 // 100, 0)

    # Noon's mark (the morning's last sample reaches it) put aside: the change alone marks it.
    DirtyHour.objects.filter(hour=NOON).delete()

    # 12:00: the driver upgrade publishes the uuid.
    if republished:
        watch(
            ("DELETED", resource_slice(1), NOON),
            ("ADDED", resource_slice(1, UUID), NOON),
        )
    else:
        watch(("MODIFIED", resource_slice(2, UUID), NOON))
    present = Device.objects.get(gone_at=None)
    held.refresh_from_db()
    assert (present.meter_id, held.meter_id, held.device_id) == (UUID, formed, present.pk)
    assert DirtyHour.objects.filter(hour=NOON).exists()  # the hours since the change

    # The afternoon, at 80%, by uuid.
    post(token, minute_means(NOON, 720, 80.0, uuid=UUID))
    roll_up(DAY + timedelta(days=1, hours=1))

    # The whole day, each sample once: 12 h at 40% and 12 h at 80%, nothing unmeasured.
    assert day_totals() == (24 * HOUR_MS, 12 * HOUR_MS * 40 // 100 + 12 * HOUR_MS * 80 // 100, 0)
    assert set(UsageHour.objects.values_list("allocation_id", "device_uuid")) == {(held.pk, formed)}
    # Rolled up again, the same.
    rollup.rollup_hours(
        hours=[DAY + timedelta(hours=n) for n in range(24)], now=DAY + timedelta(days=2)
    )
    assert day_totals() == (24 * HOUR_MS, 12 * HOUR_MS * 40 // 100 + 12 * HOUR_MS * 80 // 100, 0)
