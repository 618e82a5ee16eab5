"""Quota accounting of claims on AMD auto-partition devices, through the webhook as the API
server calls it (vendors/amd-mi300x-autopartition: two MI300X, five mode devices each).

A claim of a mode device takes one of the mode's `partitions` (the capacity's default and only
valid value), and with it that partition's memory: a CPX claim is an eighth of an MI300X and
24Gi, a DPX claim a half and 96Gi, SPX the whole GPU.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota.admission.shapes import forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from tests.fixtures import DRA
from tests.quota.fixtures import AT, claim, decide, make_team

pytestmark = pytest.mark.django_db
GIB = 2**30
AMD = "gpu.amd.com"


def mode(compute: str, memory: str = "") -> str:
    expression = f"device.attributes['gpu.amd.com'].computePartition == '{compute}'"
    if memory:
        expression += f" && device.attributes['gpu.amd.com'].memoryPartition == '{memory}'"
    return expression


def request(expression: str, name: str = "gpu", **more: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": AMD, **more}
    fields.setdefault("allocationMode", "ExactCount")
    if fields["allocationMode"] == "ExactCount":
        fields.setdefault("count", 1)
    fields["selectors"] = [{"cel": {"expression": expression}}]
    return {"name": name, "exactly": fields}


def reserved(name: str) -> dict[str, Decimal]:
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


@pytest.fixture
def autopartition() -> None:
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=list(iter_objects(DRA / "vendors" / "amd-mi300x-autopartition.yaml")),
        at=AT,
    )
    assert report.errors == []


@pytest.mark.usefixtures("autopartition")
def test_a_partition_claim_counts_its_share_of_the_gpu_and_its_memory(client: Client) -> None:
    make_team(
        [
            {"name": "amd", "device_class": AMD, "limit": 1},
            {"name": "amd-memory", "device_class": AMD, "unit": "memory", "limit": 200 * GIB},
        ]
    )
    # One CPX partition, as the driver's example claims it (partitions: "1") and without.
    cpx = request(mode("cpx", "nps4"), capacity={"requests": {"partitions": "1"}})
    assert decide(client, claim("cpx", [cpx]))["allowed"]
    assert reserved("cpx") == {"amd": Decimal("0.125"), "amd-memory": Decimal(24 * GIB)}
    assert decide(client, claim("cpx-default", [request(mode("cpx", "nps1"))]))["allowed"]
    assert reserved("cpx-default") == {"amd": Decimal("0.125"), "amd-memory": Decimal(24 * GIB)}
    assert decide(client, claim("dpx", [request(mode("dpx"))]))["allowed"]
    assert reserved("dpx") == {"amd": Decimal("0.5"), "amd-memory": Decimal(96 * GIB)}
    # All CPX/NPS1 devices of the node: one share of each GPU's, an eighth of each.
    every = request(mode("cpx", "nps1"), name="all", allocationMode="All")
    answer = decide(client, claim("all-cpx", [every]))
    assert answer["allowed"]
    assert reserved("all-cpx") == {"amd": Decimal("0.25"), "amd-memory": Decimal(48 * GIB)}
    assert 'quota rule "amd" is at 1 GPU of 1 GPU with this claim' in " ".join(answer["warnings"])
    # SPX is the whole GPU: past the limit.
    denied = decide(client, claim("spx", [request(mode("spx"))]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "amd" (enforce) would be exceeded: 1 GPU in use, '
        "1 GPU requested, limit 1 GPU"
    )
    assert QuotaRule.objects.get(name="amd-memory").in_use == 192 * GIB


@pytest.mark.usefixtures("autopartition")
def test_more_than_one_partition_in_one_share_is_never_given(client: Client) -> None:
    """The driver allows one partition per share (validValues ["1"]): a request for two is
    matched by no device, and counts as a whole GPU until allocated, with a warning."""
    make_team([{"name": "amd", "device_class": AMD, "limit": 4}])
    two = request(mode("cpx", "nps1"), capacity={"requests": {"partitions": "2"}})
    answer = decide(client, claim("two", [two]))
    assert answer["allowed"]
    assert 'no device of class "gpu.amd.com" with capacity partitions: 2' in answer["warnings"][0]
    assert reserved("two") == {"amd": Decimal(1)}
