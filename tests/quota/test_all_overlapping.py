"""An `allocationMode: All` request is counted only on the nodes where the scheduler can give it
every device it matches (AdmissionReview POSTed to the validating webhook).

The scheduler gives an All request every device it matches on the node it picks, and gives a
device only while each counter it consumes of its pool's shared counter set has room
(KEP-4815). Where the matching devices together consume more of some counter than its set
holds (a whole GPU and its partitions, halves and quarters of one GPU, two modes of one AMD GPU
in auto-partition mode), the claim can never be allocated there: that node counts nothing,
and a request that no node can place is admitted with a warning saying why, counted on no
rule. Devices that fit their sets together (four quarters, seven 1g.10gb placements, two
partitions that load different counters) are given together and counted, each its share,
even when the shares sum past one GPU; so are devices that consume no counters (a GPU beside
its static MIG devices): the scheduler does not know them to conflict, and gives them all.
"""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.test.utils import CaptureQueriesContext

from inventory import services as inventory_services
from inventory.dra import parse_claim_requests
from inventory.dumps import iter_objects
from inventory.models import Device
from quota.admission.demand import demand
from quota.admission.shapes import NO_SHORTFALL, fleet_shapes, forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from quota.services import recount_usage
from tests.fixtures import DRA
from tests.quota.fixtures import AT, claim, decide, make_team, mig_device, nvidia_gpu, nvidia_slice

pytestmark = pytest.mark.django_db

PARTS = "gpu.partitions.example.com"
AMD = "gpu.amd.com"
A100 = ("NVIDIA A100-SXM4-80GB", "80Gi")
ANY_NVIDIA = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "any.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
}
# What the webhook says of an All request whose devices, on every node that has any, consume
# more of a shared counter set than it has.
SHORT_WARNING = (
    'request "all" (allocationMode All) matches, on each node with any, devices that consume '
    "more of a shared counter set than it has (a whole GPU and its partitions): it can never "
    "be allocated, and counts nothing on quota rules"
)


def load(*objects: dict[str, Any]) -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=list(objects), at=AT
    )
    assert report.errors == []


def vendor(name: str) -> list[dict[str, Any]]:
    return list(iter_objects(DRA / "vendors" / name))


def nvidia_classes() -> list[dict[str, Any]]:
    return [*iter_objects(DRA / "deviceclasses-nvidia.yaml"), ANY_NVIDIA]


def whole_parts_node(node: str, gpus: int) -> dict[str, Any]:
    """A node of the partitionable driver with `gpus` whole GPUs and no partitions."""
    devices = [
        {
            "name": f"gpu-{index}",
            "attributes": {"productName": {"string": "Example Accelerator 80G"}},
            "capacity": {"hbm": {"value": "80Gi"}, "multiprocessors": {"value": "128"}},
        }
        for index in range(gpus)
    ]
    return nvidia_slice(node, devices, driver=PARTS)


def every(device_class: str, expression: str = "") -> dict[str, Any]:
    """An All request of `device_class`, narrowed by `expression` when given."""
    fields: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "All"}
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return {"name": "all", "exactly": fields}


def multiprocessors(condition: str) -> str:
    return f"device.capacity['{PARTS}'].multiprocessors.compareTo(quantity('{condition}'))"


# The compute and memory modes each MI300X of the auto-partition fixture is published in.
AMD_MODES = [("spx", "nps1"), ("dpx", "nps2"), ("qpx", "nps1"), ("cpx", "nps1"), ("cpx", "nps4")]


def amd_mode(compute: str, memory: str) -> str:
    """A selector of the auto-partition devices of one mode."""
    return (
        f"device.attributes['{AMD}'].computePartition == '{compute}' && "
        f"device.attributes['{AMD}'].memoryPartition == '{memory}'"
    )


def reserved(name: str) -> dict[str, Decimal]:
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


def counts_nothing(name: str) -> bool:
    return not Reservation.objects.filter(name=name, lines__amount__gt=0).exists()


def partitioned_pool(
    pool: str, counters: dict[str, str], partitions: dict[str, dict[str, str]]
) -> list[dict[str, Any]]:
    """A pool of the partitionable driver in the split layout: one GPU's counter set
    (`counters`, name -> quantity) in a slice of its own, and `partitions` (name -> what each
    consumes of it, also its capacity) in the node's slice named `pool`."""
    counter_slice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{pool}-counters"},
        "spec": {
            "driver": PARTS,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 2},
            "sharedCounters": [{"name": "gpu-0-counters", "counters": quantities(counters)}],
        },
    }
    devices = [
        {
            "name": name,
            "capacity": quantities(consumed),
            "consumesCounters": [
                {"counterSet": "gpu-0-counters", "counters": quantities(consumed)}
            ],
        }
        for name, consumed in partitions.items()
    ]
    device_slice = nvidia_slice(pool, devices, driver=PARTS)
    device_slice["spec"]["pool"]["resourceSliceCount"] = 2
    return [counter_slice, device_slice]


def quantities(amounts: dict[str, str]) -> dict[str, dict[str, str]]:
    return {name: {"value": value} for name, value in amounts.items()}


def most_shares_on_a_node(**devices: Any) -> Decimal:
    """The most, over nodes, of the shares of the present devices that `devices` filters:
    what an All request of them counts when every node can give them."""
    per_node = (
        Device.objects.filter(gone_at__isnull=True, **devices)
        .values("node_id")
        .annotate(shares=Sum("gpu_share"))
    )
    return max(row["shares"] for row in per_node)


def test_a_whole_gpu_and_its_partitions_are_never_given_together(client: Client) -> None:
    """part-node-1 publishes one GPU whole, as two halves and as four quarters (KEP-4815):
    all seven can never be given. whole-1's two GPUs can: the request counts them."""
    load(*vendor("partitionable-counters.yaml"), whole_parts_node("whole-1", 2))
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    answer = decide(client, claim("node", [every(PARTS)]))
    assert answer["allowed"] and not answer.get("warnings")
    # Not 3 (1 + 2 halves + 4 quarters) on part-node-1: that node cannot place it.
    assert reserved("node") == {"parts": Decimal(2)}


def test_a_request_no_node_can_place_is_warned_and_counts_nothing(client: Client) -> None:
    load(*vendor("partitionable-counters.yaml"))
    make_team([{"name": "parts", "device_class": PARTS, "limit": 1}])
    answer = decide(client, claim("node", [every(PARTS)]))
    assert answer["allowed"]
    assert answer["warnings"] == [SHORT_WARNING]
    assert counts_nothing("node")
    assert QuotaRule.objects.get(name="parts").in_use == 0


@pytest.mark.parametrize(
    ("expression", "counted"),
    [
        (multiprocessors("32") + " == 0", Decimal(1)),  # four quarters: 4 x 1/4
        (multiprocessors("64") + " == 0", Decimal(1)),  # two halves: 2 x 1/2
    ],
)
def test_partitions_that_fit_their_gpu_together_are_counted_as_before(
    client: Client, expression: str, counted: Decimal
) -> None:
    load(*vendor("partitionable-counters.yaml"))
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    answer = decide(client, claim("node", [every(PARTS, expression)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("node") == {"parts": counted}


def test_halves_and_quarters_together_take_more_than_their_gpu(client: Client) -> None:
    """No whole GPU among them, but two halves and four quarters are two GPUs' worth of one."""
    load(*vendor("partitionable-counters.yaml"))
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    answer = decide(client, claim("node", [every(PARTS, multiprocessors("128") + " < 0")]))
    assert answer["warnings"] == [SHORT_WARNING]
    assert counts_nothing("node")


def test_a_gpu_beside_its_static_mig_devices_is_given_them_all(client: Client) -> None:
    """An A100 whose MIG devices are published beside it (their parentUUID its uuid), none
    consuming counters: the scheduler does not know them to conflict and gives an All request
    all three, so the claim counts their sum (1 + 4/7 + 3/7), not nothing. Another node's
    three whole A100s count more."""
    own = nvidia_gpu(0, "mig-1", *A100)
    migs = [
        mig_device("gpu-0-mig-4g40gb-5-0", "GPU-mig-1-0", "4g.40gb", "40Gi", 56),
        mig_device("gpu-0-mig-3g40gb-2-4", "GPU-mig-1-0", "3g.40gb", "40Gi", 42),
    ]
    load(*nvidia_classes(), nvidia_slice("mig-1", [own, *migs]))
    make_team(
        [
            {"name": "gpus", "device_class": "any.nvidia.com", "limit": 10},
            {"name": "mig", "device_class": "mig.nvidia.com", "limit": 10},
        ]
    )
    answer = decide(client, claim("everything", [every("any.nvidia.com")]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("everything") == {"gpus": Decimal(2), "mig": Decimal(1)}
    assert decide(client, claim("slices", [every("mig.nvidia.com")]))["allowed"]
    assert reserved("slices") == {"gpus": Decimal(1), "mig": Decimal(1)}

    load(
        *nvidia_classes(),
        nvidia_slice("mig-1", [own, *migs]),
        nvidia_slice("a100-1", [nvidia_gpu(index, "a100-1", *A100) for index in range(3)]),
    )
    answer = decide(client, claim("elsewhere", [every("any.nvidia.com")]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("elsewhere") == {"gpus": Decimal(3), "mig": Decimal(1)}


def test_the_modes_of_one_amd_gpu_without_counters_are_given_together(client: Client) -> None:
    """The auto-partition MI300X modes published without `consumesCounters`: each GPU's five
    share its pciBusID (one physical unit, shares summing past it), but nothing tells the
    scheduler they conflict, so it gives an All request all ten, and the claim counts what
    each mode counts alone, summed."""
    published = vendor("amd-mi300x-autopartition.yaml")
    for obj in published:
        for device in obj["spec"].get("devices", []):
            del device["consumesCounters"]
    load(*published)
    make_team([{"name": "amd", "device_class": AMD, "limit": 100}])
    answer = decide(client, claim("modes", [every(AMD)]))
    assert answer["allowed"] and not answer.get("warnings")
    each_alone = Decimal(0)
    for compute, memory in AMD_MODES:
        name = f"{compute}-{memory}"
        assert decide(client, claim(name, [every(AMD, amd_mode(compute, memory))]))["allowed"]
        each_alone += reserved(name)["amd"]
    assert reserved("modes") == {"amd": each_alone}
    assert each_alone > 2  # more than the node's two GPUs, as the scheduler would give it


def test_partitions_that_load_different_counters_fit_their_gpu_together(client: Client) -> None:
    """Two partitions of one GPU, one with most of its multiprocessors and little of its
    memory, the other the reverse: by its scarcest counter each is more than half the GPU
    (3/4 and 4/5), yet together they take no more of either counter than the set holds, so
    the scheduler gives both: the claim counts both shares, 1.55, not nothing. With one
    multiprocessor more they no longer fit."""
    counters = {"multiprocessors": "128", "hbm": "80Gi"}
    memory = {"multiprocessors": "32", "hbm": "64Gi"}
    compute = {"multiprocessors": "96", "hbm": "16Gi"}
    lopsided = partitioned_pool(
        "lopsided-1", counters, {"gpu-0-compute": compute, "gpu-0-memory": memory}
    )
    load(*vendor("partitionable-counters.yaml")[:1], *lopsided)
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    answer = decide(client, claim("fits", [every(PARTS)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("fits") == {"parts": Decimal("1.55")}

    more = {"multiprocessors": "97", "hbm": "16Gi"}
    overfull = partitioned_pool(
        "overfull-1", counters, {"gpu-0-compute": more, "gpu-0-memory": memory}
    )
    load(*vendor("partitionable-counters.yaml")[:1], *overfull)
    answer = decide(client, claim("overfull", [every(PARTS)]))
    assert answer["warnings"] == [SHORT_WARNING]
    assert counts_nothing("overfull")


def test_dynamic_mig_placements(client: Client) -> None:
    """DynamicMIG publishes every placement of every profile, each consuming its memory slices
    of its GPU's counter set (and the H100 whole): no node can give a request all of them.
    The seven 1g.10gb placements of a GPU fit it together (one memory slice each) and are
    counted, each its share; with the 1g.20gb ones they take memory slices twice."""
    load(*nvidia_classes(), *vendor("nvidia-dynamic-mig.yaml"))
    make_team([{"name": "mig", "device_class": "mig.nvidia.com", "limit": 10}])
    answer = decide(client, claim("placements", [every("mig.nvidia.com")]))
    assert answer["warnings"] == [SHORT_WARNING]
    assert counts_nothing("placements")
    one_g = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
    answer = decide(client, claim("1g", [every("mig.nvidia.com", one_g)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("1g") == {"mig": most_shares_on_a_node(profile="1g.10gb")}
    assert Device.objects.filter(profile="1g.10gb", node__name="h100-dyn-1").count() == 7
    two_sizes = one_g + " || device.attributes['gpu.nvidia.com'].profile == '1g.20gb'"
    answer = decide(client, claim("two-sizes", [every("mig.nvidia.com", two_sizes)]))
    assert answer["warnings"] == [SHORT_WARNING]


def test_the_mode_devices_of_one_amd_gpu_are_never_given_together(client: Client) -> None:
    """AMD auto-partition: each MI300X's five mode devices each take the GPU's one-mode
    counter set whole (the shareable ones too: a device consumes its counters once, however
    many claims share it): never given together. One mode of each GPU can be."""
    load(*vendor("amd-mi300x-autopartition.yaml"))
    make_team([{"name": "amd", "device_class": AMD, "limit": 4}])
    answer = decide(client, claim("modes", [every(AMD)]))
    assert answer["warnings"] == [SHORT_WARNING]
    assert counts_nothing("modes")
    cpx = "device.attributes['gpu.amd.com'].computePartition == 'cpx'"
    answer = decide(client, claim("cpx-modes", [every(AMD, cpx)]))  # cpx-nps1 and cpx-nps4
    assert answer["warnings"] == [SHORT_WARNING]
    assert decide(client, claim("cpx", [every(AMD, amd_mode("cpx", "nps1"))]))["allowed"]
    assert reserved("cpx") == {"amd": Decimal("0.25")}  # an eighth of each of the two GPUs


def test_the_cpx_partitions_of_one_amd_gpu_fit_it(client: Client) -> None:
    """An MI300X in CPX: eight partitions of one pciBusID, an eighth each, given together.
    The eight whole MI300X of the other node count most."""
    load(*vendor("amd-mi300x.yaml"))
    make_team([{"name": "amd", "device_class": AMD, "limit": 10}])
    partition = "device.attributes['gpu.amd.com'].type == 'amdgpu-partition'"
    answer = decide(client, claim("cpx", [every(AMD, partition)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("cpx") == {"amd": Decimal(1)}
    assert decide(client, claim("node", [every(AMD)]))["allowed"]
    assert reserved("node") == {"amd": Decimal(8)}


def test_devices_published_without_a_node_fall_short_on_every_node(client: Client) -> None:
    """A pool of `allNodes` is reached from every node: when its devices take more of its
    counter set than it has, no node can give them all, whatever the node's own devices."""
    published = vendor("partitionable-counters.yaml")
    for obj in published:
        if obj["kind"] == "ResourceSlice" and obj["spec"].get("nodeName"):
            del obj["spec"]["nodeName"]
            obj["spec"]["allNodes"] = True
    load(*published, whole_parts_node("whole-1", 2))
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    answer = decide(client, claim("node", [every(PARTS)]))
    assert answer["warnings"] == [SHORT_WARNING]
    assert counts_nothing("node")
    # The quarters alone fit their GPU: reached from any node, they are counted.
    answer = decide(client, claim("quarters", [every(PARTS, multiprocessors("32") + " == 0")]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("quarters") == {"parts": Decimal(1)}


def test_what_devices_consume_is_read_once_per_fleet_snapshot() -> None:
    """Two queries (the devices' consumption, the counter sets), the first time a set of
    shapes is weighed on a snapshot; none for a request that no node has two devices of."""
    load(*vendor("partitionable-counters.yaml"), whole_parts_node("whole-1", 1))
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    (rule,) = QuotaRule.objects.all()
    fleet = fleet_shapes(cluster=inventory_services.get_cluster("default"))

    def weigh(*selectors: str) -> tuple[int, Decimal]:
        """The queries weighing an All request of `selectors` made, and what it counts."""
        (parsed,) = parse_claim_requests(
            {"devices": {"requests": [every(PARTS, *selectors)]}}, "resource.k8s.io/v1"
        )
        with CaptureQueriesContext(connection) as queries:
            amounts = demand(parsed, [rule], fleet, warnings=[]).amounts
        return len(queries), amounts[rule.pk]

    assert weigh() == (2, Decimal(1))  # whole-1's one GPU; part-node-1 cannot place it
    # Another request of the same devices: the same shapes, read already.
    assert weigh(f"device.driver == '{PARTS}'") == (0, Decimal(1))
    # The whole GPUs: one on each node, so nothing is read.
    assert weigh(multiprocessors("128") + " == 0") == (0, Decimal(1))
    # The quarters: four on part-node-1, another set of shapes.
    assert weigh(multiprocessors("32") + " == 0") == (2, Decimal(1))


def test_devices_that_consume_no_counters_are_read_in_one_query() -> None:
    load(
        *nvidia_classes(), nvidia_slice("a100-1", [nvidia_gpu(i, "a100-1", *A100) for i in (0, 1)])
    )
    fleet = fleet_shapes(cluster=inventory_services.get_cluster("default"))
    with CaptureQueriesContext(connection) as queries:
        assert fleet.counter_shortfall(frozenset(fleet.shapes)) == NO_SHORTFALL
    assert len(queries) == 1


def test_a_recount_agrees_with_the_admission(client: Client) -> None:
    """The ledger's recount of an admitted claim the sync has seen, not yet allocated,
    leaves out the node where its devices take more than their counter set, as its admission
    did."""
    slices = [*vendor("partitionable-counters.yaml"), whole_parts_node("whole-1", 2)]
    load(*slices)
    team = make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    made = claim("node", [every(PARTS)])
    assert decide(client, made)["allowed"]
    seen = copy.deepcopy(made)
    seen["metadata"]["uid"] = "8f2d4c1e-0000-4000-8000-000000000001"
    load(*slices, seen)
    assert QuotaRule.objects.get(name="parts").in_use == 2
    (usage,) = recount_usage(teams=[team], at=AT, fix=False)
    assert not usage.drifted
    # Worked out again from the claim the sync saw, not copied from what was reserved: a line
    # holding what the request would count with part-node-1 (3) is found to differ.
    Reservation.objects.get(name="node").lines.update(amount=3)
    (usage,) = recount_usage(teams=[team], at=AT, fix=False)
    assert (usage.recounted, usage.lines_differing) == (Decimal(2), 1)


def test_sixths_that_fill_their_gpu_are_given_together(client: Client) -> None:
    """Six partitions of a sixth each fill their GPU's counter set exactly and are given
    together; their shares, each rounded to 0.000001, sum to 1.000002."""
    sixths = {f"gpu-0-sixth-{index}": {"hbm": "16Gi"} for index in range(6)}
    load(
        *vendor("partitionable-counters.yaml")[:1],
        *partitioned_pool("sixths-1", {"hbm": "96Gi"}, sixths),
    )
    make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])
    answer = decide(client, claim("sixths", [every(PARTS)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("sixths") == {"parts": Decimal("1.000002")}
