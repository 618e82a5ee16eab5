"""An `ExactCount` request is counted by what one node can give it (AdmissionReview POSTed to
the validating webhook; the ledger's recount).

The scheduler gives a claim all its devices on one node: its allocation has one node selector,
and devices published without a node (`allNodes`, a node selector) are reachable from every
node. So a request for N devices can take, on a rule, at most the sum of the N matching devices
that count most on it among those one node reaches, the most over the nodes; not N times the
device that counts most anywhere. A count no node can give now (not counting a pool the
scheduler allocates nothing from) is counted as the most its devices could, N times the one
that counts most, with a warning saying why: a node that can give it may yet join (an
autoscaler's), and the claim must not be allocated there having been counted nothing.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota.admission.shapes import fleet_shapes, forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from quota.services import recount_usage
from tests.fixtures import DRA
from tests.quota.fixtures import AT, claim, decide, make_team, mig_device, nvidia_gpu, nvidia_slice
from tests.quota.test_unpublished_counters import (
    GPU,
    PARTS,
    PARTS_CLASS,
    cut,
    device_slice,
    partitioned,
)

pytestmark = pytest.mark.django_db

INTEL = "gpu.intel.com"
ANY = "nvidia.any"
# Every device of NVIDIA's driver: whole GPUs and MIG devices alike.
ANY_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": ANY},
    "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
}
GI = 2**30


def load(*objects: dict[str, Any]) -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=list(objects), at=AT
    )
    assert report.errors == []


def nvidia_classes() -> list[dict[str, Any]]:
    return [ANY_CLASS, *iter_objects(DRA / "deviceclasses-nvidia.yaml")]


def exact(device_class: str, count: int, name: str = "gpu") -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, "count": count}}


def reserved(name: str) -> dict[str, Decimal]:
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


def seen_by_the_sync(objects: list[dict[str, Any]], claims: list[dict[str, Any]]) -> None:
    """The claims as the sync lists them (with their uids), not yet allocated."""
    for index, obj in enumerate(claims):
        obj["metadata"]["uid"] = f"5b7c1f0e-0000-4000-8000-00000000000{index}"
    load(*objects, *claims)


def a_fleet_of_two_nodes() -> list[dict[str, Any]]:
    """mixed-1: a whole A100 (80Gi) and a 1g.5gb MIG device of another GPU (1/7, 4864Mi);
    migs-1: two 3g.20gb MIG devices (3/7 each, 19968Mi)."""
    return [
        *nvidia_classes(),
        nvidia_slice(
            "mixed-1",
            [
                nvidia_gpu(0, "mixed-1", "NVIDIA A100-SXM4-80GB", "80Gi"),
                mig_device("gpu-1-mig-1g5gb-0", "GPU-mixed-1-1", "1g.5gb", "4864Mi", 14),
            ],
        ),
        nvidia_slice(
            "migs-1",
            [
                mig_device(f"gpu-0-mig-3g20gb-{i}", "GPU-migs-1-0", "3g.20gb", "19968Mi", 42)
                for i in range(2)
            ],
        ),
    ]


# --- The case: the only Intel node -----------------------------------------------------


def test_the_only_intel_node_gives_two_devices_that_count_one_gpu(client: Client) -> None:
    """The node has a discrete Flex 170 (one GPU) and an integrated Iris Xe (no memory of its
    own: no accelerator, it counts nothing on a rule of GPUs). A request for two Intel GPUs can
    only be given both: it counts one GPU, not two, and fits a limit of one."""
    objects = list(iter_objects(DRA / "vendors" / "intel-gpu.yaml"))
    load(*objects)
    team = make_team([{"name": "intel", "device_class": INTEL, "limit": 1}])
    two = claim("two", [exact(INTEL, 2)])
    answer = decide(client, two)
    assert answer["allowed"], answer
    assert answer["warnings"] == [
        'team "research": quota rule "intel" is at 1 GPU of 1 GPU with this claim'
    ]
    assert reserved("two") == {"intel": Decimal(1)}
    assert QuotaRule.objects.get(name="intel").in_use == 1
    # The sync sees the claim, not yet allocated: the recount weighs it as its admission did.
    seen_by_the_sync(objects, [two])
    (usage,) = recount_usage(teams=[team], at=AT, fix=False)
    assert (usage.recounted, usage.lines_differing, usage.drifted) == (Decimal(1), 0, False)


# --- What one node reaches, by rule ------------------------------------------------------------


def test_each_rule_counts_the_devices_that_count_most_on_one_node(client: Client) -> None:
    """Two devices of either node: on a rule of every NVIDIA device, mixed-1's GPU and MIG
    device (1 + 1/7) count more than migs-1's two 3g devices (6/7), never two whole GPUs; on a
    memory rule 80Gi + 4864Mi; on a rule of whole GPUs, the one whole GPU there is."""
    load(*a_fleet_of_two_nodes())
    make_team(
        [
            {"name": "shares", "device_class": ANY, "limit": 10},
            {"name": "memory", "device_class": ANY, "unit": "memory", "limit": 2**40},
            {"name": "whole", "device_class": "gpu.nvidia.com", "limit": 10},
        ]
    )
    answer = decide(client, claim("two", [exact(ANY, 2)]))
    assert answer["allowed"] and not answer.get("warnings"), answer
    assert reserved("two") == {
        "shares": Decimal("1.142857"),
        "memory": Decimal(80 * GI + 4864 * 2**20),
        "whole": Decimal(1),
    }
    # One device: the most any one counts, wherever it is, as before.
    assert decide(client, claim("one", [exact(ANY, 1)]))["allowed"]
    assert reserved("one") == {"shares": Decimal(1), "memory": Decimal(80 * GI), "whole": 1}


def test_devices_published_without_a_node_are_reached_from_every_node(client: Client) -> None:
    """solo-1 has one 40Gi A100; a pool of `allNodes` two 80Gi H100s, which every node
    reaches: three devices can be given on solo-1 (200Gi), four on no node."""
    shared = nvidia_slice(
        "shared",
        [nvidia_gpu(i, "shared", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(2)],
    )
    del shared["spec"]["nodeName"]
    shared["spec"]["allNodes"] = True
    load(
        *nvidia_classes(),
        nvidia_slice("solo-1", [nvidia_gpu(0, "solo-1", "NVIDIA A100-SXM4-40GB", "40Gi")]),
        shared,
    )
    make_team(
        [{"name": "memory", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 2**40}]
    )
    answer = decide(client, claim("three", [exact("gpu.nvidia.com", 3)]))
    assert answer["allowed"] and not answer.get("warnings"), answer
    assert reserved("three") == {"memory": Decimal(200 * GI)}
    answer = decide(client, claim("four", [exact("gpu.nvidia.com", 4)]))
    assert answer["warnings"] == [
        'request "gpu" cannot be allocated on any node now (a node that can may join), and '
        "counts as the most its devices could: it asks for 4 devices, all given on one node, "
        "and no node can give more than 3 of those it matches"
    ]
    assert reserved("four") == {"memory": Decimal(4 * 80 * GI)}


# --- A count no node can give --------------------------------------------------------------------


def test_a_count_no_node_can_give_now_counts_the_most_its_devices_could(
    client: Client,
) -> None:
    """Three devices of the class: each node has two. No node can give it now, but a third
    node may join: it counts three devices, with a warning that says why it waits, and the
    ledger's recount agrees; over a limit of two it is denied. Past the 32 devices a claim is
    given, the warning says it never can be."""
    objects = a_fleet_of_two_nodes()
    load(*objects)
    team = make_team([{"name": "shares", "device_class": ANY, "limit": 100}])
    three = claim("three", [exact(ANY, 3)])
    answer = decide(client, three)
    assert answer["allowed"]
    assert answer["warnings"] == [
        'request "gpu" cannot be allocated on any node now (a node that can may join), and '
        "counts as the most its devices could: it asks for 3 devices, all given on one node, "
        "and no node can give more than 2 of those it matches"
    ]
    assert reserved("three") == {"shares": Decimal(3)}
    seen_by_the_sync(objects, [three])
    (usage,) = recount_usage(teams=[team], at=AT, fix=False)
    assert (usage.recounted, usage.lines_differing, usage.drifted) == (Decimal(3), 0, False)

    answer = decide(client, claim("many", [exact(ANY, 33)]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        'request "gpu" can never be allocated: it asks for 33 devices, more than the 32 one '
        "claim is given"
    ]
    assert reserved("many") == {"shares": Decimal(33)}

    QuotaRule.objects.filter(team=team).update(limit=2)
    assert not decide(client, claim("again", [exact(ANY, 3)]))["allowed"]


def test_devices_of_a_pool_the_scheduler_allocates_nothing_from_are_not_reached(
    client: Client,
) -> None:
    """typo-1 has two whole GPUs of a sound pool and four quarters of a pool whose set is
    misspelt. Two devices can be given there; three never: the warning names the pool."""
    load(
        PARTS_CLASS,
        *partitioned("typo-1", "gpu-0-counters", "gpu-0-countres"),
        device_slice("whole-1", {f"gpu-{i}": ("", GPU) for i in range(2)}, node="typo-1", slices=1),
    )
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    assert decide(client, claim("two", [exact(PARTS, 2)]))["allowed"]
    assert reserved("two") == {"parts": Decimal(2)}
    answer = decide(client, claim("three", [exact(PARTS, 3)]))
    assert answer["warnings"] == [
        cut(
            'request "gpu" cannot be allocated on any node now (a node that can may join), and '
            "counts as the most its devices could: it asks for 3 devices, all given on one "
            "node, and no node can give more than 2 of those it matches, not counting those of "
            f"pool {PARTS}/typo-1, which "
            "the scheduler allocates nothing from: counter set 'gpu-0-countres' is published by "
            "no slice of generation 1 (consumed by gpu-0-quarter-0 and 3 more)"
        )
    ]
    assert reserved("three") == {"parts": Decimal(3)}


def test_a_shareable_device_gives_as_many_shares_as_its_capacity_holds(client: Client) -> None:
    """share-1's one H100 allows multiple allocations (KEP-5075) and has no request policy: a
    share of 20Gi takes a quarter of it, so it holds four (as the allocators that give one
    request several shares of a device do); a request that names no capacity takes all of it,
    so only one."""
    load(
        *nvidia_classes(),
        nvidia_slice(
            "share-1",
            [
                nvidia_gpu(
                    0, "share-1", "NVIDIA H100 80GB HBM3", "80Gi", allowMultipleAllocations=True
                )
            ],
        ),
    )
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 10}])
    quarter = {"capacity": {"requests": {"memory": "20Gi"}}}
    for name, count, counted in [("two", 2, "0.5"), ("four", 4, "1")]:
        request = exact("gpu.nvidia.com", count)
        request["exactly"].update(quarter)
        answer = decide(client, claim(name, [request]))
        assert answer["allowed"] and not answer.get("warnings"), answer
        assert reserved(name) == {"gpus": Decimal(counted)}
    request = exact("gpu.nvidia.com", 5)
    request["exactly"].update(quarter)
    assert "no node can give more than 4" in decide(client, claim("five", [request]))["warnings"][0]
    assert reserved("five") == {"gpus": Decimal("1.25")}
    whole = decide(client, claim("whole", [exact("gpu.nvidia.com", 2)]))
    assert "no node can give more than 1" in whole["warnings"][0]
    assert reserved("whole") == {"gpus": Decimal(2)}


# --- firstAvailable, and what it costs -----------------------------------------------------------


def test_a_first_available_alternative_no_node_can_give_now_still_counts(client: Client) -> None:
    """Each alternative is a request: "four" cannot be allocated now (a warning names it) but
    may be once a bigger node joins, so it counts its four; "one" counts its GPU. The claim
    holds the most of those kept."""
    load(*a_fleet_of_two_nodes())
    make_team([{"name": "shares", "device_class": ANY, "limit": 8}])
    request = {
        "name": "gpus",
        "firstAvailable": [
            {"name": "four", "deviceClassName": ANY, "count": 4},
            {"name": "one", "deviceClassName": ANY, "count": 1},
        ],
    }
    answer = decide(client, claim("either", [request]))
    assert answer["allowed"]
    assert [warning.split(":")[0] for warning in answer["warnings"]] == [
        'request "four" cannot be allocated on any node now (a node that can may join), and '
        "counts as the most its devices could"
    ]
    assert reserved("either") == {"shares": Decimal(4)}


def test_nodes_that_hold_the_same_devices_are_weighed_once() -> None:
    """Forty nodes of two A100s and one of a single A100: two sets of devices to weigh a
    request by, not forty-one."""
    load(
        *nvidia_classes(),
        *(
            nvidia_slice(
                f"pair-{n}",
                [nvidia_gpu(i, f"pair-{n}", "NVIDIA A100-SXM4-80GB", "80Gi") for i in range(2)],
            )
            for n in range(40)
        ),
        nvidia_slice("single-1", [nvidia_gpu(0, "single-1", "NVIDIA A100-SXM4-80GB", "80Gi")]),
    )
    fleet = fleet_shapes(cluster=inventory_services.get_cluster("default"))
    on_nodes, off_node = fleet.placeable_by_node()
    assert sorted(sorted(devices.values()) for devices in on_nodes) == [[1], [2]]
    assert off_node == {}
