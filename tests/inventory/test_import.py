"""Snapshots and watch events: counting, generations, history and bad input."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from inventory import services
from inventory.models import Allocation, Device, DeviceShape, Node, ResourceClaim, ResourceSlice

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
T1 = T0 + timedelta(hours=1)
T2 = T0 + timedelta(hours=2)


def gpu(name: str, uuid: str, product: str = "NVIDIA H100 80GB HBM3", **extra: Any) -> dict:
    return {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid},
            "productName": {"string": product},
            "driverVersion": {"version": "580.82.7"},
            "cudaDriverVersion": {"version": "13.0.0"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def mig(name: str, parent: str, profile: str, uuid: str = "") -> dict:
    attributes = {
        "type": {"string": "mig"},
        "parentUUID": {"string": parent},
        "profile": {"string": profile},
        "productName": {"string": "NVIDIA A100-SXM4-80GB"},
    }
    if uuid:
        attributes["uuid"] = {"string": uuid}
    return {"name": name, "attributes": attributes, "capacity": {"memory": {"value": "10Gi"}}}


def slice_(
    name: str,
    devices: list[dict],
    *,
    pool: str = "node-a",
    node: str = "node-a",
    generation: int = 1,
    count: int = 1,
    driver: str = "gpu.nvidia.com",
    api_version: str = "resource.k8s.io/v1",
    **spec: Any,
) -> dict:
    return {
        "apiVersion": api_version,
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
            "devices": devices,
            **spec,
        },
    }


def claim(
    name: str, results: list[tuple[str, str]], *, uid: str | None = None, namespace: str = "vision"
) -> dict:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        },
    }
    if results:
        body["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": pool, "device": dev}
                        for pool, dev in results
                    ]
                }
            }
        }
    return body


def snapshot(objects: list[Any], at: datetime = T0, **kwargs: Any) -> services.SyncReport:
    return services.import_snapshot(
        cluster=services.get_cluster("test"), objects=objects, at=at, **kwargs
    )


def physical_gpus() -> int:
    return (
        Device.objects.filter(gone_at__isnull=True)
        .exclude(kind="other")
        .values("physical_gpu_key")
        .distinct()
        .count()
    )


def test_static_mig_devices_count_as_their_parent_gpu() -> None:
    devices = [mig(f"gpu-0-mig-1g10gb-19-{i}", "GPU-A", "1g.10gb", f"MIG-{i}") for i in range(7)]
    devices += [mig("gpu-1-mig-3g40gb-9-0", "GPU-B", "3g.40gb")]
    snapshot([slice_("s1", devices)])
    assert physical_gpus() == 2
    assert Device.objects.filter(kind="mig").count() == 8
    assert Device.objects.get(name="gpu-1-mig-3g40gb-9-0").gpu_share == Decimal("0.428571")


def test_whole_gpu_beside_its_partitions_counts_once() -> None:
    """NVIDIA's partitionable layout: partitions name no parent, the counter set ties them."""
    counters = {"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}

    def consuming(device: dict, memory: str) -> dict:
        counter = {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": memory}}}
        return {**device, "consumesCounters": [counter]}

    partition = {"name": "gpu-0-mig-1g10gb", "attributes": {"type": {"string": "mig"}}}
    snapshot(
        [
            slice_("counters", [], count=2, sharedCounters=[counters], nodeName=None),
            slice_(
                "devices",
                [consuming(gpu("gpu-0", "GPU-X"), "80Gi"), consuming(partition, "10Gi")],
                count=2,
            ),
        ]
    )
    assert Device.objects.count() == 2
    assert physical_gpus() == 1
    assert set(Device.objects.values_list("physical_gpu_key", flat=True)) == {"GPU-X"}


def test_non_gpu_drivers_are_kept_but_not_counted() -> None:
    channel = {"name": "channel-0", "attributes": {"type": {"string": "channel"}}}
    snapshot(
        [
            slice_("cd", [channel], driver="compute-domain.nvidia.com"),
            slice_("g", [gpu("gpu-0", "GPU-1")], pool="node-b", node="node-b"),
        ]
    )
    assert Device.objects.get(driver="compute-domain.nvidia.com").kind == "other"
    assert physical_gpus() == 1


def test_only_the_newest_complete_generation_counts() -> None:
    snapshot([slice_("gen1", [gpu("gpu-0", "GPU-0"), gpu("gpu-1", "GPU-1")])], at=T0)
    # The driver starts generation 2 in two slices; only one is visible yet.
    gen2_a = slice_("gen2-a", [gpu("gpu-0", "GPU-0")], generation=2, count=2)
    snapshot([gen2_a], at=T1)
    assert ResourceSlice.objects.get(name="gen1").gone_at == T1
    assert sorted(Device.objects.filter(gone_at__isnull=True).values_list("name", flat=True)) == [
        "gpu-0",
        "gpu-1",
    ]
    gen2_b = slice_("gen2-b", [gpu("gpu-2", "GPU-2")], generation=2, count=2)
    snapshot([gen2_a, gen2_b], at=T2)
    present = Device.objects.filter(gone_at__isnull=True)
    assert sorted(present.values_list("name", flat=True)) == ["gpu-0", "gpu-2"]
    assert set(present.values_list("pool_generation", flat=True)) == {2}
    assert Device.objects.get(name="gpu-1").gone_at == T2  # kept, marked gone


def test_older_generation_slices_are_ignored_beside_a_newer_one() -> None:
    snapshot(
        [
            slice_("old", [gpu("gpu-9", "GPU-9")], generation=1),
            slice_("new", [gpu("gpu-0", "GPU-0")], generation=3),
        ]
    )
    assert list(Device.objects.values_list("name", flat=True)) == ["gpu-0"]


def test_history_is_kept_when_devices_and_claims_disappear() -> None:
    s = slice_("s", [gpu("gpu-0", "GPU-0"), gpu("gpu-1", "GPU-1")])
    snapshot([s, claim("train", [("node-a", "gpu-0")])], at=T0)
    allocation = Allocation.objects.get()
    assert allocation.device == Device.objects.get(name="gpu-0")
    assert (allocation.start, allocation.end) == (T0, None)

    snapshot([slice_("s", [gpu("gpu-0", "GPU-0")])], at=T1, kinds=["ResourceClaim"])
    assert Device.objects.get(name="gpu-1").gone_at == T1
    claim_row = ResourceClaim.objects.get()
    assert claim_row.released_at == T1
    allocation.refresh_from_db()
    assert allocation.end == T1

    # The device comes back: a new row, so the gap stays in the history.
    snapshot([s], at=T2)
    assert Device.objects.filter(name="gpu-1").count() == 2
    assert Device.objects.get(name="gpu-1", gone_at__isnull=True).first_seen == T2


def test_snapshot_of_one_kind_leaves_other_kinds_alone() -> None:
    snapshot([slice_("s", [gpu("gpu-0", "GPU-0")]), claim("c", [("node-a", "gpu-0")])], at=T0)
    snapshot([claim("c", [("node-a", "gpu-0")])], at=T1)  # claims only: slices untouched
    assert ResourceSlice.objects.get().gone_at is None
    snapshot([], at=T2, kinds=["ResourceSlice"])  # declared kind, now empty
    assert ResourceSlice.objects.get().gone_at == T2
    assert Device.objects.get().gone_at == T2
    assert ResourceClaim.objects.get().released_at is None


def test_deallocation_ends_the_allocation_and_reallocation_opens_a_new_one() -> None:
    s = slice_("s", [gpu("gpu-0", "GPU-0"), gpu("gpu-1", "GPU-1")])
    snapshot([s, claim("c", [("node-a", "gpu-0")])], at=T0)
    snapshot([s, claim("c", [])], at=T1)
    snapshot([s, claim("c", [("node-a", "gpu-1")])], at=T2)
    intervals = list(
        Allocation.objects.order_by("start").values_list("device_name", "start", "end")
    )
    assert intervals == [("gpu-0", T0, T1), ("gpu-1", T2, None)]


def test_allocation_seen_before_its_device_is_linked_later() -> None:
    snapshot([claim("early", [("node-a", "gpu-0")])], at=T0)
    assert Allocation.objects.get().device is None
    snapshot([slice_("s", [gpu("gpu-0", "GPU-0")])], at=T1)
    assert Allocation.objects.get().device == Device.objects.get()


def test_rerunning_a_snapshot_changes_nothing() -> None:
    objects = [slice_("s", [gpu("gpu-0", "GPU-0")]), claim("c", [("node-a", "gpu-0")])]
    snapshot(objects, at=T0)
    report = snapshot(objects, at=T1)
    assert sum(report.created.values()) == sum(report.updated.values()) == 0
    assert sum(report.gone.values()) == 0
    assert Device.objects.get().first_seen == T0


def test_changed_attributes_update_in_place() -> None:
    snapshot([slice_("s", [gpu("gpu-0", "GPU-0")])], at=T0)
    upgraded = gpu("gpu-0", "GPU-0")
    upgraded["attributes"]["driverVersion"] = {"version": "590.10.0"}
    report = snapshot([slice_("s", [upgraded])], at=T1)
    assert report.updated["Device"] == 1
    assert Device.objects.get().driver_version == "590.10.0"


def test_malformed_objects_are_reported_and_the_rest_loads() -> None:
    good = slice_("good", [gpu("gpu-0", "GPU-0")])
    bad_attribute = slice_("bad-attr", [{"name": "gpu-0", "attributes": {"uuid": "GPU-1"}}])
    bad_quantity = slice_("bad-qty", [{"name": "g", "capacity": {"memory": {"value": "lots"}}}])
    no_pool = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "no-pool"},
        "spec": {"driver": "gpu.nvidia.com"},
    }
    wrong_group = {"apiVersion": "v1", "kind": "ResourceClaim", "metadata": {"name": "x"}}
    report = snapshot([bad_attribute, good, bad_quantity, no_pool, wrong_group, "not an object"])
    assert report.errors == [
        "ResourceSlice bad-attr: spec.devices[0].attributes.uuid: "
        "must set one of int, bool, string, version",
        "ResourceSlice bad-qty: spec.devices[0].capacity.memory.value: "
        "'lots' is not a valid quantity",
        "ResourceSlice no-pool: spec.pool: is required",
        "ResourceClaim x: apiVersion: 'v1' is not in the resource.k8s.io group",
        "object of type str: <object>: must be a mapping",
    ]
    assert list(Device.objects.values_list("name", flat=True)) == ["gpu-0"]


def test_a_known_object_that_turns_malformed_is_not_taken_for_gone() -> None:
    snapshot([slice_("s", [gpu("gpu-0", "GPU-0")]), claim("c", [("node-a", "gpu-0")])], at=T0)
    broken_slice = slice_("s", [{"name": 7}])
    broken_claim = claim("c", [("node-a", "gpu-0")])
    broken_claim["status"]["allocation"]["devices"]["results"][0]["device"] = None
    report = snapshot([broken_slice, broken_claim], at=T1)
    assert len(report.errors) == 2
    assert ResourceSlice.objects.get().gone_at is None
    assert Device.objects.get().gone_at is None
    assert Allocation.objects.get().end is None


def test_unknown_fields_are_kept() -> None:
    device = gpu("gpu-0", "GPU-0", futureField={"nested": [1, 2]})
    s = slice_("s", [device], futureSpecField="kept")
    assert snapshot([s]).errors == []
    assert Device.objects.get().extra == {"futureField": {"nested": [1, 2]}}
    assert ResourceSlice.objects.get().spec["futureSpecField"] == "kept"


def test_v1beta1_devices_under_basic() -> None:
    device = gpu("gpu-0", "GPU-0")
    legacy = {"name": "gpu-0", "basic": {k: v for k, v in device.items() if k != "name"}}
    snapshot([slice_("s", [legacy], api_version="resource.k8s.io/v1beta1")])
    row = Device.objects.get()
    assert (row.product_name, row.memory_bytes, row.kind) == (
        "NVIDIA H100 80GB HBM3",
        80 * 2**30,
        "gpu",
    )


def test_nodes_keep_topology_labels() -> None:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"nvidia.com/gpu.clique": "abc.1", "x": "y"}},
    }
    snapshot([node, slice_("s", [gpu("gpu-0", "GPU-0")])])
    row = Node.objects.get()
    assert row.clique == "abc.1"
    assert row.labels["x"] == "y"
    assert Device.objects.get().node == row


def test_watch_events() -> None:
    cluster = services.get_cluster("test")
    s = slice_("s", [gpu("gpu-0", "GPU-0")])
    services.apply_watch_event(cluster=cluster, event_type="ADDED", obj=s, at=T0)
    services.apply_watch_event(
        cluster=cluster, event_type="ADDED", obj=claim("c", [("node-a", "gpu-0")]), at=T0
    )
    assert Allocation.objects.get().device is not None
    grown = slice_("s", [gpu("gpu-0", "GPU-0"), gpu("gpu-1", "GPU-1")])
    services.apply_watch_event(cluster=cluster, event_type="MODIFIED", obj=grown, at=T1)
    assert physical_gpus() == 2
    services.apply_watch_event(
        cluster=cluster, event_type="DELETED", obj=claim("c", [("node-a", "gpu-0")]), at=T1
    )
    assert Allocation.objects.get().end == T1
    services.apply_watch_event(cluster=cluster, event_type="DELETED", obj=grown, at=T2)
    assert physical_gpus() == 0
    assert Device.objects.filter(gone_at=T2).count() == 2
    with pytest.raises(ValueError, match="BOOKMARK"):
        services.apply_watch_event(cluster=cluster, event_type="BOOKMARK", obj=s, at=T2)


def test_devices_that_differ_only_in_identity_share_a_shape() -> None:
    devices = [gpu(f"gpu-{i}", f"GPU-{i}") for i in range(8)]
    for i, device in enumerate(devices):
        device["attributes"]["resource.kubernetes.io/pciBusID"] = {"string": f"0000:{i:02x}:00.0"}
    devices.append(gpu("gpu-8", "GPU-8", product="NVIDIA H200"))
    devices += [
        mig("gpu-9-mig-a", "GPU-9", "1g.10gb", "MIG-a"),
        mig("gpu-9-mig-b", "GPU-9", "1g.10gb", "MIG-b"),
    ]
    snapshot([slice_("s", devices)])
    shapes = DeviceShape.objects.all()
    assert shapes.count() == 3  # H100, H200, the 1g.10gb MIG profile
    h100 = Device.objects.get(name="gpu-0").shape
    assert h100 is not None
    assert Device.objects.filter(shape=h100).count() == 8
    assert "uuid" not in h100.attributes and "productName" in h100.attributes
    assert h100.kind == "gpu" and h100.gpu_share == 1
    # A second pool with the same model reuses the shape.
    snapshot(
        [slice_("s", devices), slice_("t", [gpu("gpu-0", "GPU-X")], pool="node-b", node="node-b")]
    )
    assert DeviceShape.objects.count() == 3


# Who is charged for an allocation (job) is fixed when it starts (issue 16, finding 7); the team
# is charged per hour (tests/billing/test_ownership.py).


def test_an_allocation_is_charged_to_the_claims_job_as_the_sync_names_it_better() -> None:
    def owned(kind: str, name: str, owner: tuple[str, str] | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": name, "namespace": "vision", "uid": f"uid-{name}"}
        if owner is not None:
            metadata["ownerReferences"] = [
                {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "controller": True}
            ]
        return {"apiVersion": "apps/v1", "kind": kind, "metadata": metadata, "spec": {}}

    made = claim("web-gpu", [("node-a", "gpu-0")])
    made["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": "web-5d8f9c-x", "controller": True}
    ]
    s = slice_("s", [gpu("gpu-0", "GPU-0")])
    snapshot([s, made])
    allocation = Allocation.objects.get()
    assert allocation.job == "Pod/web-5d8f9c-x"
    # A later dump with the Pod and its owners: the same workload, named better.
    pod = owned("Pod", "web-5d8f9c-x", ("ReplicaSet", "web-5d8f9c"))
    pod["apiVersion"] = "v1"
    snapshot([s, made, pod, owned("ReplicaSet", "web-5d8f9c", ("Deployment", "web"))], at=T1)
    assert ResourceClaim.objects.get().job == "Deployment/web"
    allocation.refresh_from_db()
    assert allocation.job == "Deployment/web"
