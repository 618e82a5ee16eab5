"""Fragmentation of devices several claims share (KEP-5075 consumable capacity): a GPU with a
share held is partly used by the capacity its shares consumed, not full.

An AMD MI300X in auto-partition mode (vendors/amd-mi300x-autopartition) takes CPX claims on its
`gpu-<n>-cpx-nps1` device, each consuming one of its 8 `partitions`; an H100 shared by memory
(vendors/consumable-capacity) takes claims by `memory` and `multiprocessors`. Both are synced
with their claims through `import_snapshot`, as the sync stores them.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import call_command

from inventory import services
from inventory.dumps import iter_objects
from inventory.models import Cluster
from inventory.selectors import capacity_by_model, fleet_report, fragmentation, partial_gpus
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
AMD = "gpu.amd.com"
AMD_NODE = "mi300x-node-3"
MI300X = "AMD_Instinct_MI300X_OAM"
GPU_0 = f"{AMD}/{AMD_NODE}/0000:05:00.0"
# What the scheduler records for one CPX claim of a cpx-nps1 device: each capacity's only
# valid value (`consumedCapacity` lists every capacity of the device).
CPX = {"partitions": "1", "memory": "24Gi", "computeUnits": "38", "simdUnits": "152"}
NVIDIA = "gpu.nvidia.com"
SHARE_NODE = "share-node-1"
# A quarter of the shared H100's memory and of its multiprocessors.
QUARTER = {"memory": "20Gi", "multiprocessors": "33"}


def claim(
    name: str, driver: str, pool: str, device: str, consumed: dict[str, str] | None
) -> dict[str, Any]:
    """A claim allocated a share of `device`, as the scheduler writes its status."""
    result: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": pool, "device": device}
    if consumed is not None:
        result |= {"shareID": f"share-{name}", "consumedCapacity": consumed}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "research", "uid": f"uid-{name}"},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}
        },
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def cpx_claims(count: int) -> list[dict[str, Any]]:
    """`count` CPX claims, each a share of MI300X 0 in CPX-NPS1 mode."""
    return [claim(f"cpx-{n}", AMD, AMD_NODE, "gpu-0-cpx-nps1", CPX) for n in range(count)]


def sync(fixture: str, claims: list[dict[str, Any]], at: datetime = T0) -> Cluster:
    """The fixture's slices and `claims`, as a full snapshot of both kinds at `at`."""
    cluster = services.get_cluster("fx")
    report = services.import_snapshot(
        cluster=cluster,
        objects=[*iter_objects(DRA / "vendors" / fixture), *claims],
        at=at,
        kinds=["ResourceSlice", "ResourceClaim"],
    )
    assert report.errors == []
    return cluster


def amd(claims: list[dict[str, Any]]) -> Cluster:
    return sync("amd-mi300x-autopartition.yaml", claims)


def node(cluster: Cluster, name: str) -> dict[str, Any]:
    [row] = [row for row in fragmentation(cluster=cluster)["nodes"] if row["node"] == name]
    return dict(row)


# -- AMD auto-partition: shares of a mode device's `partitions` --------------------------------


def test_with_no_share_held_both_mi300x_are_free_whole() -> None:
    cluster = amd([])
    assert partial_gpus(cluster=cluster) == []
    [capacity] = capacity_by_model(cluster=cluster)
    assert (capacity["gpus"], capacity["allocated"], capacity["free"]) == (2, 0, 2)
    row = node(cluster, AMD_NODE)
    assert (row["state"], row["free"], row["free_share"]) == ("free", 2, 2)
    # A claim gets a whole GPU in SPX mode.
    assert (row["largest_placeable"], row["largest_placeable_share"]) == ("spx_nps1", 1)


def test_a_free_gpu_of_shared_modes_offers_the_largest_share_one_claim_gets() -> None:
    """Without its SPX device, a free MI300X offers a claim at most one DPX partition: half."""
    objects = list(iter_objects(DRA / "vendors" / "amd-mi300x-autopartition.yaml"))
    for obj in objects:
        devices = obj["spec"].get("devices", [])
        devices[:] = [device for device in devices if "spx" not in device["name"]]
    cluster = services.get_cluster("fx")
    services.import_snapshot(cluster=cluster, objects=objects, at=T0, kinds=["ResourceSlice"])
    row = node(cluster, AMD_NODE)
    assert (row["state"], row["free"]) == ("free", 2)
    assert (row["largest_placeable"], row["largest_placeable_share"]) == (
        "dpx_nps2",
        Decimal("0.5"),
    )


def test_one_cpx_share_leaves_seven_eighths_of_its_gpu_free() -> None:
    cluster = amd(cpx_claims(1))

    [gpu] = partial_gpus(cluster=cluster)
    assert gpu["physical_gpu_key"] == GPU_0
    assert (gpu["held_share"], gpu["free_share"]) == (Decimal("0.125"), Decimal("0.875"))
    assert (gpu["held_label"], gpu["free_label"], gpu["unit_label"]) == ("12%", "88%", "GPU")
    assert gpu["held_devices"] == {"cpx_nps1": 1}
    # Seven more CPX claims fit on the device the first one put into CPX mode; no other mode
    # does, as the held device has taken the GPU's one-mode counter.
    assert (gpu["free_slices"], gpu["placeable"]) == ({"cpx_nps1": 7}, {"cpx_nps1": 7})
    assert (gpu["overlapping_unheld"], gpu["placeable_alone"]) == (True, {})
    assert (gpu["largest_placeable"], gpu["largest_placeable_share"]) == (
        "cpx_nps1",
        Decimal("0.125"),
    )

    [capacity] = capacity_by_model(cluster=cluster)
    # Whole units: the partly used GPU is allocated, not free (its free share is below).
    assert (capacity["gpus"], capacity["allocated"], capacity["free"]) == (2, 1, 1)
    spread = fragmentation(cluster=cluster)
    [row] = spread["nodes"]
    assert (row["state"], row["gpus_full"], row["gpus_partial"]) == ("partly used", 0, 1)
    assert (row["allocated"], row["free"], row["free_share"]) == (1, 1, Decimal("1.875"))
    assert row["free_slices"] == {"cpx_nps1": 7}
    assert (row["largest_placeable"], row["largest_placeable_share"]) == ("spx_nps1", 1)
    assert (spread["nodes_partial"], spread["gpus_partial"]) == (1, 1)
    assert spread["partial_free_by_unit"] == {"gpu": Decimal("0.875")}
    assert spread["largest_free_block"] == 1


@pytest.mark.parametrize(("held", "free_slices"), [(2, 6), (7, 1)])
def test_each_cpx_share_takes_an_eighth(held: int, free_slices: int) -> None:
    [gpu] = partial_gpus(cluster=amd(cpx_claims(held)))
    assert gpu["held_share"] == Decimal(held) / 8
    assert gpu["held_devices"] == {"cpx_nps1": held}
    assert gpu["free_slices"] == {"cpx_nps1": free_slices}


def test_all_eight_cpx_shares_held_make_the_gpu_full() -> None:
    cluster = amd(cpx_claims(8))
    assert partial_gpus(cluster=cluster) == []
    row = node(cluster, AMD_NODE)
    # One GPU full, the other wholly free: the node is partly used, with one whole GPU.
    assert (row["gpus_full"], row["gpus_partial"], row["free_share"]) == (1, 0, 1)
    assert (row["state"], row["largest_placeable"]) == ("partly used", "spx_nps1")

    # The other GPU held whole as well: the node is full, nothing placeable.
    cluster = amd([*cpx_claims(8), claim("whole", AMD, AMD_NODE, "gpu-1-spx-nps1", None)])
    row = node(cluster, AMD_NODE)
    assert (row["state"], row["free_share"], row["largest_placeable"]) == ("full", 0, "")
    [capacity] = capacity_by_model(cluster=cluster)
    assert (capacity["allocated"], capacity["free"]) == (2, 0)


def test_a_released_share_is_free_again() -> None:
    amd(cpx_claims(8))
    cluster = sync("amd-mi300x-autopartition.yaml", cpx_claims(5), at=T0 + timedelta(hours=1))
    [gpu] = partial_gpus(cluster=cluster)
    assert (gpu["held_share"], gpu["free_slices"]) == (Decimal("0.625"), {"cpx_nps1": 3})


def test_a_dpx_share_takes_half_of_the_gpu() -> None:
    dpx = {"partitions": "1", "memory": "96Gi", "computeUnits": "152", "simdUnits": "608"}
    [gpu] = partial_gpus(cluster=amd([claim("dpx", AMD, AMD_NODE, "gpu-0-dpx-nps2", dpx)]))
    assert (gpu["held_share"], gpu["held_label"]) == (Decimal("0.5"), "50%")
    assert (gpu["free_slices"], gpu["largest_placeable"]) == ({"dpx_nps2": 1}, "dpx_nps2")


# -- An H100 shared by memory and multiprocessors ----------------------------------------------


def h100(*consumed: dict[str, str] | None, device: str = "gpu-0") -> Cluster:
    claims = [
        claim(f"share-{n}", NVIDIA, SHARE_NODE, device, amounts)
        for n, amounts in enumerate(consumed)
    ]
    return sync("consumable-capacity.yaml", claims)


def test_a_quarter_of_an_h100_held_leaves_three_quarters_for_one_claim() -> None:
    # By any name the capacity answers to (here the driver-qualified one).
    cluster = h100({f"{NVIDIA}/{name}": amount for name, amount in QUARTER.items()})

    [gpu] = partial_gpus(cluster=cluster)
    assert (gpu["held_share"], gpu["free_share"]) == (Decimal("0.25"), Decimal("0.75"))
    assert gpu["held_devices"] == {"gpu-0": 1}
    # A claim asking for no amount takes 8Gi and every multiprocessor: none fits any more. One
    # claim can still get 60Gi and 99 multiprocessors: three quarters of each.
    assert (gpu["free_slices"], gpu["overlapping_unheld"]) == ({}, False)
    assert gpu["placeable"] == gpu["placeable_alone"] == {"75% GPU": 1}
    assert (gpu["largest_placeable"], gpu["largest_placeable_share"]) == (
        "75% GPU",
        Decimal("0.75"),
    )
    row = node(cluster, SHARE_NODE)
    # gpu-1 is wholly free beside it.
    assert (row["state"], row["free"], row["free_share"]) == ("partly used", 1, Decimal("1.75"))
    assert row["largest_placeable"] == "whole GPU"


@pytest.mark.parametrize(
    "consumed",
    [
        pytest.param([QUARTER] * 4, id="four quarters"),
        # What the scheduler records for a claim that asked for 8Gi only: the multiprocessors,
        # without a policy, are consumed whole.
        pytest.param([{"memory": "8Gi", "multiprocessors": "132"}], id="every multiprocessor"),
        # A share that records no consumed capacity holds the device whole, as it is billed.
        pytest.param([None], id="no consumed capacity"),
    ],
)
def test_shares_that_leave_nothing_to_share_fill_the_h100(
    consumed: list[dict[str, str] | None],
) -> None:
    cluster = h100(*consumed)
    assert partial_gpus(cluster=cluster) == []
    row = node(cluster, SHARE_NODE)
    assert (row["gpus_full"], row["free"], row["free_share"]) == (1, 1, 1)


def test_the_most_used_capacity_says_what_is_held() -> None:
    [gpu] = partial_gpus(cluster=h100({"memory": "40Gi", "multiprocessors": "10"}))
    # Half the memory, a few multiprocessors: half the GPU held, half of it left to a claim.
    assert (gpu["held_share"], gpu["largest_placeable"]) == (Decimal("0.5"), "50% GPU")


def test_valid_values_bound_the_largest_share() -> None:
    # gpu-1 shares `cores` in steps of 25, 50 or 100; its memory has no policy.
    [gpu] = partial_gpus(cluster=h100({"cores": "25", "memory": "10Gi"}, device="gpu-1"))
    assert (gpu["held_share"], gpu["free_share"]) == (Decimal("0.25"), Decimal("0.75"))
    # 75 cores left, but the largest valid value under it is 50.
    assert (gpu["largest_placeable"], gpu["placeable"]) == ("50% GPU", {"50% GPU": 1})


# -- The fleet report, its command, the API and the portal --------------------------------------


def test_fleet_report_and_its_command_show_the_shared_gpu() -> None:
    cluster = amd(cpx_claims(1))

    report = fleet_report(cluster=cluster)
    assert report["fragmentation"]["gpus_partial"] == 1
    assert report["fragmentation"]["partial_free_by_unit"] == {"gpu": "0.875000"}
    [partial] = report["partial_gpus"]
    assert (partial["held_share"], partial["free_share"]) == ("0.125000", "0.875000")
    assert partial["largest_placeable_share"] == "0.125000"
    [row] = report["partly_used_nodes"]
    assert (row["free_share"], row["free_slices"]) == ("1.875000", {"cpx_nps1": 7})
    assert json.loads(json.dumps(report)) == report

    out = io.StringIO()
    call_command("fleet_report", "--cluster", "fx", stdout=out)
    sections = {part.split("\n")[0]: part for part in out.getvalue().split("\n\n")}
    assert rows(sections["Partly used nodes (1)"])[AMD_NODE] == [
        AMD_NODE,
        "GPUs",
        "1",
        "1",
        "1.875000",
        "cpx_nps1: 7",
        "spx_nps1",
    ]
    gpu = rows(sections["Partly used GPUs (1, 0.875000 GPUs free)"])[AMD_NODE]
    assert gpu[1:] == [
        GPU_0,
        MI300X,
        "12%",
        "88% GPU",
        "cpx_nps1: 7; partitionable, each alone: none",
        "cpx_nps1",
    ]


def test_the_command_says_how_much_one_claim_can_still_get() -> None:
    sync(
        "consumable-capacity.yaml",
        [claim("q", NVIDIA, SHARE_NODE, "gpu-0", QUARTER)],
    )
    out = io.StringIO()
    call_command("fleet_report", stdout=out)
    sections = {part.split("\n")[0]: part for part in out.getvalue().split("\n\n")}
    gpu = rows(sections["Partly used GPUs (1, 0.750000 GPUs free)"])[f"fx/{SHARE_NODE}"]
    assert gpu[3:] == ["25%", "75% GPU", "one claim up to 75% GPU", "75% GPU"]


def rows(section: str) -> dict[str, list[str]]:
    """A table section's rows by their first cell (title and header lines left out)."""
    return {line.split("  ")[0]: re.split(r"\s{2,}", line) for line in section.splitlines()[2:]}
