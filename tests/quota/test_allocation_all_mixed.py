"""`allocationMode: All` on nodes whose devices differ, through the webhook as the API server
calls it.

The scheduler gives an All request every device it matches on the node it picks (each shareable
one a share of what it asks), and at most 32 devices to one claim. What the request counts on a
rule is therefore, on the node where it is most, the sum of what each of that node's matching
devices counts on the rule: a 40GB and an 80GB GPU count their own memory, a MIG device its
share, and a rule covering only some of them counts those. A node with more matching devices
than a claim can hold never gives them, and counts nothing.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from inventory import services as inventory_services
from inventory.dra import parse_claim_requests
from inventory.dumps import iter_objects
from quota.admission.demand import demand
from quota.admission.shapes import fleet_shapes, forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from tests.fixtures import DRA
from tests.quota.fixtures import AT, claim, decide, make_team, mig_device, nvidia_gpu, nvidia_slice

pytestmark = pytest.mark.django_db

GIB = 2**30
A100_40 = ("NVIDIA A100-SXM4-40GB", "40Gi")
A100_80 = ("NVIDIA A100-SXM4-80GB", "80Gi")
H100 = ("NVIDIA H100 80GB HBM3", "80Gi")
AT_LEAST_80GI = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
# Whole GPUs and MIG devices alike: a class a cluster may define beside the driver's own.
ANY_NVIDIA = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "any.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
}


def gpus(node: str, *models: tuple[str, str], first: int = 0) -> list[dict[str, Any]]:
    return [
        nvidia_gpu(first + index, node, product, memory)
        for index, (product, memory) in enumerate(models)
    ]


def load(*slices: dict[str, Any]) -> None:
    forget_fleet_shapes()
    classes = [*iter_objects(DRA / "deviceclasses-nvidia.yaml"), ANY_NVIDIA]
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=[*classes, *slices], at=AT
    )
    assert report.errors == []


def every(device_class: str, expression: str = "", name: str = "all") -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "All"}
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return {"name": name, "exactly": fields}


def reserved(name: str) -> dict[str, Decimal]:
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


def test_a_node_of_40gb_and_80gb_gpus_counts_each_gpus_own_memory(client: Client) -> None:
    load(nvidia_slice("mixed-1", gpus("mixed-1", A100_40, A100_80, A100_80)))
    make_team(
        [
            {"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 10},
            {"name": "memory", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 2**40},
            {
                "name": "big",
                "device_class": "gpu.nvidia.com",
                "selector": AT_LEAST_80GI,
                "limit": 9,
            },
        ]
    )
    assert decide(client, claim("node", [every("gpu.nvidia.com")]))["allowed"]
    # Not 3 x the largest GPU (240Gi), nor 3 GPUs on a rule that covers only two of them.
    assert reserved("node") == {
        "gpus": Decimal(3),
        "memory": Decimal(200 * GIB),
        "big": Decimal(2),
    }


def test_a_node_with_mig_devices_counts_their_shares(client: Client) -> None:
    whole = nvidia_gpu(1, "mig-node-1", *A100_80)
    migs = [
        mig_device("gpu-0-mig-4g40gb-5-0", "GPU-mig-0", "4g.40gb", "40Gi", 56),
        mig_device("gpu-0-mig-3g40gb-2-4", "GPU-mig-0", "3g.40gb", "40Gi", 42),
    ]
    load(nvidia_slice("mig-node-1", [whole, *migs]))
    make_team(
        [
            {"name": "gpus", "device_class": "any.nvidia.com", "limit": 10},
            {"name": "memory", "device_class": "any.nvidia.com", "unit": "memory", "limit": 2**40},
            {"name": "mig", "device_class": "mig.nvidia.com", "limit": 10},
        ]
    )
    assert decide(client, claim("node", [every("any.nvidia.com")]))["allowed"]
    # The whole A100 and the other A100's 4g + 3g: two GPUs, not three; the MIG rule counts
    # 4/7 + 3/7 of a GPU, not three devices of the largest slice.
    assert reserved("node") == {
        "gpus": Decimal(2),
        "memory": Decimal(160 * GIB),
        "mig": Decimal(1),
    }


def test_the_most_devices_and_the_most_memory_on_different_nodes(client: Client) -> None:
    load(
        nvidia_slice("wide-1", gpus("wide-1", A100_40, A100_40, A100_40, A100_40)),
        nvidia_slice("big-1", gpus("big-1", A100_80, A100_80, A100_80)),
    )
    make_team(
        [
            {"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 10},
            {"name": "memory", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 2**40},
        ]
    )
    assert decide(client, claim("node", [every("gpu.nvidia.com")]))["allowed"]
    # Four GPUs where there are four (160Gi); 240Gi where the three 80GB GPUs are: each rule is
    # held to the node it could be given most of, never 4 x 80Gi.
    assert reserved("node") == {"gpus": Decimal(4), "memory": Decimal(240 * GIB)}
    rules = list(QuotaRule.objects.order_by("name"))
    (request,) = parse_claim_requests(
        {"devices": {"requests": [every("gpu.nvidia.com")]}}, "resource.k8s.io/v1"
    )
    cluster = inventory_services.get_cluster("default")
    assert demand(request, rules, fleet_shapes(cluster=cluster), warnings=[]).devices == 4


def test_a_node_with_more_devices_than_a_claim_can_hold_is_never_given(client: Client) -> None:
    """Eight H100s in seven 1g.10gb MIG devices each: 56 on one node, past the 32 a claim can
    hold. All of them can never be allocated; an A100 node's two MIG devices can."""
    migs = [
        mig_device(f"gpu-{g}-mig-1g10gb-19-{s}", f"GPU-h100-{g}", "1g.10gb", "10Gi", 16)
        for g in range(8)
        for s in range(7)
    ]
    for device in migs:
        device["attributes"]["productName"] = {"string": H100[0]}
    a100 = [
        mig_device("gpu-0-mig-4g40gb-5-0", "GPU-mig-0", "4g.40gb", "40Gi", 56),
        mig_device("gpu-0-mig-3g40gb-2-4", "GPU-mig-0", "3g.40gb", "40Gi", 42),
    ]
    load(nvidia_slice("h100-mig-1", migs), nvidia_slice("a100-mig-1", a100))
    make_team([{"name": "mig", "device_class": "mig.nvidia.com", "limit": 10}])
    answer = decide(client, claim("node", [every("mig.nvidia.com")]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("node") == {"mig": Decimal(1)}
    h100_only = every(
        "mig.nvidia.com", f"device.attributes['gpu.nvidia.com'].productName == '{H100[0]}'"
    )
    answer = decide(client, claim("h100", [h100_only]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        'request "all" (allocationMode All) would be given all 56 devices it matches on a node, '
        "more than the 32 the scheduler gives one claim, on every node that has any: it can "
        "never be allocated, and counts nothing on quota rules"
    ]
    assert not Reservation.objects.filter(name="h100", lines__amount__gt=0).exists()


def test_all_on_shareable_gpus_takes_one_share_of_each(client: Client) -> None:
    """Consumable capacity (KEP-5075): All gives each matching shareable device one share of
    what the request asks, as the scheduler's allocator does; each share is its own device's
    fraction, and a GPU that cannot provide the 30Gi asked is not given."""
    models = [H100, H100, A100_40, ("NVIDIA A2", "16Gi")]
    shareable = [
        nvidia_gpu(n, "share-1", product, memory, allowMultipleAllocations=True)
        for n, (product, memory) in enumerate(models)
    ]
    load(nvidia_slice("share-1", shareable))
    make_team(
        [
            {"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 10},
            {"name": "memory", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 2**40},
        ]
    )
    request = every("gpu.nvidia.com")
    request["exactly"]["capacity"] = {"requests": {"memory": "30Gi"}}
    assert decide(client, claim("shares", [request]))["allowed"]
    # 30Gi of each H100's 80Gi (3/8 of a GPU) and of the A100's 40Gi (3/4): 1.5 GPUs, 90Gi.
    assert reserved("shares") == {"gpus": Decimal("1.5"), "memory": Decimal(90 * GIB)}


def test_what_all_counts_is_remembered_per_rule_definition(client: Client) -> None:
    """The fleet snapshot remembers what an All request counts on a rule by the rule's class,
    selector and unit: rules alike but for one of them each get their own figure, a rule
    added later too, and a claim asking the same again gets the same."""
    load(nvidia_slice("mixed-1", gpus("mixed-1", A100_40, A100_80, A100_80)))
    team = make_team(
        [
            {"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 10},
            {"name": "memory", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 2**40},
            {
                "name": "big",
                "device_class": "gpu.nvidia.com",
                "selector": AT_LEAST_80GI,
                "limit": 9,
            },
        ]
    )
    expected = {"gpus": Decimal(3), "memory": Decimal(200 * GIB), "big": Decimal(2)}
    assert decide(client, claim("first", [every("gpu.nvidia.com")]))["allowed"]
    assert reserved("first") == expected
    QuotaRule.objects.create(
        team=team,
        name="big-memory",
        device_class="gpu.nvidia.com",
        selector=AT_LEAST_80GI,
        unit="memory",
        limit=Decimal(2**40),
        mode="enforce",
    )
    assert decide(client, claim("second", [every("gpu.nvidia.com")]))["allowed"]
    assert reserved("second") == {**expected, "big-memory": Decimal(160 * GIB)}
    # Another request on the same fleet snapshot: only what it matches.
    only_40 = every(
        "gpu.nvidia.com", f"device.attributes['gpu.nvidia.com'].productName == '{A100_40[0]}'"
    )
    assert decide(client, claim("third", [only_40]))["allowed"]
    assert reserved("third") == {"gpus": Decimal(1), "memory": Decimal(40 * GIB)}
