"""Every upstream file that holds ResourceSlices, DeviceClasses or ResourceClaims, loaded.

The files are read in place from `../shared/upstream/`; see its SOURCES.md for what each shows.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from inventory import dra, services
from inventory.dumps import iter_objects
from inventory.models import Allocation, Device, DeviceClass, Pool, ResourceClaim, ResourceSlice

pytestmark = pytest.mark.django_db
REFERENCE_ATTRIBUTES = (
    "dra-driver-nvidia-gpu/site/content/docs/reference/resourceslice-attributes.devices.yaml"
)
AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def load(path: Path, cluster: str = "up") -> services.SyncReport:
    return services.import_snapshot(
        cluster=services.get_cluster(cluster), objects=iter_objects(path), at=AT
    )


def physical_gpus(**filters: Any) -> int:
    return (
        Device.objects.filter(gone_at__isnull=True, **filters)
        .exclude(kind="other")
        .values("physical_gpu_key")
        .distinct()
        .count()
    )


def test_example_driver_kubectl_list(upstream: Path) -> None:
    report = load(upstream / "dra-example-driver/README.resourceslice-list.yaml")
    assert report.errors == []
    devices = Device.objects.order_by("name")
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert {d.kind for d in devices} == {"gpu"}
    assert physical_gpus() == 8
    first = devices[0]
    assert first.product_name == "LATEST-GPU-MODEL"  # the example driver's `model`
    assert first.memory_bytes == 80 * 2**30
    assert first.driver_version == "1.0.0"
    assert first.attributes["index"] == {"int": 0}
    assert first.node is not None and first.node.name == "dra-example-driver-cluster-worker"
    stored = ResourceSlice.objects.get()
    raw = next(iter_objects(upstream / "dra-example-driver/README.resourceslice-list.yaml"))
    assert stored.spec == raw["spec"]
    assert stored.uid == raw["metadata"]["uid"]


def test_nvidia_reference_attributes_gpu_mig_and_vfio_count_one_gpu(upstream: Path) -> None:
    entries = yaml.safe_load((upstream / REFERENCE_ATTRIBUTES).read_text())
    gpu, mig, vfio = entries
    # The GPU driver publishes the GPU and its MIG devices; the VFIO device comes from a
    # separate pool when the GPU is bound to vfio-pci. All three are one physical GPU.
    objects = [
        _slice("node-a-gpus", "node-a", [gpu, mig]),
        _slice("node-a-vfio", "node-a-vfio", [vfio], node="node-a"),
    ]
    report = services.import_snapshot(cluster=services.get_cluster("up"), objects=objects, at=AT)
    assert report.errors == []
    assert physical_gpus() == 1
    mig_row = Device.objects.get(kind="mig")
    assert mig_row.profile == "1g.5gb"
    assert mig_row.parent_uuid == "GPU-2fa81118-5a5f-aa66-7660-471eed407181"
    assert mig_row.gpu_share == Decimal("0.142857")  # one of an A100's seven compute slices
    assert mig_row.memory_bytes == 4864 * 2**20
    whole = Device.objects.get(kind="gpu", device_type="gpu")
    assert whole.driver_version == "580.126.20"
    assert whole.cuda_driver_version == "13.0.0"
    assert whole.cuda_compute_capability == "8.0.0"
    assert whole.architecture == "Ampere"
    assert whole.attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:65:00.0"}
    passthrough = Device.objects.get(device_type="vfio")
    assert passthrough.memory_bytes == 40 * 2**30  # `addressableMemory` on VFIO devices
    assert passthrough.physical_gpu_key == whole.physical_gpu_key == mig_row.physical_gpu_key


def _slice(
    name: str, pool: str, devices: list[dict[str, Any]], *, node: str | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node or pool,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def test_partitionable_split_layout_counts_once_when_both_slices_seen(
    upstream: Path, settings: Any
) -> None:
    settings.TALLY_GPU_DRIVERS = frozenset({"resource-driver.example.com"})
    path = upstream / (
        "enhancements/keps/sig-scheduling/4815-dra-partitionable-devices/"
        "README.counter-slice-example.yaml"
    )
    counter_slice, device_slice = list(iter_objects(path))
    cluster = services.get_cluster("up")
    # The device slice alone is one of two: the pool is incomplete and counts nothing yet.
    services.import_snapshot(cluster=cluster, objects=[device_slice], at=AT)
    assert Device.objects.count() == 0
    pool = Pool.objects.get()
    assert (pool.slices_seen, pool.slices_expected, pool.counted_generation) == (1, 2, None)

    report = load(path)
    assert report.errors == []
    assert Device.objects.count() == 5
    assert physical_gpus() == 1
    assert Device.objects.get(name="gpu-0").kind == "gpu"
    partitions = Device.objects.filter(kind="partition")
    assert partitions.count() == 4
    assert {p.gpu_share for p in partitions} == {Decimal("0.25")}  # 10Gi of a 40Gi counter set
    assert counter_slice["spec"]["sharedCounters"][0]["name"] == "gpu-0-counter-set"


def test_legacy_v1alpha3_imex_channels_are_kept_but_are_not_gpus(upstream: Path) -> None:
    report = load(
        upstream / "k8s-dra-driver-gpu/demo/clusters/kind/scripts/imex-resourceslice.yaml"
    )
    assert report.errors == []
    assert Device.objects.count() == 20
    assert set(Device.objects.values_list("kind", flat=True)) == {"other"}
    assert physical_gpus() == 0
    channel = Device.objects.get(pool__endswith="-1", name="imex-channel-3")
    assert channel.attributes["channel"] == {"int": 3}
    assert channel.node is None  # a multi-node pool selected by node labels
    assert "nodeSelector" in ResourceSlice.objects.filter(pool=channel.pool).get().spec


def test_v1_slice_round_trip_keeps_every_field(upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceSlice.yaml"
    (raw,) = list(iter_objects(path))
    assert load(path).errors == []
    stored = ResourceSlice.objects.get()
    assert stored.spec == raw["spec"]
    # One slice of the three its pool declares: stored, but nothing counted.
    assert Device.objects.count() == 0

    complete = copy.deepcopy(raw)
    complete["spec"]["pool"]["resourceSliceCount"] = 1
    services.import_snapshot(cluster=services.get_cluster("up"), objects=[complete], at=AT)
    device = Device.objects.get()
    raw_device = raw["spec"]["devices"][0]
    assert device.attributes == raw_device["attributes"]
    assert device.capacity == raw_device["capacity"]
    assert device.extra == {
        key: value
        for key, value in raw_device.items()
        if key not in ("name", "attributes", "capacity")
    }
    assert device.node is not None and device.node.name == "nodeNameValue"


def test_v1_claim_round_trip_and_admin_access_is_not_an_allocation(upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceClaim.yaml"
    (raw,) = list(iter_objects(path))
    assert load(path).errors == []
    claim = ResourceClaim.objects.get()
    assert (claim.spec, claim.status) == (raw["spec"], raw["status"])
    assert claim.owner_references == raw["metadata"]["ownerReferences"]
    assert Allocation.objects.count() == 0  # the only result has adminAccess: true

    held = copy.deepcopy(raw)
    held["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = False
    services.import_snapshot(cluster=services.get_cluster("up"), objects=[held], at=AT)
    allocation = Allocation.objects.get()
    assert (allocation.driver, allocation.pool, allocation.device_name) == (
        "driverValue",
        "poolValue",
        "deviceValue",
    )
    assert allocation.share_id == "shareIDValue"
    assert allocation.start == datetime(2005, 1, 1, 1, 1, 1, tzinfo=UTC)  # allocationTimestamp


def test_v1beta1_claim_flat_layout(upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/resource.k8s.io.v1beta1.ResourceClaim.yaml"
    assert load(path).errors == []
    claim = ResourceClaim.objects.get()
    (request,) = dra.parse_claim_requests(claim.spec, claim.api_version)
    assert request.first_available  # v1beta1 keeps firstAvailable beside the flat fields
    assert request.first_available[0].device_class_name == "deviceClassNameValue"
    assert request.first_available[0].capacity_requests == {"requestsKey": "0"}


def test_device_class(upstream: Path) -> None:
    assert (
        load(upstream / "website/content/en/examples/dra/driver-install/deviceclass.yaml").errors
        == []
    )
    device_class = DeviceClass.objects.get()
    assert device_class.name == "gpu.example.com"
    assert device_class.selectors == ["device.driver == 'gpu.example.com'"]


def test_standalone_claim_without_namespace(upstream: Path) -> None:
    assert load(upstream / "dra-driver-nvidia-gpu/tests/bats/specs/rc-shared-gpu.yaml").errors == []
    claim = ResourceClaim.objects.get()
    assert claim.namespace == "default"
    (request,) = dra.parse_claim_requests(claim.spec, claim.api_version)
    assert (request.device_class_name, request.count) == ("gpu.nvidia.com", 1)


def test_malformed_upstream_claim_names_object_and_field(upstream: Path) -> None:
    report = load(upstream / "website/content/en/examples/dra/resourceclaim.yaml")
    assert report.errors == [
        "ResourceClaim example-resource-claim: "
        "spec.devices.requests[0].exactly.selectors[0].cel: is missing"
    ]
    assert ResourceClaim.objects.count() == 0


def test_scheduler_generated_claim_for_an_extended_resource(upstream: Path) -> None:
    """gpu-full.yaml shows, commented out, the claim the scheduler makes for `nvidia.com/gpu`."""
    text = upstream / "dra-driver-nvidia-gpu/demo/specs/extended-resources/gpu-full.yaml"
    lines = text.read_text().splitlines()
    start = lines.index("# apiVersion: resource.k8s.io/v1")
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "#")
    generated = yaml.safe_load("\n".join(line[2:] for line in lines[start:end]))
    report = services.import_snapshot(
        cluster=services.get_cluster("up"), objects=[generated], at=AT
    )
    assert report.errors == []
    claim = ResourceClaim.objects.get()
    assert claim.annotations == {"resource.kubernetes.io/extended-resource-claim": "true"}
    assert claim.owner_references[0]["kind"] == "Pod"
    allocation = Allocation.objects.get()
    assert (allocation.pool, allocation.device_name, allocation.start) == (
        "worker-node-1",
        "gpu-0",
        AT,
    )
    assert allocation.device is None  # its slice has not been seen


TEMPLATE_FILES = {
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test1.yaml": ["gpu.nvidia.com"],
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test4.yaml": ["mig.nvidia.com"] * 4,
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1beta1/gpu-test4.yaml": ["mig.nvidia.com"] * 4,
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test6.yaml": ["gpu.nvidia.com"],
    "dra-driver-nvidia-gpu/demo/specs/fabric-manager-partitioning/resourceClaimTemplates.yaml": [
        "vfio.gpu.nvidia.com"
    ],
    "dra-driver-nvidia-gpu/tests/bats/specs/gpu-simple-mig.yaml": ["mig.nvidia.com"],
    "dra-driver-nvidia-gpu/demo/specs/consumable-shares/memory-sharing.yaml": ["gpu.nvidia.com"],
    "dra-example-driver/demo/examples/admin-access/admin-access.yaml": ["gpu.example.com"],
    "dra-example-driver/demo/examples/cel-selector/cel-selector.yaml": ["gpu.example.com"],
    "dra-example-driver/demo/examples/prioritized-alternatives/prioritized-alternatives.yaml": [
        "",
        "",
    ],
    "kubernetes/test/e2e/dra/test-driver/deploy/example/pod-inline-multiple.yaml": ["example"],
    "website/content/en/examples/dra/resourceclaimtemplate.yaml": ["example-device-class"],
}


@pytest.mark.parametrize("relative", sorted(TEMPLATE_FILES))
def test_claim_templates_are_skipped_by_the_inventory_but_readable(
    upstream: Path, relative: str
) -> None:
    report = load(upstream / relative)
    assert report.errors == []
    assert report.skipped["ResourceClaimTemplate"] >= 1
    assert ResourceClaim.objects.count() == 0
    classes = []
    for obj in iter_objects(upstream / relative):
        if obj.get("kind") == "ResourceClaimTemplate":
            requests = dra.parse_claim_requests(obj["spec"]["spec"], obj["apiVersion"])
            classes += [request.device_class_name for request in requests]
    assert classes == TEMPLATE_FILES[relative]


def test_every_upstream_dra_file_is_covered(upstream: Path) -> None:
    covered = set(TEMPLATE_FILES) | {
        "dra-example-driver/README.resourceslice-list.yaml",
        "dra-driver-nvidia-gpu/site/content/docs/reference/resourceslice-attributes.devices.yaml",
        "enhancements/keps/sig-scheduling/4815-dra-partitionable-devices/README.counter-slice-example.yaml",
        "k8s-dra-driver-gpu/demo/clusters/kind/scripts/imex-resourceslice.yaml",
        "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceSlice.yaml",
        "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceClaim.yaml",
        "kubernetes-api/testdata/HEAD/resource.k8s.io.v1beta1.ResourceClaim.yaml",
        "website/content/en/examples/dra/driver-install/deviceclass.yaml",
        "dra-driver-nvidia-gpu/tests/bats/specs/rc-shared-gpu.yaml",
        "website/content/en/examples/dra/resourceclaim.yaml",
        "dra-driver-nvidia-gpu/demo/specs/extended-resources/gpu-full.yaml",
    }
    dra_files = {
        str(path.relative_to(upstream))
        for path in upstream.rglob("*.yaml")
        if any(
            f"kind: {kind}" in path.read_text()
            for kind in ("ResourceSlice", "DeviceClass", "ResourceClaim")
        )
        or "attributes" in path.read_text()
    }
    assert dra_files <= covered, sorted(dra_files - covered)
