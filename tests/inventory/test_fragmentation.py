"""Fragmentation counts partitions: what is free on a partly used GPU and node, by slice, and the
largest device a claim could still get there."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import call_command

from inventory import services
from inventory.models import Cluster, Device, Node
from inventory.selectors import fleet_report, fragmentation, partial_gpus
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
)

pytestmark = pytest.mark.django_db

A100 = "NVIDIA A100-SXM4-40GB"
H100 = "NVIDIA H100 80GB HBM3"
SEVENTH = Decimal("0.142857")
SIX_SEVENTHS = 1 - SEVENTH


def static_a100(node: Node, *profiles: tuple[str, Decimal], key: str) -> list[Device]:
    """An A100 in static MIG mode: the driver publishes its slices, not the GPU."""
    parent = DeviceFactory.build(node=node, product_name=A100, uuid=key)
    return [
        MigDeviceFactory.create(parent=parent, profile=profile, gpu_share=share)
        for profile, share in profiles
    ]


def seven_1g(node: Node, key: str) -> list[Device]:
    return static_a100(node, *[("1g.5gb", SEVENTH)] * 7, key=key)


def node_row(cluster: Cluster, name: str) -> dict[str, Any]:
    [row] = [row for row in fragmentation(cluster=cluster)["nodes"] if row["node"] == name]
    return dict(row)


def test_one_1g_slice_in_use_leaves_the_a100_node_partly_used_with_six_sevenths_free() -> None:
    cluster = ClusterFactory.create(name="lab")
    node = NodeFactory.create(cluster=cluster, name="a100-1")
    AllocationFactory.create(device=seven_1g(node, "GPU-a100")[0])

    [gpu] = partial_gpus(cluster=cluster)
    assert (gpu["held_label"], gpu["free_label"], gpu["free_share"]) == ("1/7", "6/7", SIX_SEVENTHS)
    assert (gpu["unit"], gpu["unit_label"]) == ("gpu", "GPU")
    assert gpu["free_slices"] == {"1g.5gb": 6}
    assert gpu["placeable"] == {"1g.5gb": 6}
    assert (gpu["largest_placeable"], gpu["largest_placeable_share"]) == ("1g.5gb", SEVENTH)

    spread = fragmentation(cluster=cluster)
    [row] = spread["nodes"]
    # Not "full with 0 free": no whole GPU is free, but six sevenths of one are.
    assert row["state"] == "partly used"
    assert (row["gpus"], row["allocated"], row["free"]) == (1, 1, 0)
    assert (row["gpus_full"], row["gpus_partial"], row["free_share"]) == (0, 1, SIX_SEVENTHS)
    assert row["free_slices"] == {"1g.5gb": 6}
    assert (row["largest_placeable"], row["unit_label"]) == ("1g.5gb", "GPUs")
    assert (spread["nodes_free"], spread["nodes_partial"], spread["nodes_full"]) == (0, 1, 0)
    assert spread["partial_free_by_unit"] == {"gpu": SIX_SEVENTHS}


def test_the_largest_profile_left_on_a_mixed_static_layout() -> None:
    cluster = ClusterFactory.create(name="lab")
    node = NodeFactory.create(cluster=cluster, name="a100-1")
    three, two, one, _ = static_a100(
        node,
        ("3g.20gb", Decimal("0.428571")),
        ("2g.10gb", Decimal("0.285714")),
        ("1g.5gb", SEVENTH),
        ("1g.5gb", SEVENTH),
        key="GPU-mixed",
    )
    AllocationFactory.create(device=one)
    [gpu] = partial_gpus(cluster=cluster)
    assert gpu["free_slices"] == {"1g.5gb": 1, "2g.10gb": 1, "3g.20gb": 1}
    assert gpu["largest_placeable"] == "3g.20gb"

    AllocationFactory.create(device=three)
    [gpu] = partial_gpus(cluster=cluster)
    assert (gpu["free_label"], gpu["largest_placeable"]) == ("3/7", "2g.10gb")

    # Every slice held: the GPU is full, and so is the node.
    AllocationFactory.create(device=two)
    AllocationFactory.create(device=_)
    assert partial_gpus(cluster=cluster) == []
    assert node_row(cluster, "a100-1")["state"] == "full"


def test_whole_h100s_are_free_or_full_never_partly() -> None:
    cluster = ClusterFactory.create(name="lab")
    busy = NodeFactory.create(cluster=cluster, name="h100-busy")
    for gpu in DeviceFactory.create_batch(2, node=busy):
        AllocationFactory.create(device=gpu)
    half = NodeFactory.create(cluster=cluster, name="h100-half")
    held, _ = DeviceFactory.create_batch(2, node=half)
    AllocationFactory.create(device=held)
    DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name="h100-idle"))

    assert partial_gpus(cluster=cluster) == []
    rows = {row["node"]: row for row in fragmentation(cluster=cluster)["nodes"]}
    assert [(name, row["state"], row["free"], row["free_share"]) for name, row in rows.items()] == [
        ("h100-busy", "full", 0, 0),
        ("h100-half", "partly used", 1, 1),
        ("h100-idle", "free", 2, 2),
    ]
    assert (rows["h100-busy"]["largest_placeable"], rows["h100-busy"]["gpus_full"]) == ("", 2)
    assert rows["h100-half"]["largest_placeable"] == "whole GPU"
    assert rows["h100-idle"]["largest_placeable_share"] == 1


def test_a_mixed_node_sums_whole_gpus_and_slices() -> None:
    cluster = ClusterFactory.create(name="lab")
    node = NodeFactory.create(cluster=cluster, name="mixed")
    held_h100, _ = DeviceFactory.create_batch(2, node=node)
    AllocationFactory.create(device=held_h100)
    slices = seven_1g(node, "GPU-a100-part")
    for mig in slices[:3]:
        AllocationFactory.create(device=mig)
    # A second A100 with nothing held: its largest device is a 1g slice, no whole GPU.
    seven_1g(node, "GPU-a100-idle")

    row = node_row(cluster, "mixed")
    assert (row["gpus"], row["allocated"], row["free"]) == (4, 2, 2)
    assert (row["gpus_full"], row["gpus_partial"]) == (1, 1)
    assert row["free_share"] == 2 + 1 - 3 * SEVENTH
    assert row["state"] == "partly used"
    assert row["free_slices"] == {"1g.5gb": 4}
    assert row["largest_placeable"] == "whole GPU"
    [gpu] = partial_gpus(cluster=cluster)
    assert (gpu["physical_gpu_key"], gpu["held_label"], gpu["free_label"]) == (
        "GPU-a100-part",
        "3/7",
        "4/7",
    )

    # With the free H100 taken, only slices are left anywhere on the node.
    AllocationFactory.create(device=_)
    row = node_row(cluster, "mixed")
    assert (row["free"], row["largest_placeable"], row["free_slices"]) == (
        1,
        "1g.5gb",
        {"1g.5gb": 4},
    )


def test_the_same_node_name_in_two_clusters_does_not_mix() -> None:
    east, west = ClusterFactory.create(name="east"), ClusterFactory.create(name="west")
    held = DeviceFactory.create(node=NodeFactory.create(cluster=east, name="gpu-1"))
    AllocationFactory.create(device=held)
    DeviceFactory.create(node=NodeFactory.create(cluster=west, name="gpu-1"))

    rows = {row["node"]: row for row in fragmentation()["nodes"]}
    assert (rows["east/gpu-1"]["state"], rows["east/gpu-1"]["largest_placeable"]) == ("full", "")
    assert (rows["west/gpu-1"]["state"], rows["west/gpu-1"]["largest_placeable"]) == (
        "free",
        "whole GPU",
    )


# -- partitionable devices, through the sync ---------------------------------------------------

DRIVER = "gpu.example.com"


def partitionable_slice() -> dict[str, Any]:
    """One 80Gi GPU offered whole, as two halves and as four quarters (KEP-4815), consuming
    memory and multiprocessors from one counter set."""

    def partition(name: str, quarters: int) -> dict[str, Any]:
        memory = f"{20 * quarters}Gi"
        counters = {"memory": {"value": memory}, "multiprocessors": {"value": str(33 * quarters)}}
        return {
            "name": name,
            "attributes": {"productName": {"string": "Example X1"}},
            "capacity": {"memory": {"value": memory}},
            "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": counters}],
        }

    devices = [partition("gpu-0", 4)]
    devices += [partition(f"gpu-0-half-{n}", 2) for n in range(2)]
    devices += [partition(f"gpu-0-quarter-{n}", 1) for n in range(4)]
    counters = {"memory": {"value": "80Gi"}, "multiprocessors": {"value": "132"}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-p1-gpu.example.com"},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": "node-p1", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "node-p1",
            "sharedCounters": [{"name": "gpu-0-counters", "counters": counters}],
            "devices": devices,
        },
    }


@pytest.fixture
def partitioned() -> Cluster:
    cluster = services.get_cluster("lab")
    report = services.import_snapshot(
        cluster=cluster, objects=[partitionable_slice()], at=datetime(2026, 6, 1, tzinfo=UTC)
    )
    assert not report.errors
    return cluster


def hold(cluster: Cluster, name: str) -> None:
    AllocationFactory.create(device=Device.objects.get(cluster=cluster, name=name, gone_at=None))


def test_a_held_quarter_leaves_what_its_counters_allow(partitioned: Cluster) -> None:
    hold(partitioned, "gpu-0-quarter-1")

    [gpu] = partial_gpus(cluster=partitioned)
    assert (gpu["held_label"], gpu["free_share"]) == ("25%", Decimal("0.75"))
    assert (gpu["free_slices"], gpu["overlapping_unheld"]) == ({}, True)
    # 60Gi and 99 multiprocessors left: any other quarter or a half, not the whole GPU.
    assert gpu["placeable"] == {"25% GPU": 3, "50% GPU": 2}
    assert (gpu["largest_placeable"], gpu["largest_placeable_share"]) == ("50% GPU", Decimal("0.5"))

    hold(partitioned, "gpu-0-half-1")
    [gpu] = partial_gpus(cluster=partitioned)
    assert gpu["placeable"] == {"25% GPU": 3}
    row = node_row(partitioned, "node-p1")
    assert (row["state"], row["free_share"], row["largest_placeable"]) == (
        "partly used",
        Decimal("0.25"),
        "25% GPU",
    )


def test_a_free_partitionable_gpu_offers_the_whole_device(partitioned: Cluster) -> None:
    row = node_row(partitioned, "node-p1")
    assert (row["state"], row["largest_placeable"]) == ("free", "whole GPU")


def test_fleet_report_shows_partly_used_nodes_and_what_fits(partitioned: Cluster) -> None:
    hold(partitioned, "gpu-0-quarter-1")
    node = NodeFactory.create(cluster=partitioned, name="a100-1")
    AllocationFactory.create(device=seven_1g(node, "GPU-a100")[0])

    report = fleet_report(cluster=partitioned)
    assert [
        (row["node"], row["free_share"], row["largest_placeable"], row["free_slices"])
        for row in report["partly_used_nodes"]
    ] == [("a100-1", "0.857143", "1g.5gb", {"1g.5gb": 6}), ("node-p1", "0.750000", "50% GPU", {})]
    assert report["fragmentation"]["partial_free_by_unit"] == {"gpu": "1.607143"}

    out = io.StringIO()
    call_command("fleet_report", "--cluster", "lab", stdout=out)
    sections = {part.split("\n")[0]: part for part in out.getvalue().split("\n\n")}
    nodes = rows_of(sections["Partly used nodes (2)"])
    assert nodes["a100-1"] == ["a100-1", "GPUs", "0", "1", "0.857143", "1g.5gb: 6", "1g.5gb"]
    assert nodes["node-p1"] == ["node-p1", "GPUs", "0", "1", "0.750000", "none", "50% GPU"]
    gpus = rows_of(sections["Partly used GPUs (2, 1.607143 GPUs free)"])
    assert gpus["a100-1"][3:] == ["1/7", "6/7 GPU", "1g.5gb: 6", "1g.5gb"]
    assert gpus["node-p1"][1:] == [
        "gpu.example.com/node-p1/gpu-0-counters",
        "Example X1",
        "25%",
        "75% GPU",
        "partitionable, each alone: 25% GPU: 3, 50% GPU: 2",
        "50% GPU",
    ]


def rows_of(section: str) -> dict[str, list[str]]:
    """A table section's rows by their first cell (header and title lines left out)."""
    lines = section.splitlines()[2:]
    return {line.split("  ")[0]: re.split(r"\s{2,}", line) for line in lines}
