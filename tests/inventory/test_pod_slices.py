"""A multi-host device of a whole TPU pod counts every chip it holds (issue 36): the share
columns hold up to 999,999 units, not 999, from the inventory to the usage rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from inventory import selectors, services
from inventory.dra import MAX_DEVICE_UNITS
from inventory.models import Device
from metering.models import UsageHour
from metering.rollup import rollup_hours
from teams.models import Team
from tests.factories import AllocationFactory

pytestmark = pytest.mark.django_db
AT = datetime(2026, 12, 1, 8, tzinfo=UTC)
HOSTS = 1_024  # a v4 pod: 4,096 chips, four a host
DRIVER = "tpu.google.com"


def pod_slice() -> list[dict[str, Any]]:
    """A central controller's pool: one counter per host (its 4 chips), and the 4,096-chip
    slice spanning every host, as KEP-4815's multi-host example publishes them."""
    counters = {f"tpus-host-{n}": {"value": "4"} for n in range(HOSTS)}
    pool = {"generation": 1, "name": "tpu-pod", "resourceSliceCount": 2}
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "tpu-pod-counters"},
            "spec": {
                "driver": DRIVER,
                "pool": pool,
                "sharedCounters": [{"name": "tpu-pod-set", "counters": counters}],
            },
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "tpu-pod-devices"},
            "spec": {
                "driver": DRIVER,
                "pool": pool,
                "perDeviceNodeSelection": True,
                "devices": [
                    {
                        "name": "tpu-16x16x16",
                        "nodeSelector": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {
                                            "key": "kubernetes.io/hostname",
                                            "operator": "In",
                                            "values": [f"host-{n}" for n in range(HOSTS)],
                                        }
                                    ]
                                }
                            ]
                        },
                        "attributes": {
                            "tpuGen": {"string": "v4"},
                            "topology": {"string": "16x16x16"},
                        },
                        "capacity": {"tpus": {"value": str(4 * HOSTS)}},
                        "consumesCounters": [{"counterSet": "tpu-pod-set", "counters": counters}],
                    }
                ],
            },
        },
    ]


def test_a_whole_pod_slice_counts_its_4096_chips_to_the_usage_rows() -> None:
    cluster = services.get_cluster("fx")
    report = services.import_snapshot(
        cluster=cluster, objects=pod_slice(), at=AT, kinds=["ResourceSlice"]
    )
    assert report.errors == []
    device = Device.objects.get(driver=DRIVER, name="tpu-16x16x16")
    assert device.gpu_share == Decimal(4 * HOSTS) < MAX_DEVICE_UNITS
    (row,) = selectors.capacity_by_model()
    assert (row["unit"], row["gpus"], row["free"]) == ("tpu", 4 * HOSTS, 4 * HOSTS)
    team = Team.objects.create(slug="tpu", name="TPU")
    allocation = AllocationFactory.create(
        device=device, start=AT, end=AT + timedelta(hours=1), team=team
    )
    assert allocation.gpu_share == Decimal(4 * HOSTS)
    rollup_hours(hours=[AT], now=AT + timedelta(hours=2))
    (usage,) = UsageHour.objects.filter(allocation=allocation)
    assert usage.gpu_share == Decimal(4 * HOSTS)
    assert usage.allocated_gpu_ms == 4 * HOSTS * 3_600_000
