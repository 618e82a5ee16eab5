"""Consumable capacity (KEP-5075): `inventory.capacity` by itself, and what the webhook and the
ledger count for shares of a shareable device, under any capacity name, with request policies.

The fleet is this module's own: one node with a GPU shared by memory (a valid range with a
default), one shared by `cores` in valid values, one shared with no policy at all, and a TPU
node (its shape rows say "tpu") for the units that messages name.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from kubernetes.utils import parse_quantity

from inventory import services as inventory_services
from inventory.capacity import (
    CapacityError,
    capacity_entry,
    consumed_fraction,
    requested_amounts,
)
from inventory.models import DeviceShape
from quota.admission.shapes import forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from tests.quota.fixtures import AT, claim, decide, make_team, nvidia_slice

DRIVER = "gpu.nvidia.com"
RANGED = {
    "memory": {
        "value": "80Gi",
        "requestPolicy": {
            "default": "8Gi",
            "validRange": {"min": "4Gi", "max": "40Gi", "step": "4Gi"},
        },
    }
}
VALUED = {
    "cores": {
        "value": "100",
        "requestPolicy": {"default": "25", "validValues": ["25", "50", "100"]},
    },
    "memory": {"value": "80Gi", "requestPolicy": {"default": "0", "validRange": {"min": "0"}}},
}
PLAIN = {"gpu.nvidia.com/memory": {"value": "80Gi"}}

# --- inventory.capacity ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "name", "key"),
    [
        ({"memory": {"value": "1"}}, "memory", "memory"),
        ({"memory": {"value": "1"}}, "gpu.nvidia.com/memory", "memory"),
        ({"gpu.nvidia.com/memory": {"value": "2"}}, "memory", "gpu.nvidia.com/memory"),
        # A bare name finds the capacity in another domain, the first of them in name order.
        (
            {"z.example.com/memory": {"value": "4"}, "a.example.com/memory": {"value": "3"}},
            "memory",
            "a.example.com/memory",
        ),
        # A name qualified with another domain means that domain's capacity only.
        ({"memory": {"value": "1"}}, "other.example.com/memory", None),
        ({"cores": {"value": "1"}}, "memory", None),
    ],
)
def test_capacity_entry_by_any_name(capacity: dict, name: str, key: str | None) -> None:
    assert capacity_entry(capacity, name, DRIVER) == (capacity[key] if key else None)


@pytest.mark.parametrize(
    ("requests", "memory"),
    [
        ({}, "8Gi"),  # not named: the policy's default
        ({"memory": "1Gi"}, "4Gi"),  # below min: min
        ({"memory": "5Gi"}, "8Gi"),  # up to min + n * step
        ({"memory": "8Gi"}, "8Gi"),
        ({"gpu.nvidia.com/memory": "9Gi"}, "12Gi"),  # a qualified name is the same capacity
        ({"memory": "40Gi"}, "40Gi"),
    ],
)
def test_valid_range_rounds_up_to_min_and_step(requests: dict, memory: str) -> None:
    assert requested_amounts(RANGED, requests, DRIVER) == {"memory": _q(memory)}


def test_valid_values_round_up_to_the_next_valid_value() -> None:
    assert requested_amounts(VALUED, {}, DRIVER) == {"cores": 25, "memory": 0}
    assert requested_amounts(VALUED, {"cores": "26"}, DRIVER)["cores"] == 50
    assert requested_amounts(VALUED, {"cores": "100"}, DRIVER)["cores"] == 100


@pytest.mark.parametrize(
    ("capacity", "requests", "problem"),
    [
        (VALUED, {"cores": "101"}, "above its largest valid value 100"),
        (RANGED, {"memory": "41Gi"}, "above its valid range's max"),
        (PLAIN, {"memory": "81Gi"}, "more than the device has"),
        (RANGED, {"cores": "1"}, "capacity 'cores': the device does not publish it"),
        (RANGED, {"memory": "lots"}, "capacity.requests.memory: 'lots' is not a quantity"),
    ],
)
def test_requests_a_device_cannot_satisfy(capacity: dict, requests: dict, problem: str) -> None:
    with pytest.raises(CapacityError, match=problem):
        requested_amounts(capacity, requests, DRIVER)


def test_a_capacity_without_policy_is_consumed_whole_unless_requested() -> None:
    # As the scheduler fills an empty request: the policy's default, else the whole value.
    both = {**RANGED, "multiprocessors": {"value": "132"}}
    amounts = requested_amounts(both, {"memory": "8Gi"}, DRIVER)
    assert amounts == {"memory": _q("8Gi"), "multiprocessors": 132}
    assert consumed_fraction(both, amounts, DRIVER) == 1
    assert requested_amounts(PLAIN, {"memory": "20Gi"}, DRIVER) == {
        "gpu.nvidia.com/memory": _q("20Gi")
    }


def test_consumed_fraction_is_the_largest_of_any_capacity_named() -> None:
    assert consumed_fraction(VALUED, {"cores": "50", "memory": "8Gi"}, DRIVER) == Decimal("0.5")
    assert consumed_fraction(VALUED, {"cores": "25", "memory": "40Gi"}, DRIVER) == Decimal("0.5")
    assert consumed_fraction(PLAIN, {"memory": "20Gi"}, DRIVER) == Decimal("0.25")
    assert consumed_fraction(PLAIN, {"memory": "800Gi"}, DRIVER) == 1  # capped
    # Nothing the device publishes is named: nothing says it is shared, so the whole device.
    assert consumed_fraction(PLAIN, {"bandwidth": "1"}, DRIVER) == 1
    assert consumed_fraction({"memory": {"value": "0"}}, {"memory": "0"}, DRIVER) == 1


# --- the webhook and the ledger ----------------------------------------------------------------


def _gpu(name: str, capacity: dict[str, Any], product: str) -> dict[str, Any]:
    return {
        "name": name,
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-share-{name}"},
            "productName": {"string": product},
        },
        "capacity": capacity,
    }


def _objects() -> list[dict[str, Any]]:
    gpus = [
        _gpu("gpu-0", RANGED, "ranged"),
        _gpu("gpu-1", VALUED, "valued"),
        _gpu("gpu-2", PLAIN, "plain"),
    ]
    tpus = [
        {
            "name": f"tpu-{i}",
            "attributes": {"type": {"string": "tpu"}, "uuid": {"string": f"TPU-{i}"}},
        }
        for i in range(4)
    ]
    return [
        _class("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com'"),
        _class("tpu.google.com", "device.driver == 'tpu.google.com'"),
        nvidia_slice("share-node", gpus, DRIVER),
        nvidia_slice("tpu-node", tpus, "tpu.google.com"),
    ]


def _class(name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


@pytest.fixture
def share_fleet(db: None) -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=_objects(), at=AT
    )
    assert report.errors == []
    # Until the sync writes units from the drivers' profiles, this module's TPUs say so here.
    DeviceShape.objects.filter(driver="tpu.google.com").update(kind="gpu", unit="tpu", gpu_share=1)
    forget_fleet_shapes()


def _share(product: str, requests: dict[str, str] | None = None, **more: Any) -> dict[str, Any]:
    exactly: dict[str, Any] = {
        "deviceClassName": "gpu.nvidia.com",
        "selectors": [
            {
                "cel": {
                    "expression": f"device.attributes['gpu.nvidia.com'].productName == '{product}'"
                }
            }
        ],
        **more,
    }
    if requests is not None:
        exactly["capacity"] = {"requests": requests}
    return {"name": "share", "exactly": exactly}


def _reserved(name: str) -> dict[str, Decimal]:
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


GPU_RULES = [
    {"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 2},
    {"name": "gpu-memory", "device_class": "gpu.nvidia.com", "unit": "memory", "limit": 2**40},
]


@pytest.mark.usefixtures("share_fleet")
@pytest.mark.parametrize(
    ("request_body", "gpus", "memory"),
    [
        # The qualified name counts its fraction (it counted a whole GPU before).
        (_share("plain", {"gpu.nvidia.com/memory": "20Gi"}), "0.25", "20Gi"),
        (_share("plain", {"memory": "20Gi"}), "0.25", "20Gi"),
        # No capacity named: the policy's default (it counted a whole GPU before) ...
        (_share("ranged"), "0.1", "8Gi"),
        # ... and on a device with no policy, the whole device, as the scheduler gives it.
        (_share("plain"), "1", "80Gi"),
        # Rounded up by the range's step and by the valid values.
        (_share("ranged", {"memory": "9Gi"}), "0.15", "12Gi"),
        (_share("valued", {"cores": "30"}), "0.5", "0"),
        (_share("valued", {"gpu.nvidia.com/cores": "30", "memory": "60Gi"}), "0.75", "60Gi"),
        # Two shares of one request: each counts.
        (_share("ranged", {"memory": "4Gi"}, count=2), "0.1", "8Gi"),
    ],
)
def test_a_share_counts_its_fraction_under_any_name(
    client: Client, request_body: dict, gpus: str, memory: str
) -> None:
    make_team(GPU_RULES)
    answer = decide(client, claim("s", [request_body]))
    assert answer["allowed"], answer
    assert answer.get("warnings") is None
    assert _reserved("s") == {"gpus": Decimal(gpus), "gpu-memory": _q(memory)}


@pytest.mark.usefixtures("share_fleet")
def test_a_request_no_device_can_satisfy_counts_whole_and_says_why(client: Client) -> None:
    make_team(GPU_RULES[:1])
    answer = decide(client, claim("big", [_share("valued", {"cores": "101"})]))
    assert answer["allowed"]
    assert answer["warnings"][0] == (
        'request "share": no device of class "gpu.nvidia.com" with capacity cores: 101 in the '
        "inventory matches it; until allocated, each device it asks for counts as a whole GPU "
        "(no memory) on every quota rule of its class and of its driver gpu.nvidia.com"
    )
    assert _reserved("big") == {"gpus": 1}


@pytest.mark.usefixtures("share_fleet")
def test_shares_are_denied_past_the_limit_by_their_fraction(client: Client) -> None:
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": "0.3"}])
    assert decide(client, claim("a", [_share("ranged", {"memory": "10Gi"})]))["allowed"]  # 0.15
    assert decide(client, claim("b", [_share("ranged", {"memory": "12Gi"})]))["allowed"]  # 0.15
    denied = decide(client, claim("c", [_share("ranged")]))
    assert not denied["allowed"]
    assert denied["status"]["message"] == (
        'team "research": quota rule "gpus" (enforce) would be exceeded: 0.3 GPUs in use, '
        "0.1 GPUs requested, limit 0.3 GPUs"
    )


@pytest.mark.usefixtures("share_fleet")
def test_an_allocated_share_counts_its_consumed_capacity_by_any_name() -> None:
    make_team(GPU_RULES)
    allocated = claim("done", [_share("plain", {"gpu.nvidia.com/memory": "20Gi"})])
    allocated["metadata"]["uid"] = "uid-done"
    allocated["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "share",
                        "driver": DRIVER,
                        "pool": "share-node",
                        "device": "gpu-2",
                        "shareID": "0b5f3c1e-6a2d-4f8e-9c7b-1d3e5f7a9b2c",
                        "consumedCapacity": {"gpu.nvidia.com/memory": "20Gi"},
                    }
                ]
            }
        }
    }
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=[*_objects(), allocated], at=AT
    )
    assert report.errors == []
    rules = dict(QuotaRule.objects.values_list("name", "in_use"))
    assert rules == {"gpus": Decimal("0.25"), "gpu-memory": _q("20Gi")}


@pytest.mark.usefixtures("share_fleet")
def test_messages_and_amounts_say_the_unit_of_the_devices_a_rule_covers(client: Client) -> None:
    make_team([{"name": "tpus", "device_class": "tpu.google.com", "limit": 3}])
    make_team([{"name": "anything", "device_class": "any", "limit": 8, "mode": "warn"}], "mixed")
    # A class that selects every device: TPU chips and GPUs together are "accelerators".
    inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[*_objects(), _class("any", "true")],
        at=AT,
    )
    DeviceShape.objects.filter(driver="tpu.google.com").update(kind="gpu", unit="tpu", gpu_share=1)
    forget_fleet_shapes()
    tpus = {"name": "tpu", "exactly": {"deviceClassName": "tpu.google.com", "count": 2}}
    assert decide(client, claim("t1", [tpus]))["allowed"]
    denied = decide(client, claim("t2", [tpus]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "tpus" (enforce) would be exceeded: 2 TPU chips in use, '
        "2 TPU chips requested, limit 3 TPU chips"
    )
    one = {"name": "tpu", "exactly": {"deviceClassName": "tpu.google.com", "count": 1}}
    near = decide(client, claim("t3", [one]))
    assert near["warnings"] == [
        'team "research": quota rule "tpus" is at 3 TPU chips of 3 TPU chips with this claim'
    ]
    everything = {"name": "all", "exactly": {"deviceClassName": "any", "count": 6}}
    # Six of the one node's shares: its three shareable GPUs give two each by their policies'
    # default requests (2.1 GPUs), the TPU node's four chips fall short of six.
    for name in ("m1", "m2", "m3"):
        assert decide(client, claim(name, [everything], namespace="mixed"))["allowed"]
        assert _reserved(name) == {"anything": Decimal("2.1")}
    warned = decide(client, claim("m4", [everything], namespace="mixed"))
    assert warned["warnings"] == [
        'team "mixed": quota rule "anything" (warn) would be exceeded: 6.3 accelerators in use, '
        "2.1 accelerators requested, limit 8 accelerators (warn only)"
    ]


def _q(quantity: str) -> Decimal:
    return Decimal(parse_quantity(quantity))
