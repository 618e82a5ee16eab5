"""The simulated fleet: the real API shape, consistent allocations, determinism; and the demo."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from demo.history import simulated_fleet
from inventory import simulate
from inventory.dumps import iter_objects
from inventory.models import Allocation, Device, ResourceClaim

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
VALUE_TYPES = {"int", "bool", "string", "version"}
COMMON_ATTRIBUTES = {
    "architecture",
    "brand",
    "cudaComputeCapability",
    "cudaDriverVersion",
    "driverVersion",
    "productName",
    "resource.kubernetes.io/pciBusID",
    "resource.kubernetes.io/pcieRoot",
    "type",
}


def fleet(nodes: int, seed: int = 0, **options: Any) -> list[dict[str, Any]]:
    return list(simulate.generate(nodes=nodes, seed=seed, **options))


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def devices_by_pool(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """`(pool, device name)` → the device entry, over every slice."""
    return {
        (item["spec"]["pool"]["name"], device["name"]): device
        for item in of_kind(objects, "ResourceSlice")
        for device in item["spec"].get("devices", [])
    }


def allocations(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        result
        for claim in of_kind(objects, "ResourceClaim")
        for result in claim.get("status", {})
        .get("allocation", {})
        .get("devices", {})
        .get("results", [])
    ]


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    """A fleet large enough to have every layout, outliers and pending claims."""
    return fleet(120, seed=7)


# --- shape ---------------------------------------------------------------------------------


def test_objects_come_one_kind_after_the_other(objects: list[dict[str, Any]]) -> None:
    kinds = [obj["kind"] for obj in objects]

    assert list(dict.fromkeys(kinds)) == ["DeviceClass", "Node", "ResourceSlice", "ResourceClaim"]
    assert {obj["apiVersion"] for obj in objects if obj["kind"] != "Node"} == {"resource.k8s.io/v1"}


def test_device_classes_select_by_driver_and_type(objects: list[dict[str, Any]]) -> None:
    classes = {item["metadata"]["name"]: item["spec"] for item in of_kind(objects, "DeviceClass")}

    assert set(classes) == {"gpu.nvidia.com", "mig.nvidia.com", "vfio.gpu.nvidia.com"}
    assert classes["gpu.nvidia.com"]["selectors"] == [
        {
            "cel": {
                "expression": "device.driver == 'gpu.nvidia.com' && "
                "device.attributes['gpu.nvidia.com'].type == 'gpu'"
            }
        }
    ]
    assert "type == 'mig'" in classes["mig.nvidia.com"]["selectors"][0]["cel"]["expression"]
    assert "type == 'vfio'" in classes["vfio.gpu.nvidia.com"]["selectors"][0]["cel"]["expression"]


def test_nodes_carry_the_topology_labels(objects: list[dict[str, Any]]) -> None:
    nodes = of_kind(objects, "Node")

    assert len(nodes) == 120
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert labels["kubernetes.io/hostname"] == node["metadata"]["name"]
        assert labels["nvidia.com/gpu.product"].startswith("NVIDIA-")
        assert labels["node.kubernetes.io/instance-type"]
    cliques = [n["metadata"]["labels"].get("nvidia.com/gpu.clique") for n in nodes]
    assert any(cliques) and not all(cliques)
    for clique in filter(None, cliques):
        cluster_uuid, _, clique_id = clique.rpartition(".")
        assert re.fullmatch(r"[0-9a-f-]{36}", cluster_uuid) and clique_id.isdigit()


def test_every_device_has_the_driver_attributes(objects: list[dict[str, Any]]) -> None:
    seen_types: Counter[str] = Counter()
    for device in devices_by_pool(objects).values():
        attributes = device["attributes"]
        assert DNS_LABEL.match(device["name"]), device["name"]
        assert set(attributes) >= COMMON_ATTRIBUTES, device["name"]
        for value in attributes.values():
            assert len(value) == 1 and set(value) <= VALUE_TYPES, value
        assert "memory" in device["capacity"]
        device_type = attributes["type"]["string"]
        seen_types[device_type] += 1
        if device_type == "gpu":
            assert attributes["uuid"]["string"].startswith("GPU-")
        else:
            assert device_type == "mig"
            assert attributes["parentUUID"]["string"].startswith("GPU-")
            assert {"multiprocessors", "copyEngines"} <= set(device["capacity"])
            profile = attributes["profile"]["string"]
            assert re.fullmatch(rf"gpu-\d-mig-{profile.replace('.', '')}-\d+-\d", device["name"]), (
                device["name"]
            )
    assert seen_types["gpu"] and seen_types["mig"]


def test_static_mig_gpus_publish_only_their_mig_devices(objects: list[dict[str, Any]]) -> None:
    for item in of_kind(objects, "ResourceSlice"):
        devices = item["spec"].get("devices", [])
        if devices and devices[0]["attributes"]["productName"]["string"].startswith("NVIDIA A100"):
            assert {d["attributes"]["type"]["string"] for d in devices} == {"mig"}
            assert all(d["attributes"]["uuid"]["string"].startswith("MIG-") for d in devices)
            assert len({d["attributes"]["parentUUID"]["string"] for d in devices}) == 8


def test_pools_declare_their_slice_count(objects: list[dict[str, Any]]) -> None:
    slices_per_pool = Counter(
        item["spec"]["pool"]["name"] for item in of_kind(objects, "ResourceSlice")
    )
    for item in of_kind(objects, "ResourceSlice"):
        spec = item["spec"]
        assert spec["driver"] == "gpu.nvidia.com"
        assert spec["pool"]["resourceSliceCount"] == slices_per_pool[spec["pool"]["name"]]
        assert item["metadata"]["ownerReferences"][0]["kind"] == "Node"
        assert item["metadata"]["name"].startswith(f"{spec['pool']['name']}-gpu.nvidia.com-")
    assert set(slices_per_pool.values()) == {1, 2}


def test_partitionable_pools_keep_counters_in_a_slice_of_their_own(
    objects: list[dict[str, Any]],
) -> None:
    counter_sets: dict[str, dict[str, Any]] = {}
    for item in of_kind(objects, "ResourceSlice"):
        spec = item["spec"]
        if "sharedCounters" in spec:
            # Since v1 (1.35): no devices and no node selection beside the counters.
            assert not {"devices", "nodeName", "nodeSelector", "allNodes"} & set(spec)
            for counter_set in spec["sharedCounters"]:
                counter_sets[f"{spec['pool']['name']}/{counter_set['name']}"] = counter_set
    assert counter_sets
    for (pool, _), device in devices_by_pool(objects).items():
        for consumed in device.get("consumesCounters", []):
            available = counter_sets[f"{pool}/{consumed['counterSet']}"]["counters"]
            assert set(consumed["counters"]) <= set(available)


# --- claims --------------------------------------------------------------------------------


def test_claims_are_created_by_pods(objects: list[dict[str, Any]]) -> None:
    claims = of_kind(objects, "ResourceClaim")

    assert {claim["metadata"]["namespace"] for claim in claims} == set(simulate.NAMESPACES)
    for claim in claims:
        metadata = claim["metadata"]
        (owner,) = metadata["ownerReferences"]
        assert owner["kind"] == "Pod" and owner["controller"] is True
        (request,) = claim["spec"]["devices"]["requests"]
        assert metadata["annotations"]["resource.kubernetes.io/pod-claim-name"] == request["name"]
        assert metadata["name"].startswith(f"{owner['name']}-{request['name']}-")
        assert request["exactly"]["deviceClassName"] in {"gpu.nvidia.com", "mig.nvidia.com"}
        if "status" in claim:
            allocation = claim["status"]["allocation"]
            assert allocation["allocationTimestamp"] >= metadata["creationTimestamp"]
            results = allocation["devices"]["results"]
            assert len(results) == request["exactly"]["count"]
            assert claim["status"]["reservedFor"] == [
                {"name": owner["name"], "resource": "pods", "uid": owner["uid"]}
            ]
    assert any("status" not in claim for claim in claims), "no pending claim"


def test_allocated_devices_exist_and_are_held_once(objects: list[dict[str, Any]]) -> None:
    published = devices_by_pool(objects)
    held = [(result["pool"], result["device"]) for result in allocations(objects)]

    assert held
    assert len(held) == len(set(held))
    for key in held:
        assert key in published, key
    for result in allocations(objects):
        assert result["driver"] == "gpu.nvidia.com"


def test_allocated_partitions_never_share_counters(objects: list[dict[str, Any]]) -> None:
    published = devices_by_pool(objects)
    consumed: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for result in allocations(objects):
        device = published[(result["pool"], result["device"])]
        for use in device.get("consumesCounters", []):
            for counter in use["counters"]:
                if counter.startswith("memory-slice-"):
                    consumed[(result["pool"], use["counterSet"])][counter] += 1
    assert consumed
    for counters in consumed.values():
        assert max(counters.values()) == 1, counters


def test_about_sixty_percent_of_gpus_are_allocated(objects: list[dict[str, Any]]) -> None:
    published = devices_by_pool(objects)
    taken_gpus: defaultdict[str, set[str]] = defaultdict(set)
    for result in allocations(objects):
        attributes = published[(result["pool"], result["device"])]["attributes"]
        gpu = attributes.get("parentUUID", attributes.get("uuid"))["string"]
        taken_gpus[result["pool"]].add(gpu)
    nodes = [n["metadata"]["name"] for n in of_kind(objects, "Node")]
    per_node = [len(taken_gpus[node]) for node in nodes]

    assert 0.45 <= sum(per_node) / (8 * len(nodes)) <= 0.75
    assert 8 in per_node and 0 in per_node and any(0 < n < 8 for n in per_node)


def test_a_few_nodes_run_an_outlier_driver() -> None:
    versions = Counter(
        node["metadata"]["labels"]["nvidia.com/cuda.driver-version.full"]
        for node in of_kind(fleet(400, seed=3), "Node")
    )

    assert versions.most_common(1)[0][0] == simulate.BASELINE_DRIVER[0]
    assert 0.01 <= 1 - versions[simulate.BASELINE_DRIVER[0]] / 400 <= 0.12


# --- counts and determinism ----------------------------------------------------------------


@pytest.mark.parametrize("nodes", [0, 1, 13])
def test_whole_gpu_fleet_has_eight_devices_and_one_slice_per_node(nodes: int) -> None:
    objects = fleet(nodes, mix=simulate.WHOLE_GPU_MIX)

    assert len(of_kind(objects, "Node")) == nodes
    assert len(of_kind(objects, "ResourceSlice")) == nodes
    assert len(devices_by_pool(objects)) == 8 * nodes
    assert len(of_kind(objects, "DeviceClass")) == 3


def test_every_node_has_eight_physical_gpus(objects: list[dict[str, Any]]) -> None:
    gpus: defaultdict[str, set[str]] = defaultdict(set)
    for (pool, _), device in devices_by_pool(objects).items():
        attributes = device["attributes"]
        gpus[pool].add(attributes.get("parentUUID", attributes.get("uuid"))["string"])

    assert len(gpus) == 120
    assert {len(uuids) for uuids in gpus.values()} == {8}


def test_same_seed_same_fleet_other_seed_other_fleet() -> None:
    assert fleet(6, seed=11) == fleet(6, seed=11)
    assert fleet(6, seed=11) != fleet(6, seed=12)


def test_a_node_does_not_depend_on_the_fleet_size() -> None:
    small, large = fleet(3, seed=4), fleet(9, seed=4)

    assert of_kind(small, "Node") == of_kind(large, "Node")[:3]


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown layouts"):
        fleet(1, mix={"tpu": 1.0})


# --- what a demo asks for ------------------------------------------------------------------


def without_node(objects: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The objects that are not the node `name`, its slices or its claims."""

    def on_node(obj: dict[str, Any]) -> bool:
        if obj["kind"] == "Node":
            return bool(obj["metadata"]["name"] == name)
        if obj["kind"] == "ResourceSlice":
            return bool(obj["spec"]["pool"]["name"] == name)
        if obj["kind"] == "ResourceClaim":
            return name in {result["pool"] for result in allocations([obj])}
        return False

    return [obj for obj in objects if not on_node(obj)]


def test_outlier_nodes_run_an_outlier_driver_and_nothing_else_changes() -> None:
    plain, asked = fleet(6, seed=2), fleet(6, seed=2, outlier_nodes=[3])
    label = "nvidia.com/cuda.driver-version.full"
    node = of_kind(asked, "Node")[3]
    name = node["metadata"]["name"]
    versions = {
        (
            device["attributes"]["driverVersion"]["version"],
            device["attributes"]["cudaDriverVersion"]["version"],
        )
        for (pool, _), device in devices_by_pool(asked).items()
        if pool == name
    }

    assert of_kind(plain, "Node")[3]["metadata"]["labels"][label] == simulate.BASELINE_DRIVER[0]
    assert node["metadata"]["labels"][label] == simulate.OUTLIER_DRIVERS[0][0]
    assert versions == {simulate.OUTLIER_DRIVERS[0]}
    assert without_node(asked, name) == without_node(plain, name)


def test_partly_used_mig_leaves_some_slices_of_a_free_gpu_free() -> None:
    # seed 0: node 7 is a static-MIG node none of whose GPUs is claimed.
    plain = fleet(8)
    asked = fleet(8, partly_used_mig=range(8))
    name = of_kind(plain, "Node")[7]["metadata"]["name"]
    published = devices_by_pool(asked)
    held_before = {(r["pool"], r["device"]) for r in allocations(plain)}
    held_after = {(r["pool"], r["device"]) for r in allocations(asked)}
    added = held_after - held_before

    assert added and {pool for pool, _ in added} == {name}
    parents = {published[key]["attributes"]["parentUUID"]["string"] for key in added}
    assert len(parents) == 1  # one GPU
    (parent,) = parents
    slices = {
        key
        for key, device in published.items()
        if device["attributes"].get("parentUUID", {}).get("string") == parent
    }
    assert 0 < len(added) < len(slices)
    # The other nodes, whose static-MIG GPUs were all claimed or none is static MIG, are as
    # they were.
    assert without_node(asked, name) == without_node(plain, name)


def test_history_bounds_when_claims_were_created_and_changes_nothing_else() -> None:
    now = simulate.EPOCH
    plain, recent = fleet(6, seed=3, now=now), fleet(6, seed=3, now=now, history=timedelta(days=2))
    created = [
        datetime.fromisoformat(claim["metadata"]["creationTimestamp"])
        for claim in of_kind(recent, "ResourceClaim")
    ]

    assert created and all(
        now - timedelta(days=2) <= moment <= now - timedelta(minutes=10) for moment in created
    )
    assert min(
        datetime.fromisoformat(claim["metadata"]["creationTimestamp"])
        for claim in of_kind(plain, "ResourceClaim")
    ) < now - timedelta(days=2)

    def timeless(objects: list[dict[str, Any]]) -> list[Any]:
        return [
            (obj["metadata"]["name"], obj.get("spec"), obj.get("status", {}).get("reservedFor"))
            for obj in objects
        ]

    assert timeless(recent) == timeless(plain)
    with pytest.raises(ValueError, match="too short"):
        fleet(1, history=timedelta(minutes=5))


# --- simulate_fleet ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_simulate_fleet_writes_a_dump_the_reader_reads_back(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"fleet.{fmt}"
    call_command("simulate_fleet", nodes=5, seed=9, output=path, format=fmt, stderr=StringIO())

    assert list(iter_objects(path)) == fleet(5, seed=9, cluster=settings.TALLY_CLUSTER_NAME)


def test_simulate_fleet_writes_json_to_stdout(tmp_path: Path) -> None:
    out = StringIO()
    call_command("simulate_fleet", nodes=2, seed=1, stdout=out)
    path = tmp_path / "stdout.json"
    path.write_text(out.getvalue())

    assert out.getvalue().startswith('{"apiVersion": "v1", "items": [')
    assert list(iter_objects(path)) == fleet(2, seed=1, cluster=settings.TALLY_CLUSTER_NAME)


def device_uuids(objects: list[dict[str, Any]]) -> list[str]:
    return [
        device["attributes"]["uuid"]["string"]
        for piece in of_kind(objects, "ResourceSlice")
        for device in piece["spec"].get("devices", [])
        if "uuid" in device["attributes"]
    ]


def test_simulate_fleet_gives_each_cluster_its_own_gpus(tmp_path: Path) -> None:
    """Issue 33: the README's two clusters simulated with one seed were the same GPUs twice,
    which billed every sample to both. Each cluster's GPUs now have UUIDs of their own; the
    rest of the fleet is drawn as before."""
    paths = {name: tmp_path / f"{name}.json" for name in ("default", "lab")}
    for name, path in paths.items():
        call_command(
            "simulate_fleet", nodes=6, seed=3, cluster=name, output=path, stderr=StringIO()
        )
    default, lab = (list(iter_objects(path)) for path in paths.values())

    assert device_uuids(default) and len(device_uuids(lab)) == len(device_uuids(default))
    assert not set(device_uuids(default)) & set(device_uuids(lab))
    # Only the UUIDs differ: the same nodes, layouts and claims.
    assert [obj["metadata"]["name"] for obj in default] == [obj["metadata"]["name"] for obj in lab]


# --- importing it --------------------------------------------------------------------------


@pytest.mark.django_db
@override_settings(TALLY_SAMPLE_HOLD_SECONDS=600)  # as `dev.py serve` runs the demo
def test_load_demo_creates_the_operator_and_imports_once() -> None:
    out = StringIO()
    call_command("load_demo", nodes=4, days=20, stdout=out)

    operator = get_user_model().objects.get(username="operator")
    assert operator.is_superuser and operator.is_staff and operator.check_password("operator")
    assert "operator / operator" in out.getvalue()
    default = {"cluster__name": settings.TALLY_CLUSTER_NAME}
    devices, claims, held = (
        Device.objects.filter(**default).count(),
        ResourceClaim.objects.filter(**default).count(),
        Allocation.objects.filter(**default).count(),
    )
    expected = simulated_fleet(
        cluster="", nodes=4, seed=0, now=timezone.now(), days=20, driver_node=3
    )
    assert devices == len(devices_by_pool(expected.fleet))
    assert claims == len(expected.claims)
    assert held == len(allocations(expected.claims))
    assert Device.objects.count() > devices  # the second cluster's too

    operator.set_password("changed")
    operator.save()
    again = StringIO()
    call_command("load_demo", nodes=4, days=20, stdout=again)

    assert (
        Device.objects.filter(**default).count(),
        ResourceClaim.objects.filter(**default).count(),
    ) == (devices, claims)
    assert get_user_model().objects.get(username="operator").check_password("changed")
    assert "no import" in again.getvalue()
    # The demo's claims are charged to their workloads: Deployments serve, Jobs train.
    jobs = set(ResourceClaim.objects.values_list("job", flat=True))
    assert jobs and all(job.startswith(("Deployment/", "Job/")) for job in jobs), jobs
    assert any(job.startswith("Deployment/") for job in jobs)
    assert any(job.startswith("Job/") for job in jobs)


def test_owners_leave_every_other_object_as_it_was() -> None:
    plain, with_owners = fleet(6), fleet(6, owners=True)
    assert [o for o in with_owners if o["kind"] not in ("Pod", "ReplicaSet", "Job")] == plain
    pods = {pod["metadata"]["uid"]: pod for pod in of_kind(with_owners, "Pod")}
    for claim in of_kind(plain, "ResourceClaim"):
        owner = claim["metadata"]["ownerReferences"][0]
        assert pods[owner["uid"]]["metadata"]["name"] == owner["name"]
    replica_sets = of_kind(with_owners, "ReplicaSet")
    assert replica_sets
    assert all(rs["metadata"]["ownerReferences"][0]["kind"] == "Deployment" for rs in replica_sets)


@pytest.mark.django_db
def test_the_simulated_fleet_imports_without_errors_and_counts_each_gpu_once() -> None:
    from inventory import services

    cluster = services.get_cluster("simulated")
    report = services.import_snapshot(
        cluster=cluster, objects=simulate.generate(nodes=12, seed=5), at=timezone.now()
    )

    assert report.errors == []
    objects = fleet(12, seed=5)
    assert Device.objects.filter(cluster=cluster).count() == len(devices_by_pool(objects))
    physical = (
        Device.objects.filter(cluster=cluster)
        .exclude(physical_gpu_key="")
        .values("physical_gpu_key")
        .distinct()
        .count()
    )
    assert physical == 8 * 12
    assert Allocation.objects.filter(cluster=cluster).count() == len(allocations(objects))


@pytest.mark.django_db
def test_a_dump_whose_pods_come_after_its_claims_still_names_who_made_each_workload() -> None:
    """The simulated dump yields its claims, then their Pods and controllers, carrying the
    `tally.dev/created-by` the workload webhook writes: the import charges each claim and its
    allocations to that person, three people to a namespace, and a workload to one of them."""
    from inventory import services

    cluster = services.get_cluster("simulated")
    objects = fleet(12, seed=5, owners=True)
    # Each node's claims come before their Pods.
    assert objects.index(of_kind(objects, "Pod")[0]) > objects.index(
        of_kind(objects, "ResourceClaim")[0]
    )
    report = services.import_snapshot(cluster=cluster, objects=objects, at=timezone.now())

    assert report.errors == []
    claims = ResourceClaim.objects.filter(cluster=cluster)
    assert claims.exists() and not claims.filter(created_by="").exists()
    assert not Allocation.objects.filter(cluster=cluster, username="").exists()
    people: dict[str, set[str]] = defaultdict(set)
    for namespace, job, person in claims.values_list("namespace", "job", "created_by"):
        assert person in simulate.PEOPLE
        people[namespace].add(person)
        # One workload, one person.
        assert claims.filter(namespace=namespace, job=job).exclude(created_by=person).count() == 0
    assert all(len(names) <= 3 for names in people.values())
    assert len(set().union(*people.values())) > 3
