"""What an allocation is metered and counted by is fixed from its device when it starts.

The sync takes meter id, unit, model, profile and shares from the device when it opens an
allocation, or when it links one seen before its device; later changes to the device leave
them. The migration that added them filled them in for the allocations already there.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from inventory import claim_sync, profiles, services
from inventory.models import Allocation, Device
from tests.factories import DeviceFactory, MigDeviceFactory, OtherDeviceFactory

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
T1 = T0 + timedelta(hours=1)
T2 = T0 + timedelta(hours=2)
GPU_UUID = "GPU-0d3e5f7a-9b1c-4d2e-8f6a-1b3c5d7e9f00"


def gpu(uuid: str = "") -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "type": {"string": "gpu"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
    }
    if uuid:
        attributes["uuid"] = {"string": uuid}
    return {"name": "gpu-0", "attributes": attributes, "capacity": {"memory": {"value": "80Gi"}}}


def resource_slice(device: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [device],
        },
    }


def claim(name: str, **result: Any) -> dict[str, Any]:
    """A claim allocated gpu-0 of node-a; `result` adds to its result (consumedCapacity)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "vision", "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.nvidia.com",
                            "pool": "node-a",
                            "device": "gpu-0",
                            **result,
                        }
                    ]
                }
            }
        },
    }


def sync(objects: list[dict[str, Any]], at: datetime) -> None:
    report = services.import_snapshot(cluster=services.get_cluster("lab"), objects=objects, at=at)
    assert not report.errors


def metering(allocation: Allocation) -> tuple[Any, ...]:
    allocation.refresh_from_db()
    return tuple(getattr(allocation, name) for name in claim_sync.METERING_FIELDS)


def test_an_allocation_keeps_its_devices_meter_id_when_the_device_gains_a_uuid() -> None:
    sync([resource_slice(gpu()), claim("a")], T0)
    allocation = Allocation.objects.get()
    formed = profiles.meter_id("lab", "gpu.nvidia.com", "node-a", "gpu-0")
    kept = (formed, "gpu", "NVIDIA H100 80GB HBM3", "", Decimal(1), Decimal(1))
    assert metering(allocation) == kept

    sync([resource_slice(gpu(GPU_UUID)), claim("a")], T1)
    assert Device.objects.get().meter_id == GPU_UUID
    assert metering(allocation) == kept


def test_an_allocation_seen_before_its_device_takes_the_device_when_linked() -> None:
    # Half the GPU's memory consumed (KEP-5075): half its share, worked out when linked.
    sync([claim("early", consumedCapacity={"memory": "40Gi"}, shareID="a")], T0)
    allocation = Allocation.objects.get()
    assert allocation.device is None
    assert metering(allocation) == ("", "", "", "", 0, 0)

    sync([resource_slice(gpu(GPU_UUID))], T1)
    allocation.refresh_from_db()
    assert allocation.device == Device.objects.get()
    assert metering(allocation) == (
        GPU_UUID,
        "gpu",
        "NVIDIA H100 80GB HBM3",
        "",
        Decimal(1),
        Decimal("0.5"),
    )


@pytest.mark.django_db(transaction=True)
def test_the_migration_fills_in_existing_allocations_from_their_devices() -> None:
    before = [("inventory", "0004_version_baselines")]
    after = [("inventory", "0005_allocation_metering")]
    gpu_device = DeviceFactory.create()
    mig_device = MigDeviceFactory.create(parent=gpu_device)
    channel = OtherDeviceFactory.create(node=gpu_device.node)
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old_apps = executor.loader.project_state(before).apps
    old_claim = old_apps.get_model("inventory", "ResourceClaim")
    old_allocation = old_apps.get_model("inventory", "Allocation")

    def held(device: Device | None, **fields: Any) -> int:
        claim = old_claim.objects.create(
            cluster_id=gpu_device.cluster_id,
            namespace="vision",
            name=f"claim-{old_claim.objects.count()}",
            uid=f"uid-{old_claim.objects.count()}",
            api_version="resource.k8s.io/v1",
            spec={},
            first_seen=T0,
        )
        return int(
            old_allocation.objects.create(
                cluster_id=gpu_device.cluster_id,
                claim_id=claim.pk,
                device_id=device.pk if device else None,
                request="gpu",
                driver="gpu.nvidia.com",
                pool="node-a",
                device_name=device.name if device else "gpu-9",
                start=T0,
                **fields,
            ).pk
        )

    ids = {
        "whole": held(gpu_device),
        "quarter": held(gpu_device, consumed_capacity={"memory": "20Gi"}, share_id="q"),
        "mig": held(mig_device),
        "channel": held(channel),
        "unlinked": held(None),
    }

    MigrationExecutor(connection).migrate(after)

    filled = {name: metering(Allocation.objects.get(pk=pk)) for name, pk in ids.items()}
    h100 = (gpu_device.meter_id, "gpu", "NVIDIA H100 80GB HBM3", "")
    assert filled == {
        "whole": (*h100, Decimal(1), Decimal(1)),
        "quarter": (*h100, Decimal(1), Decimal("0.25")),
        "mig": (
            mig_device.meter_id,
            "gpu",
            mig_device.product_name,
            mig_device.profile,
            mig_device.gpu_share,
            mig_device.gpu_share,
        ),
        "channel": ("", "gpu", "", "", Decimal(0), Decimal(0)),
        "unlinked": ("", "", "", "", Decimal(0), Decimal(0)),
    }
    # The rest of the schema is back at the newest migrations for the tests that follow.
    MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
