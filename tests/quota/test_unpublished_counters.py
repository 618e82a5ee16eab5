"""A device that consumes a counter set, or a counter of one, that no slice of its pool
generation publishes is never counted as one a claim could be given (AdmissionReview POSTed to
the validating webhook; the ledger's recount).

The scheduler's structured allocator checks every device of a pool against the counter sets
the pool's slices publish (k8s.io/dynamic-resource-allocation/structured, `buildPool` calling
`validateDeviceCounterConsumption`): a set or counter not published marks the whole pool
invalid, `allocateOne` takes no device from it, and a request for all devices fails on every
node the pool is gathered for. So an `ExactCount` request counts only devices outside such
pools, an `All` request only nodes without one, and a request that can then never be placed is
admitted with a warning naming the pool and what it does not publish, counting nothing.

A set published by another slice of the same generation is published (the split layout of
Kubernetes 1.35: counter sets in a slice of their own); one published only by an older
generation is not. The pools are checked once per process and again when their slices change.

The same `buildPool` first checks that no device name is published twice among the slices it
gathered for the node (`validateDeviceNames`: "duplicate device name X") and no counter set
name twice among the slices that publish counter sets (`getAndValidateCounterSets`: "duplicate
counter set name X"): either makes the pool invalid as well, and is named first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from inventory import checks
from inventory import services as inventory_services
from inventory.models import Cluster, Device
from quota.admission import shapes
from quota.admission.shapes import forget_fleet_shapes, invalid_pools
from quota.models import QuotaRule, Reservation
from quota.services import recount_usage
from tests.quota.fixtures import AT, claim, decide, make_team

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_snapshots(settings: Any) -> None:
    """The webhook checks the fleet version on every admission: a slice a watch event changed
    is seen by the next one (the process's checks of the pools are kept)."""
    settings.TALLY_SHAPE_CACHE_SECONDS = 0


PARTS = "gpu.partitions.example.com"
NICS = "nic.example.com"
PARTS_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": PARTS},
    "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{PARTS}'"}}]},
}
GPU = {"multiprocessors": "128", "hbm": "80Gi"}
QUARTER = {"multiprocessors": "32", "hbm": "20Gi"}
# The quarters of a GPU (a quarter of each counter of its set), not the whole GPUs.
QUARTERS = f"device.capacity['{PARTS}'].multiprocessors.compareTo(quantity('32')) == 0"


# --- Fixtures: the partitionable driver's slices, written here ---------------------------------


def quantities(amounts: dict[str, str]) -> dict[str, dict[str, str]]:
    return {name: {"value": value} for name, value in amounts.items()}


def counter_slice(
    name: str,
    pool: str,
    counter_sets: dict[str, dict[str, str]],
    *,
    generation: int = 1,
    slices: int = 2,
) -> dict[str, Any]:
    """A slice of `pool` that publishes only `counter_sets` (set name -> counter -> quantity),
    as drivers do in the split layout."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": PARTS,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": slices},
            "sharedCounters": [
                {"name": set_name, "counters": quantities(counters)}
                for set_name, counters in counter_sets.items()
            ],
        },
    }


def device_slice(
    pool: str,
    devices: dict[str, tuple[str, dict[str, str]]],
    *,
    driver: str = PARTS,
    node: str | None = None,
    generation: int = 1,
    slices: int = 2,
) -> dict[str, Any]:
    """The slice of `pool`'s devices on `node` (the pool's name; None: `allNodes`), each
    `name -> (counter set, counters it consumes)`: its capacity is what it consumes, and a
    device of no set ("") consumes nothing."""
    published = []
    for name, (counter_set, consumed) in devices.items():
        device: dict[str, Any] = {
            "name": name,
            "attributes": {"productName": {"string": "Example Accelerator 80G"}},
            "capacity": quantities(consumed),
        }
        if counter_set:
            device["consumesCounters"] = [
                {"counterSet": counter_set, "counters": quantities(consumed)}
            ]
        published.append(device)
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": slices},
        "devices": published,
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{pool}-{driver}-devices"},
        "spec": spec,
    }


def quarters(
    counter_set: str, gpu: int = 0, consumed: dict[str, str] = QUARTER
) -> dict[str, tuple[str, dict[str, str]]]:
    """The four quarters of GPU `gpu`, each consuming `consumed` (a quarter of each counter by
    default) of `counter_set`."""
    return {f"gpu-{gpu}-quarter-{i}": (counter_set, consumed) for i in range(4)}


def partitioned(pool: str, published: str, consumed: str) -> list[dict[str, Any]]:
    """`pool` in the split layout: a slice publishing one GPU's counter set named `published`,
    and its four quarters, which consume one named `consumed`."""
    return [
        counter_slice(f"{pool}-counters", pool, {published: GPU}),
        device_slice(pool, quarters(consumed), node=pool),
    ]


def whole_gpus(node: str, gpus: int) -> dict[str, Any]:
    """A node of whole GPUs of the partitionable driver, consuming no counters."""
    return device_slice(node, {f"gpu-{i}": ("", GPU) for i in range(gpus)}, node=node, slices=1)


def load(*objects: dict[str, Any]) -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=list(objects), at=AT
    )
    assert report.errors == []


def watch(event_type: str, obj: dict[str, Any], minutes: int) -> None:
    """One watch event of the sync, `minutes` after AT (the webhook's cache kept)."""
    report = inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster("default"),
        event_type=event_type,
        obj=obj,
        at=AT + timedelta(minutes=minutes),
    )
    assert report.errors == []


def exact(count: int, expression: str = "") -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": PARTS, "count": count}
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return {"name": "gpu", "exactly": fields}


def every(expression: str = "") -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": PARTS, "allocationMode": "All"}
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return {"name": "all", "exactly": fields}


def reserved(name: str) -> dict[str, Decimal]:
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


def counts_nothing(name: str) -> bool:
    return not Reservation.objects.filter(name=name, lines__amount__gt=0).exists()


def parts_team() -> Any:
    return make_team([{"name": "parts", "device_class": PARTS, "limit": 10}])


# What the warnings say of typo-1.
TYPO = (
    f"pool {PARTS}/typo-1, which the scheduler allocates nothing from: counter set "
    "'gpu-0-countres' is published by no slice of generation 1 (consumed by gpu-0-quarter-0 "
    "and 3 more)"
)


def cut(warning: str) -> str:
    return warning if len(warning) <= 256 else warning[:253] + "..."


# --- An unpublished set, an unpublished counter -----------------------------------------------


def test_devices_that_consume_a_set_no_slice_publishes_are_never_counted(client: Client) -> None:
    """typo-1's quarters consume 'gpu-0-countres'; its counter slice publishes
    'gpu-0-counters'. The scheduler allocates none of them: an ExactCount or All request of
    only those counts nothing, with a warning naming the pool, the set and the devices."""
    load(PARTS_CLASS, *partitioned("typo-1", "gpu-0-counters", "gpu-0-countres"))
    parts_team()
    answer = decide(client, claim("one-quarter", [exact(1, QUARTERS)]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        cut(
            'request "gpu" can never be allocated, and counts nothing on quota rules: it '
            f"matches only devices of {TYPO}"
        )
    ]
    assert counts_nothing("one-quarter")
    answer = decide(client, claim("all-quarters", [every(QUARTERS)]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        cut(
            'request "all" (allocationMode All) can never be allocated, and counts nothing on '
            f"quota rules: it matches only devices of {TYPO}"
        )
    ]
    assert counts_nothing("all-quarters")
    assert QuotaRule.objects.get(name="parts").in_use == 0


def test_the_devices_of_other_pools_are_still_counted(client: Client) -> None:
    """Beside typo-1, quarters-1's quarters consume the set their slice publishes. typo-1's,
    their set unpublished, have no share of it to count by (each a whole device): an ExactCount
    request counts what one of quarters-1's devices counts, as if typo-1's were not there; an
    All request the node where all can be given, quarters-1, and not typo-1's node, where the
    scheduler fails it."""
    load(
        PARTS_CLASS,
        *partitioned("typo-1", "gpu-0-counters", "gpu-0-countres"),
        *partitioned("quarters-1", "gpu-0-counters", "gpu-0-counters"),
    )
    parts_team()
    answer = decide(client, claim("two", [exact(2, QUARTERS)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("two") == {"parts": Decimal("0.5")}
    answer = decide(client, claim("node", [every(QUARTERS)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("node") == {"parts": Decimal(1)}


def test_an_exact_count_request_no_longer_counts_what_only_an_invalid_pool_has(
    client: Client,
) -> None:
    """A whole GPU counts more than a quarter. typo-1 has the only whole GPUs: they consume a
    set no slice publishes, so a request of one device of the class counts a quarter, what
    quarters-1 can give, not a whole GPU."""
    typo_gpus = {f"gpu-{i}": (f"gpu-{i}-countres", GPU) for i in range(2)}
    load(
        PARTS_CLASS,
        counter_slice("typo-1-counters", "typo-1", {"gpu-0-counters": GPU, "gpu-1-counters": GPU}),
        device_slice("typo-1", typo_gpus, node="typo-1"),
        *partitioned("quarters-1", "gpu-0-counters", "gpu-0-counters"),
    )
    parts_team()
    answer = decide(client, claim("one", [exact(1)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("one") == {"parts": Decimal("0.25")}
    # All of the class: quarters-1's four quarters (one GPU); typo-1's node is left out.
    assert decide(client, claim("node", [every()]))["allowed"]
    assert reserved("node") == {"parts": Decimal(1)}


def test_a_counter_its_set_does_not_have(client: Client) -> None:
    """The set is published, but without the copy engines the quarters also consume: the
    scheduler says "counter copyEngines not found in counter set", and allocates nothing from
    the pool. The fleet report names the same devices and counter."""
    load(
        PARTS_CLASS,
        counter_slice("engines-1-counters", "engines-1", {"gpu-0-counters": GPU}),
        device_slice(
            "engines-1",
            quarters("gpu-0-counters", consumed={**QUARTER, "copyEngines": "2"}),
            node="engines-1",
        ),
    )
    parts_team()
    answer = decide(client, claim("quarter", [exact(1)]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        cut(
            'request "gpu" can never be allocated, and counts nothing on quota rules: it '
            f"matches only devices of pool {PARTS}/engines-1, which the scheduler allocates "
            "nothing from: counter 'copyEngines' is not in set 'gpu-0-counters' of generation 1 "
            "(consumed by gpu-0-quarter-0 and 3 more)"
        )
    ]
    assert counts_nothing("quarter")
    assert [
        (warning["check"], warning["pool"], warning["devices"])
        for warning in checks.sync_warnings()
    ] == [
        (
            "unknown_counter",
            "engines-1",
            ["gpu-0-quarter-0", "gpu-0-quarter-1", "gpu-0-quarter-2", "gpu-0-quarter-3"],
        )
    ]


def test_a_pool_with_several_problems_names_the_first_and_counts_the_others() -> None:
    load(
        PARTS_CLASS,
        counter_slice("two-1-counters", "two-1", {"gpu-0-counters": GPU}),
        device_slice(
            "two-1",
            {
                "gpu-0-quarter-0": ("gpu-0-counters", {**QUARTER, "copyEngines": "2"}),
                "gpu-0-quarter-1": ("gpu-0-counters", {**QUARTER, "jpegEngines": "1"}),
                "gpu-1-quarter-0": ("gpu-1-counters", QUARTER),
            },
            node="two-1",
        ),
    )
    cluster = inventory_services.get_cluster("default")
    (pool,) = checks.invalid_pools(cluster_id=cluster.pk)
    assert (pool.check, pool.counter_set, pool.counter, pool.devices, pool.others) == (
        checks.MISSING_COUNTER_SET,
        "gpu-1-counters",
        "",
        ("gpu-1-quarter-0",),
        2,
    )
    assert pool.problem() == (
        "counter set 'gpu-1-counters' is published by no slice of generation 1 (consumed by "
        "gpu-1-quarter-0; 2 more not published)"
    )


# --- Where a set counts as published ----------------------------------------------------------


def test_a_set_published_by_another_slice_of_the_generation_is_published(client: Client) -> None:
    """Two GPUs' counter sets, each in a slice of its own, and their eight quarters in a third:
    nothing dangles, every quarter can be given."""
    load(
        PARTS_CLASS,
        counter_slice("split-1-gpu-0", "split-1", {"gpu-0-counters": GPU}, slices=3),
        counter_slice("split-1-gpu-1", "split-1", {"gpu-1-counters": GPU}, slices=3),
        device_slice(
            "split-1",
            {**quarters("gpu-0-counters", 0), **quarters("gpu-1-counters", 1)},
            node="split-1",
            slices=3,
        ),
    )
    parts_team()
    assert checks.invalid_pools(cluster_id=inventory_services.get_cluster("default").pk) == []
    answer = decide(client, claim("node", [every()]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("node") == {"parts": Decimal(2)}
    answer = decide(client, claim("three", [exact(3)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("three") == {"parts": Decimal("0.75")}


def test_a_set_published_only_by_an_older_generation_is_not_published(client: Client) -> None:
    """Generation 1's counter slice is still there; generation 2 is one slice of devices that
    consume its set. Generation 2 is counted (complete), and its set is published by no slice
    of generation 2: the scheduler takes nothing from the pool, and the fleet report says so.
    With generation 2's own counter slice the quarters are counted."""
    stale = counter_slice("gen-1-counters", "gen-1", {"gpu-0-counters": GPU}, generation=1)
    newer = device_slice("gen-1", quarters("gpu-0-counters"), node="gen-1", generation=2, slices=1)
    load(PARTS_CLASS, stale, newer)
    parts_team()
    assert set(Device.objects.values_list("pool_generation", flat=True)) == {2}
    answer = decide(client, claim("stale", [every()]))
    assert answer["allowed"]
    assert answer["warnings"] == [
        cut(
            'request "all" (allocationMode All) can never be allocated, and counts nothing on '
            f"quota rules: it matches only devices of pool {PARTS}/gen-1, which the scheduler "
            "allocates nothing from: counter set 'gpu-0-counters' is published by no slice of "
            "generation 2 (consumed by gpu-0-quarter-0 and 3 more)"
        )
    ]
    assert counts_nothing("stale")
    assert [(w["check"], w["generation"]) for w in checks.sync_warnings()] == [
        ("missing_counter_set", 2)
    ]

    fresh = counter_slice("gen-1-counters", "gen-1", {"gpu-0-counters": GPU}, generation=2)
    newer["spec"]["pool"]["resourceSliceCount"] = 2
    load(PARTS_CLASS, fresh, newer)
    answer = decide(client, claim("fresh", [every()]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("fresh") == {"parts": Decimal(1)}


def test_the_generation_counted_during_a_rollout_is_not_judged(client: Client) -> None:
    """Generation 2 of the devices' slice has arrived, not yet its counter slice: the sync
    still counts generation 1, of which one slice is left. A set may well be in the slice
    that was replaced; generation 1's quarters are not judged, and counted as before."""
    load(PARTS_CLASS, *partitioned("roll-1", "gpu-0-counters", "gpu-0-counters"))
    parts_team()
    _, devices = partitioned("roll-1", "gpu-0-counters", "gpu-0-counters")
    devices["spec"]["pool"]["generation"] = 2
    watch("MODIFIED", devices, minutes=1)
    assert set(Device.objects.values_list("pool_generation", flat=True)) == {1}
    answer = decide(client, claim("node", [every()]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("node") == {"parts": Decimal(1)}


def test_devices_in_several_invalid_pools_name_the_first(client: Client) -> None:
    load(
        PARTS_CLASS,
        *partitioned("typo-1", "gpu-0-counters", "gpu-0-countres"),
        *partitioned("typo-2", "gpu-0-counters", "gpu-0-countres"),
    )
    parts_team()
    answer = decide(client, claim("quarter", [exact(1)]))
    assert answer["warnings"] == [
        cut(
            'request "gpu" can never be allocated, and counts nothing on quota rules: it '
            f"matches only devices of pool {PARTS}/typo-1 (and 1 more such pool), which the "
            "scheduler allocates nothing from: counter set 'gpu-0-countres' is published by no "
            "slice of generation 1 (consumed by gpu-0-quarter-0 and 3 more)"
        )
    ]
    assert counts_nothing("quarter")


# --- All requests: the node of an invalid pool --------------------------------------------------


def test_an_invalid_pool_on_a_node_stops_an_all_request_there(client: Client) -> None:
    """gpus-1 has two whole GPUs of the partitionable driver and a NIC pool whose devices
    consume a set it does not publish. The scheduler gathers both pools for the node and fails
    a request for all devices there ("resource pool ... is currently invalid"), whatever the
    request matches: only whole-1's one GPU counts. An ExactCount request is not concerned."""
    nic = device_slice(
        "gpus-1",
        {"nic-0": ("nic-0-bandwidth", {"bandwidth": "100G"})},
        driver=NICS,
        node="gpus-1",
        slices=1,
    )
    load(PARTS_CLASS, whole_gpus("gpus-1", 2), nic, whole_gpus("whole-1", 1))
    parts_team()
    answer = decide(client, claim("node", [every()]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("node") == {"parts": Decimal(1)}
    answer = decide(client, claim("two", [exact(2)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("two") == {"parts": Decimal(2)}

    load(PARTS_CLASS, whole_gpus("gpus-1", 2), nic)
    answer = decide(client, claim("nowhere", [every()]))
    assert answer["warnings"] == [
        cut(
            'request "all" (allocationMode All) can never be allocated, and counts nothing on '
            f"quota rules: each node with devices it matches has pool {NICS}/gpus-1, which the "
            "scheduler allocates nothing from: counter set 'nic-0-bandwidth' is published by no "
            "slice of generation 1 (consumed by nic-0)"
        )
    ]
    assert counts_nothing("nowhere")


def test_an_invalid_pool_published_without_a_node_stops_all_requests_everywhere(
    client: Client,
) -> None:
    """A pool of `allNodes` is gathered for every node: invalid, it fails an All request on
    each of them."""
    shared = device_slice("shared", quarters("gpu-0-countres"), node=None, slices=2)
    load(
        PARTS_CLASS,
        counter_slice("shared-counters", "shared", {"gpu-0-counters": GPU}),
        shared,
        whole_gpus("whole-1", 2),
    )
    parts_team()
    gpus = f"device.capacity['{PARTS}'].multiprocessors.compareTo(quantity('128')) == 0"
    answer = decide(client, claim("whole", [every(gpus)]))
    assert answer["warnings"][0].startswith(
        'request "all" (allocationMode All) can never be allocated, and counts nothing on '
        f"quota rules: each node with devices it matches has pool {PARTS}/shared, which"
    )
    assert counts_nothing("whole")
    # Each of whole-1's GPUs can be given to an ExactCount request.
    assert decide(client, claim("two", [exact(2, gpus)]))["allowed"]
    assert reserved("two") == {"parts": Decimal(2)}


def load_refused_everywhere(nic_node: str) -> None:
    """over-1's GPU and its quarters, which together take twice their set, and `nic_node`'s
    GPU beside a NIC pool the scheduler allocates nothing from (its set unpublished): no node
    can give an All request everything it matches, each for its own reason."""
    nic = device_slice(
        nic_node,
        {"nic-0": ("nic-0-bandwidth", {"bandwidth": "100G"})},
        driver=NICS,
        node=nic_node,
        slices=1,
    )
    load(
        PARTS_CLASS,
        counter_slice("over-1-counters", "over-1", {"gpu-0-counters": GPU}),
        device_slice(
            "over-1",
            {"gpu-0": ("gpu-0-counters", GPU), **quarters("gpu-0-counters")},
            node="over-1",
        ),
        whole_gpus(nic_node, 1),
        nic,
    )


def test_an_all_request_refused_on_every_node_for_different_reasons(client: Client) -> None:
    """over-1's GPU and its quarters together take twice their set; nics-1's GPU could be
    given, but shares its node with a NIC pool the scheduler allocates nothing from: no node
    can give an All request everything it matches, and the warning says both."""
    load_refused_everywhere("nics-1")
    parts_team()
    answer = decide(client, claim("node", [every()]))
    assert answer["warnings"] == [
        cut(
            'request "all" (allocationMode All) can never be allocated, counting nothing: pool '
            f"{NICS}/nics-1, which the scheduler allocates nothing from: counter set "
            "'nic-0-bandwidth' is published by no slice of generation 1 (consumed by nic-0). It "
            "is on each node with devices it matches where they are not too many for one claim "
            "nor overfill a shared counter set."
        )
    ]
    assert counts_nothing("node")


# --- The order the slices come in, a pool put right ----------------------------------------------


@pytest.mark.parametrize("sound", [True, False], ids=["sound", "typo"])
@pytest.mark.parametrize("counters_first", [True, False], ids=["counters-first", "devices-first"])
def test_the_order_the_slices_arrive_in_does_not_matter(
    client: Client, sound: bool, counters_first: bool
) -> None:
    """The counter slice and the devices' slice, as two watch events in either order, or in
    one list in either order: the same pool, counted (sound) or not (a typo'd set)."""
    consumed = "gpu-0-counters" if sound else "gpu-0-countres"

    def ordered(pool: str) -> list[dict[str, Any]]:
        slices = partitioned(pool, "gpu-0-counters", consumed)
        return slices if counters_first else slices[::-1]

    load(PARTS_CLASS)
    parts_team()
    for minutes, obj in enumerate(ordered("watched-1"), start=1):
        watch("ADDED", obj, minutes=minutes)
    assert decide(client, claim("watched", [every()]))["allowed"]
    load(PARTS_CLASS, *ordered("listed-1"))
    assert decide(client, claim("listed", [every()]))["allowed"]
    for name in ("watched", "listed"):
        if sound:
            assert reserved(name) == {"parts": Decimal(1)}
        else:
            assert counts_nothing(name)


def test_a_pool_put_right_is_counted_and_one_broken_is_not(client: Client) -> None:
    """The webhook's process checks each pool once, and again when its slices change: a
    driver that publishes the set its devices consume makes them count at the next snapshot,
    and one that renames it makes them count no more."""
    broken_counters, devices = partitioned("fix-1", "gpu-0-countres", "gpu-0-counters")
    load(PARTS_CLASS, broken_counters, devices)
    parts_team()
    assert decide(client, claim("before", [every()]))["warnings"]
    assert counts_nothing("before")

    fixed = counter_slice("fix-1-counters", "fix-1", {"gpu-0-counters": GPU})
    watch("MODIFIED", fixed, minutes=1)
    answer = decide(client, claim("fixed", [every()]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("fixed") == {"parts": Decimal(1)}

    watch("MODIFIED", broken_counters, minutes=2)
    assert decide(client, claim("broken", [exact(1)]))["warnings"]
    assert counts_nothing("broken")


def test_a_pool_is_checked_again_only_when_its_slices_change() -> None:
    """One query (the mark of the cluster's slices) while no slice changed, and one more for
    the devices of an invalid pool; when a slice changed, each pool's mark, and the check of
    that pool alone."""
    load(
        PARTS_CLASS,
        *partitioned("good-1", "gpu-0-counters", "gpu-0-counters"),
        *partitioned("typo-1", "gpu-0-counters", "gpu-0-countres"),
    )
    cluster_id = inventory_services.get_cluster("default").pk
    assert [pool.pool for pool in invalid_pools(cluster_id=cluster_id).pools] == ["typo-1"]
    with CaptureQueriesContext(connection) as queries:
        unchanged = invalid_pools(cluster_id=cluster_id)
    assert len(queries) == 2  # the marks, and typo-1's devices
    (on_node,) = unchanged.devices[(PARTS, "typo-1")].values()
    assert list(on_node.values()) == [4]  # its four quarters, of one shape, on typo-1
    fixed = counter_slice("typo-1-counters", "typo-1", {"gpu-0-countres": GPU})
    watch("MODIFIED", fixed, minutes=1)
    with CaptureQueriesContext(connection) as queries:
        assert invalid_pools(cluster_id=cluster_id).pools == ()
    assert len(queries) == 3  # the slices' mark, each pool's, and typo-1 checked again
    assert "unnest" in queries[2]["sql"] and "typo-1" in str(queries[2]["sql"])
    with CaptureQueriesContext(connection) as queries:
        assert invalid_pools(cluster_id=cluster_id).pools == ()
    assert len(queries) == 1  # the marks, all unchanged: one row


@pytest.fixture
def typo_in_cache(settings: Any) -> Iterator[Cluster]:
    """typo-1 stored (its counter set misspelt), snapshots cached 10 s, and the process's
    snapshots and background refresher left as they were found."""
    settings.TALLY_SHAPE_CACHE_SECONDS = 10
    load(PARTS_CLASS, *partitioned("typo-1", "gpu-0-counters", "gpu-0-countres"))
    try:
        yield inventory_services.get_cluster("default")
    finally:
        shapes.refresher.join(timeout=30)
        forget_fleet_shapes()


def checked_typo(cluster: Cluster) -> shapes.FleetShapes:
    """The snapshot served once the background refresher is done: typo-1 checked."""
    shapes.refresher.join(timeout=30)
    fleet = shapes.fleet_shapes(cluster=cluster)
    assert not fleet.pools_pending
    assert [pool.pool for pool in fleet.invalid.pools] == ["typo-1"]
    return fleet


@pytest.mark.django_db(transaction=True)
def test_a_workers_first_snapshot_checks_its_pools_off_the_request_path(
    typo_in_cache: Cluster,
) -> None:
    """Checking every pool reads every slice and device (1.4 s at 100,000 GPUs): on a
    worker's first admission it ran past the admission's deadline, was cancelled, and was
    tried again by each request, none answered. The first snapshot is served with its pools
    pending; the background refresher checks them, and the next snapshot has them."""
    with CaptureQueriesContext(connection) as queries:
        first = shapes.fleet_shapes(cluster=typo_in_cache)
    assert first.pools_pending and first.invalid.pools == ()
    assert not any("jsonb_path_query_array" in query["sql"] for query in queries)
    checked = checked_typo(typo_in_cache)
    assert checked is not first
    assert checked.shapes == first.shapes and checked.per_node == first.per_node

    # A worker's warm-up waits for the check, so its first admission weighs the pools.
    forget_fleet_shapes()
    shapes.warm_up(cluster=typo_in_cache, seconds=30)
    warmed = shapes.fleet_shapes(cluster=typo_in_cache)
    assert not warmed.pools_pending
    assert [pool.pool for pool in warmed.invalid.pools] == ["typo-1"]


@pytest.mark.django_db(transaction=True)
def test_behind_a_transaction_pooler_an_admission_leaves_the_pools_to_the_background(
    typo_in_cache: Cluster, settings: Any
) -> None:
    """Every admission is a transaction of its own there, holding no writes to the fleet: its
    first snapshot does not check the pools on the request path either."""
    settings.DATABASE_TRANSACTION_POOLING = True
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        first = shapes.fleet_shapes(cluster=typo_in_cache)
    assert first.pools_pending
    assert not any("jsonb_path_query_array" in query["sql"] for query in queries)
    checked_typo(typo_in_cache)


@pytest.mark.django_db(transaction=True)
def test_a_snapshot_made_while_the_refresher_is_busy_is_checked_at_the_next_request(
    typo_in_cache: Cluster,
) -> None:
    release = threading.Event()

    def busy() -> None:  # other work the refresher is doing
        release.wait(10)

    try:
        assert shapes.refresher.start(busy)
        first = shapes.fleet_shapes(cluster=typo_in_cache)
        assert first.pools_pending
    finally:
        release.set()
    shapes.refresher.join(timeout=30)
    assert shapes.fleet_shapes(cluster=typo_in_cache) is first  # still pending: starts a check
    checked_typo(typo_in_cache)


# --- The ledger ---------------------------------------------------------------------------------


def test_the_recount_agrees_with_the_admission(client: Client) -> None:
    """Claims admitted beside a pool the scheduler allocates nothing from, seen by the sync
    and not yet allocated, are recounted from the fleet as it is, as their admission weighed
    them: nothing drifts. Once the pool is put right, the recount counts its devices, as a new
    admission does."""
    typo = partitioned("typo-1", "gpu-0-counters", "gpu-0-countres")
    slices = [PARTS_CLASS, *typo, whole_gpus("whole-1", 2)]
    load(*slices)
    team = parts_team()
    made = [
        claim("quarter", [exact(1, QUARTERS)]),
        claim("node", [every()]),
        claim("gpus", [exact(2)]),
    ]
    for index, obj in enumerate(made):
        assert decide(client, obj)["allowed"]
        obj["metadata"]["uid"] = f"8f2d4c1e-0000-4000-8000-00000000000{index}"
    assert (reserved("quarter"), reserved("node"), reserved("gpus")) == (
        {"parts": Decimal(0)},
        {"parts": Decimal(2)},
        {"parts": Decimal(2)},
    )
    load(*slices, *made)
    assert QuotaRule.objects.get(name="parts").in_use == 4
    (usage,) = recount_usage(teams=[team], at=AT, fix=False)
    assert (usage.recounted, usage.lines_differing) == (Decimal(4), 0)
    assert not usage.drifted

    fixed = counter_slice("typo-1-counters", "typo-1", {"gpu-0-countres": GPU})
    watch("MODIFIED", fixed, minutes=1)
    answer = decide(client, claim("quarter-now", [exact(1, QUARTERS)]))
    assert answer["allowed"] and not answer.get("warnings")
    assert reserved("quarter-now") == {"parts": Decimal("0.25")}
    (usage,) = recount_usage(teams=[team], at=AT, fix=False)
    # "quarter" now holds a quarter, as "quarter-now" does; "node" still two GPUs (typo-1's
    # four quarters count one).
    assert (usage.recounted, usage.lines_differing) == (Decimal("4.5"), 1)


# --- Names published twice: the scheduler's pool checks (`buildPool`) -------------------------


def load_reported(*objects: dict[str, Any]) -> list[str]:
    """Import, and what the sync reported (a duplicate device name is one error)."""
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=list(objects), at=AT
    )
    return report.errors


def gpus_slice(name: str, pool: str, gpus: list[str], *, node: str, slices: int) -> dict[str, Any]:
    """A slice `name` of `pool` on `node` publishing whole GPUs `gpus`, consuming no counters."""
    published = device_slice(pool, {gpu: ("", GPU) for gpu in gpus}, node=node, slices=slices)
    published["metadata"]["name"] = name
    return published


def test_a_device_name_published_twice_makes_the_pool_invalid(client: Client) -> None:
    """dup-1's two slices both publish gpu-1: the scheduler says "duplicate device name
    gpu-1" and allocates nothing from the pool, gpu-0 and gpu-2 included. A request for two
    devices of the class can only be given whole-1's one, not two: it is counted as the most
    two could (a node may yet join), with a warning naming the name and the slices. An All
    request of the class is counted on whole-1, not on dup-1's node."""
    errors = load_reported(
        PARTS_CLASS,
        gpus_slice("dup-1-a", "dup-1", ["gpu-0", "gpu-1"], node="dup-1", slices=2),
        gpus_slice("dup-1-b", "dup-1", ["gpu-1", "gpu-2"], node="dup-1", slices=2),
        whole_gpus("whole-1", 1),
    )
    assert len(errors) == 1  # the sync counts one gpu-1, and says so
    parts_team()
    answer = decide(client, claim("two", [exact(2)]))
    assert answer["warnings"] == [
        cut(
            'request "gpu" cannot be allocated on any node now (a node that can may join), and '
            "counts as the most its devices could: it asks for 2 devices, all given on one "
            "node, and no node can give more than 1 of those it matches, not counting those of "
            f"pool {PARTS}/dup-1, which "
            "the scheduler allocates nothing from: device name 'gpu-1' is published more than "
            "once in generation 1 (slices dup-1-a, dup-1-b)"
        )
    ]
    assert reserved("two") == {"parts": Decimal(2)}
    assert decide(client, claim("node", [every()]))["allowed"]
    assert reserved("node") == {"parts": Decimal(1)}
    cluster_id = inventory_services.get_cluster("default").pk
    (pool,) = checks.invalid_pools(cluster_id=cluster_id)
    assert (pool.pool, pool.check, pool.devices, pool.slices) == (
        "dup-1",
        checks.DUPLICATE_DEVICE,
        ("gpu-1",),
        ("dup-1-a", "dup-1-b"),
    )


def test_a_device_name_in_the_slices_of_two_nodes_is_no_duplicate_to_the_scheduler() -> None:
    """The scheduler checks device names among the slices it gathers for one node: two slices
    of one pool, each bound to its own node, that publish the same name make no invalid pool
    (the sync still counts one of them, and says so)."""
    errors = load_reported(
        PARTS_CLASS,
        gpus_slice("spread-a", "spread", ["gpu-0"], node="node-a", slices=2),
        gpus_slice("spread-b", "spread", ["gpu-0"], node="node-b", slices=2),
    )
    assert len(errors) == 1
    assert [w["check"] for w in checks.sync_warnings()] == [checks.DUPLICATE_DEVICE]
    assert checks.invalid_pools(cluster_id=inventory_services.get_cluster("default").pk) == []


def test_a_counter_set_published_twice_makes_the_pool_invalid(client: Client) -> None:
    """Two slices of twice-1 publish 'gpu-0-counters': the scheduler says "duplicate counter
    set name gpu-0-counters" and allocates nothing from the pool. The fleet report says so
    too."""
    load(
        PARTS_CLASS,
        counter_slice("twice-1-a", "twice-1", {"gpu-0-counters": GPU}, slices=3),
        counter_slice("twice-1-b", "twice-1", {"gpu-0-counters": GPU}, slices=3),
        device_slice("twice-1", quarters("gpu-0-counters"), node="twice-1", slices=3),
    )
    parts_team()
    answer = decide(client, claim("quarter", [exact(1)]))
    assert answer["warnings"] == [
        cut(
            'request "gpu" can never be allocated, and counts nothing on quota rules: it '
            f"matches only devices of pool {PARTS}/twice-1, which the scheduler allocates "
            "nothing from: counter set 'gpu-0-counters' is published more than once in "
            "generation 1 (slices twice-1-a, twice-1-b)"
        )
    ]
    assert counts_nothing("quarter")
    assert [(w["check"], w["pool"], w["message"]) for w in checks.sync_warnings()] == [
        (
            checks.DUPLICATE_COUNTER_SET,
            "twice-1",
            f"pool {PARTS}/twice-1 generation 1: counter set 'gpu-0-counters' published more "
            "than once (slices twice-1-a, twice-1-b); the scheduler allocates no device of the "
            "pool",
        )
    ]


def test_the_scheduler_names_a_duplicate_before_what_is_not_published() -> None:
    """A pool with a device name published twice and a set no slice publishes: the duplicate
    is named (the scheduler checks names first), the other problem counted."""
    load_reported(
        PARTS_CLASS,
        counter_slice("both-1-counters", "both-1", {"gpu-0-counters": GPU}, slices=3),
        gpus_slice("both-1-a", "both-1", ["gpu-9"], node="both-1", slices=3),
        device_slice(
            "both-1", {**quarters("gpu-0-countres"), "gpu-9": ("", GPU)}, node="both-1", slices=3
        ),
    )
    (pool,) = checks.invalid_pools(cluster_id=inventory_services.get_cluster("default").pk)
    assert pool.problem() == (
        "device name 'gpu-9' is published more than once in generation 1 (slices both-1-a, "
        f"both-1-{PARTS}-devices); 1 more problem"
    )


def test_a_pool_whose_duplicate_goes_is_counted_again(client: Client) -> None:
    """The webhook's process checks a pool again when its slices change: a driver that stops
    publishing a name twice makes the pool's devices count at the next snapshot, and one that
    publishes a counter set twice makes them count no more."""
    first = gpus_slice("fix-1-a", "fix-1", ["gpu-0", "gpu-1"], node="fix-1", slices=2)
    second = gpus_slice("fix-1-b", "fix-1", ["gpu-1"], node="fix-1", slices=2)
    load_reported(PARTS_CLASS, first, second)
    parts_team()
    assert decide(client, claim("before", [exact(1)]))["warnings"]
    assert counts_nothing("before")

    second = gpus_slice("fix-1-b", "fix-1", ["gpu-2"], node="fix-1", slices=2)
    watch("MODIFIED", second, minutes=1)
    answer = decide(client, claim("fixed", [exact(2)]))
    assert answer["allowed"] and not answer.get("warnings"), answer
    assert reserved("fixed") == {"parts": Decimal(2)}

    counters = counter_slice("fix-1-b", "fix-1", {"gpu-0-counters": GPU, "gpu-1-counters": GPU})
    counters["spec"]["sharedCounters"].append(dict(counters["spec"]["sharedCounters"][0]))
    counters["spec"]["devices"] = []
    watch("MODIFIED", counters, minutes=2)
    (warning,) = decide(client, claim("broken", [exact(1)]))["warnings"]
    assert "counter set 'gpu-0-counters' is published more than once" in warning
    assert counts_nothing("broken")
