"""Fleet counts of AMD's GPU DRA driver in auto-partition mode (vendors/amd-mi300x-autopartition).

With `AutoPartition` on, the driver publishes for each partitionable GPU one device per
compute+memory mode (gpu-0-spx-nps1 .. gpu-0-cpx-nps4), every one consuming that GPU's
one-mode counter set whole: five devices, one GPU. Claims share a mode device by its
`partitions` capacity, so each device is the whole GPU in that mode and a claim its fraction.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from inventory import selectors, services
from inventory.dumps import iter_objects
from inventory.models import Device, DeviceKind
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db
AT = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
FIXTURE = DRA / "vendors" / "amd-mi300x-autopartition.yaml"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"


def load(objects: list[dict[str, Any]] | None = None) -> list[Device]:
    report = services.import_snapshot(
        cluster=services.get_cluster("fx"),
        objects=objects if objects is not None else list(iter_objects(FIXTURE)),
        at=AT,
        kinds=["ResourceSlice"],
    )
    assert report.errors == []
    return list(Device.objects.filter(driver="gpu.amd.com", gone_at__isnull=True).order_by("name"))


def test_each_gpus_mode_devices_are_one_gpu() -> None:
    devices = load()
    assert len(devices) == 10
    assert {d.name: (d.kind, d.gpu_share, d.profile) for d in devices if d.name[4] == "0"} == {
        "gpu-0-spx-nps1": (DeviceKind.GPU, Decimal(1), "spx_nps1"),
        "gpu-0-dpx-nps2": (DeviceKind.PARTITION, Decimal(1), "dpx_nps2"),
        "gpu-0-qpx-nps1": (DeviceKind.PARTITION, Decimal(1), "qpx_nps1"),
        "gpu-0-cpx-nps1": (DeviceKind.PARTITION, Decimal(1), "cpx_nps1"),
        "gpu-0-cpx-nps4": (DeviceKind.PARTITION, Decimal(1), "cpx_nps4"),
    }
    # The physical GPU is its pciBusID, shared by its five modes; the model's deviceID is not.
    assert {d.physical_gpu_key for d in devices} == {
        "gpu.amd.com/mi300x-node-3/0000:05:00.0",
        "gpu.amd.com/mi300x-node-3/0000:26:00.0",
    }
    (row,) = selectors.capacity_by_model()
    assert (row["product_name"], row["unit"], row["gpus"], row["free"]) == (
        "AMD_Instinct_MI300X_OAM",
        "gpu",
        2,
        2,
    )
    assert row["equivalents"] == 2
    # No uuid: every mode device is metered by an identity formed from where it is published.
    assert len({d.meter_id for d in devices}) == 10
    assert all(d.meter_id.startswith("dra-") and d.uuid == "" for d in devices)
    assert {(d.product_name, d.driver_version, d.memory_bytes) for d in devices} == {
        ("AMD_Instinct_MI300X_OAM", "6.12.12", 192 * 2**30)
    }


def test_the_two_gpus_modes_share_five_shapes() -> None:
    """gpuIndex and pciAddr identify a GPU, like pciBusID: the same mode of both GPUs is one
    shape, so the webhook weighs five shapes however many GPUs the fleet has."""
    devices = load()
    assert len({d.shape_id for d in devices}) == 5
    shape = next(d.shape for d in devices if d.name == "gpu-1-cpx-nps1")
    assert shape is not None
    assert {"gpuIndex", "pciAddr", PCI_BUS_ID}.isdisjoint(shape.attributes)
    assert (shape.kind, shape.gpu_share, shape.allow_multiple_allocations) == (
        DeviceKind.PARTITION,
        Decimal(1),
        True,
    )


def test_without_pci_bus_id_the_gpu_is_its_pci_addr() -> None:
    """pciBusID is published "when derivable"; pciAddr always is."""
    objects = list(iter_objects(FIXTURE))
    for obj in objects:
        for device in obj["spec"].get("devices", []):
            del device["attributes"][PCI_BUS_ID]
    devices = load(objects)
    assert {d.physical_gpu_key for d in devices} == {
        "gpu.amd.com/mi300x-node-3/0000:05:00.0",
        "gpu.amd.com/mi300x-node-3/0000:26:00.0",
    }
    assert selectors.capacity_by_model()[0]["gpus"] == 2
