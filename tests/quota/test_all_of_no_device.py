"""Issue 36, finding 3 for `allocationMode: All`: a request through a class that matches no
device yet counted 0 (it is given every matching device of a node once they appear). It counts
the most devices of its class's driver one node has, with a warning, or is refused, naming the
class, where the fleet has no device of that driver at all."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from inventory import services as inventory_services
from quota.admission.shapes import forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from tests.quota.fixtures import AT, claim, decide, fleet_objects, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

MIG_7G = (
    "mig-7g.80gb.nvidia.com",  # a profile not configured on any GPU yet
    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].profile == '7g.80gb'",
)
NEW_ACCEL = ("new-accel", "device.driver == 'accel.example.com'")  # a driver with no device


def with_classes(*classes: tuple[str, str]) -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[
            *fleet_objects(),
            *(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": name},
                    "spec": {"selectors": [{"cel": {"expression": expression}}]},
                }
                for name, expression in classes
            ),
        ],
        at=AT,
    )
    assert report.errors == []


def all_of(device_class: str) -> dict[str, Any]:
    return {"name": "all", "exactly": {"deviceClassName": device_class, "allocationMode": "All"}}


def test_all_through_a_class_of_no_device_counts_the_fullest_node_of_its_driver(
    client: Client,
) -> None:
    """The fleet's fullest NVIDIA node has 4 devices (the H100 node; the MIG node too)."""
    with_classes(MIG_7G)
    make_team([{"name": "nvidia", "device_class": "gpu.nvidia.com", "limit": 6}])
    answer = decide(client, claim("whole-node", [all_of(MIG_7G[0])]))
    assert answer["allowed"]
    assert (
        'request "all" (allocationMode All): class "mig-7g.80gb.nvidia.com" matches no device '
        "yet; until allocated, it counts as 4 whole GPUs, the most devices of its driver "
        "gpu.nvidia.com on one node, on every quota rule of its class and driver"
    ) in answer["warnings"]
    assert QuotaRule.objects.get().in_use == 4
    denied = decide(client, claim("another", [all_of(MIG_7G[0])]))
    assert denied["status"]["message"].startswith(
        'team "research": quota rule "nvidia" (enforce) would be exceeded: 4 GPUs in use, '
        '4 GPUs requested, limit 6 GPUs (request "all" (allocationMode All): class '
        '"mig-7g.80gb.nvidia.com" matches no device yet'
    )


@pytest.mark.parametrize("mode", ["enforce", "warn"])
def test_all_through_a_class_of_a_driver_with_no_device_is_refused_naming_it(
    client: Client, mode: str
) -> None:
    with_classes(NEW_ACCEL, ("any", "true"))
    make_team([{"name": "anything", "device_class": "any", "limit": 8, "mode": mode}])
    answer = decide(client, claim("all-new", [all_of(NEW_ACCEL[0])]))
    problem = (
        'request "all" (allocationMode All): no device of class "new-accel" is in the '
        "inventory, nor any of its driver accel.example.com, so Tally cannot tell how many "
        "devices it would be given"
    )
    if mode == "enforce":
        assert answer["status"]["message"] == (
            problem + "; it could be given devices an enforce quota rule limits, uncounted"
        )
        assert not Reservation.objects.exists()
    else:
        assert answer["allowed"]
        assert problem + " (warn only); it counts on none" in answer["warnings"]
