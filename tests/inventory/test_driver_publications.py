"""The inventory of what each DRA driver publishes, from the project's own fixtures.

`test_upstream.py` loads the drivers' own files as well, where `../shared/upstream` is present.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from inventory import dra, services
from inventory.dumps import iter_objects
from inventory.models import Allocation, Device, Pool, ResourceClaim, ResourceSlice
from tests.fixtures import CLAIMS, DRA

pytestmark = pytest.mark.django_db
AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
A100_IN_MIG_MODE = "GPU-4cdc2d64-ec88-40f4-8909-b2e32b711efe"  # gpu-node-1's GPU 0


def load(*paths: Path) -> services.SyncReport:
    objects = [obj for path in paths for obj in iter_objects(path)]
    return services.import_snapshot(cluster=services.get_cluster("fx"), objects=objects, at=AT)


def physical_gpus() -> int:
    present = Device.objects.filter(gone_at__isnull=True).exclude(kind="other")
    return present.values("physical_gpu_key").distinct().count()


def test_nvidia_mig_whole_and_vfio_devices_each_count_their_physical_gpu() -> None:
    assert load(DRA / "nvidia-slices.yaml").errors == []
    # gpu-node-1: GPU 0 as four MIG devices, GPU 1 whole; vm-node-1: two GPUs for VMs.
    assert physical_gpus() == 4
    migs = Device.objects.filter(kind="mig")
    assert {mig.physical_gpu_key for mig in migs} == {A100_IN_MIG_MODE}
    assert {(mig.profile, mig.gpu_share) for mig in migs} == {
        ("1g.5gb", Decimal("0.142857")),  # one of an A100's seven compute slices
        ("2g.10gb", Decimal("0.285714")),
        ("3g.20gb", Decimal("0.428571")),
    }
    assert migs.get(name="gpu-0-mig-3g20gb-9-4").memory_bytes == 19968 * 2**20
    whole = Device.objects.get(name="gpu-1")
    assert (whole.kind, whole.product_name, whole.architecture) == (
        "gpu",
        "NVIDIA A100-PCIE-40GB",
        "Ampere",
    )
    assert (whole.driver_version, whole.cuda_compute_capability) == ("580.95.5", "8.0.0")
    assert whole.memory_bytes == 40 * 2**30
    assert whole.attributes["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:ae"}
    passthrough = Device.objects.get(name="gpu-vfio-0")
    assert (passthrough.kind, passthrough.device_type) == ("gpu", "vfio")
    assert passthrough.memory_bytes == 80 * 2**30  # `addressableMemory` on VFIO devices
    assert passthrough.node is not None and passthrough.node.name == "vm-node-1"


def test_partitionable_split_layout_counts_once_when_both_slices_are_seen(settings: Any) -> None:
    settings.TALLY_GPU_DRIVERS = frozenset({"resource-driver.example.com"})
    counter_slice, device_slice = iter_objects(DRA / "partitionable-slices.yaml")
    cluster = services.get_cluster("fx")
    # The device slice alone is one of two: the pool is incomplete and counts nothing yet.
    services.import_snapshot(cluster=cluster, objects=[device_slice], at=AT)
    assert Device.objects.count() == 0
    pool = Pool.objects.get()
    assert (pool.slices_seen, pool.slices_expected, pool.counted_generation) == (1, 2, None)

    services.import_snapshot(cluster=cluster, objects=[counter_slice, device_slice], at=AT)
    assert physical_gpus() == 1
    shares = dict(Device.objects.values_list("name", "gpu_share"))
    assert shares == {
        "gpu-0": Decimal(1),
        **{f"gpu-0-half-{i}": Decimal("0.5") for i in range(2)},  # 40Gi of the 80Gi counter set
        **{f"gpu-0-quarter-{i}": Decimal("0.25") for i in range(4)},
    }
    assert Device.objects.get(name="gpu-0").kind == "gpu"
    assert Device.objects.filter(kind="partition").count() == 6


def test_partitionable_devices_of_an_unknown_driver_are_not_gpus() -> None:
    assert load(DRA / "partitionable-slices.yaml").errors == []
    assert set(Device.objects.values_list("kind", flat=True)) == {"other"}
    assert physical_gpus() == 0


def test_example_driver_kubectl_list() -> None:
    path = DRA / "example-driver-slices.yaml"
    assert load(path).errors == []
    devices = Device.objects.order_by("name")
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert physical_gpus() == 8
    first = devices[0]
    assert first.product_name == "LATEST-GPU-MODEL"  # the example driver's `model`
    assert (first.memory_bytes, first.driver_version) == (80 * 2**30, "1.0.0")
    assert first.attributes["index"] == {"int": 0}
    assert first.node is not None and first.node.name == "kind-worker"
    (raw,) = iter_objects(path)
    stored = ResourceSlice.objects.get()
    assert (stored.spec, stored.uid) == (raw["spec"], raw["metadata"]["uid"])


def test_an_allocated_claim_holds_the_device_it_names() -> None:
    assert load(DRA / "nvidia-slices.yaml", CLAIMS / "allocated.yaml").errors == []
    claim = ResourceClaim.objects.get()
    assert (claim.namespace, claim.name) == ("research", "trainer-0-gpu-4xk9w")
    assert claim.owner_references[0]["name"] == "trainer-0"
    allocation = Allocation.objects.get()
    assert (allocation.driver, allocation.pool, allocation.device_name) == (
        "gpu.nvidia.com",
        "gpu-node-1",
        "gpu-1",
    )
    assert allocation.device == Device.objects.get(name="gpu-1")
    assert allocation.start == AT  # no allocationTimestamp: when the sync first saw it


# The device classes each fixture template's requests ask for, in order ("" for a request
# whose firstAvailable alternatives carry the classes).
TEMPLATES = {
    "one-gpu-per-pod": ["gpu.nvidia.com"],
    "mig-pair": ["mig.nvidia.com"] * 2,
    "mig-pair-v1beta1": ["mig.nvidia.com"] * 2,
    "mig-at-least-28-sms": ["mig.nvidia.com"],
    "a100-time-sliced": ["gpu.nvidia.com"],
    "vm-two-gpus": ["vfio.gpu.nvidia.com"],
    "gpu-8gi": ["gpu.nvidia.com"],
    "two-selectors": ["gpu.example.com"],
    "admin-all-gpus": ["gpu.example.com"],
    "fallback-gpu": [""],
    "preferred-gpu": [""],
}


def test_claim_templates_are_skipped_by_the_inventory_but_readable() -> None:
    paths = sorted(CLAIMS.glob("*.yaml"))
    report = load(*paths)
    assert report.errors == [
        "ResourceClaim research/misindented-selector: "
        "spec.devices.requests[0].exactly.selectors[0].cel: is missing"
    ]
    assert report.skipped["ResourceClaimTemplate"] == len(TEMPLATES)
    classes = {
        obj["metadata"]["name"]: [
            request.device_class_name
            for request in dra.parse_claim_requests(obj["spec"]["spec"], obj["apiVersion"])
        ]
        for path in paths
        for obj in iter_objects(path)
        if obj["kind"] == "ResourceClaimTemplate"
    }
    assert classes == TEMPLATES
    stored = set(ResourceClaim.objects.values_list("name", flat=True))
    assert stored == {"single-gpu", "trainer-0-gpu-4xk9w", "all-h100-on-a-node", "h100-else-a100"}
