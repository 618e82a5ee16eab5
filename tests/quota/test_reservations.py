"""Reservations follow the sync: exact on allocation, released on deletion, expired if unseen."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from inventory import services as inventory_services
from quota import services
from quota.models import QuotaRule, Reservation
from quota.tasks import expire_reservations
from tests.quota.fixtures import AT, claim, decide, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]
H100 = "device.attributes['gpu.nvidia.com'].productName.contains('H100')"
A100 = "device.attributes['gpu.nvidia.com'].productName.contains('A100')"
RULES = [
    {"name": "all-gpus", "device_class": "gpu.nvidia.com", "limit": 8},
    {"name": "h100", "device_class": "gpu.nvidia.com", "selector": H100, "limit": 4},
    {"name": "a100", "device_class": "gpu.nvidia.com", "selector": A100, "limit": 4},
]


def prioritized(name: str) -> dict[str, Any]:
    return claim(
        name,
        [
            {
                "name": "gpu",
                "firstAvailable": [
                    {
                        "name": model,
                        "deviceClassName": "gpu.nvidia.com",
                        "count": 2,
                        "selectors": [{"cel": {"expression": expression}}],
                    }
                    for model, expression in (("h100", H100), ("a100", A100))
                ],
            }
        ],
    )


def synced(body: dict[str, Any], uid: str, results: list[tuple[str, str, str]]) -> dict[str, Any]:
    """The claim as the sync would see it once the scheduler allocated `results`."""
    seen = {**body, "metadata": {**body["metadata"], "uid": uid}}
    if results:
        seen["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": request,
                            "driver": "gpu.nvidia.com",
                            "pool": pool,
                            "device": device,
                        }
                        for request, pool, device in results
                    ]
                }
            }
        }
    return seen


def in_use() -> dict[str, Decimal]:
    return {
        name: value.normalize() for name, value in QuotaRule.objects.values_list("name", "in_use")
    }


def snapshot(claims: list[dict[str, Any]], at: Any = AT) -> None:
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=claims,
        at=at,
        kinds=["ResourceClaim"],
    )
    assert report.errors == []


def test_allocation_makes_the_reservation_exact_and_deletion_releases_it(client: Client) -> None:
    make_team(RULES)
    body = prioritized("train")
    assert decide(client, body)["allowed"]
    # Both alternatives fit, so each reserves what it could take until the scheduler picks.
    assert in_use() == {"all-gpus": 2, "h100": 2, "a100": 2}

    snapshot([synced(body, "uid-train", [])], at=AT + timedelta(minutes=1))  # pending
    reservation = Reservation.objects.get()
    assert (reservation.claim_uid, reservation.expires_at) == ("uid-train", None)

    allocated = synced(
        body, "uid-train", [("gpu/a100", "a100-a", "gpu-0"), ("gpu/a100", "a100-a", "gpu-1")]
    )
    snapshot([allocated], at=AT + timedelta(minutes=2))
    reservation.refresh_from_db()
    assert reservation.state == "allocated"
    assert in_use() == {"all-gpus": 2, "h100": 0, "a100": 2}  # the H100 alternative is freed

    snapshot([], at=AT + timedelta(hours=1))  # the claim is gone
    reservation.refresh_from_db()
    assert (reservation.state, reservation.released_at) == ("released", AT + timedelta(hours=1))
    assert in_use() == {"all-gpus": 0, "h100": 0, "a100": 0}


def test_allocated_claims_that_bypassed_the_webhook_are_adopted() -> None:
    make_team(RULES)
    body = claim(
        "old", [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 1}}]
    )
    snapshot([synced(body, "uid-old", [("gpu", "h100-a", "gpu-3")])])
    reservation = Reservation.objects.get()
    assert (reservation.state, reservation.username) == ("allocated", "")
    assert in_use() == {"all-gpus": 1, "h100": 1, "a100": 0}


def test_claims_of_unowned_namespaces_reserve_nothing() -> None:
    make_team(RULES)
    body = claim(
        "elsewhere",
        [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
        namespace="x",
    )
    snapshot([synced(body, "uid-x", [("gpu", "h100-a", "gpu-0")])])
    assert Reservation.objects.count() == 0


def test_reservations_for_claims_that_never_appear_expire(client: Client, settings: Any) -> None:
    make_team(RULES)
    assert decide(client, prioritized("ghost"))["allowed"]
    assert decide(client, prioritized("real"))["allowed"]
    snapshot([synced(prioritized("real"), "uid-real", [])])
    later = Reservation.objects.get(name="ghost").expires_at
    assert later is not None
    assert services.expire_reservations(now=later - timedelta(seconds=1)) == 0
    assert services.expire_reservations(now=later + timedelta(seconds=1)) == 1
    assert Reservation.objects.get(name="ghost").state == "released"
    assert Reservation.objects.get(name="real").state == "reserved"
    assert in_use() == {"all-gpus": 2, "h100": 2, "a100": 2}  # only "real" holds quota
    assert services.expire_reservations(now=later + timedelta(hours=1)) == 0  # rerun: nothing


def test_expiry_task_runs(client: Client) -> None:
    make_team(RULES)
    assert decide(client, prioritized("ghost"))["allowed"]
    Reservation.objects.update(expires_at=AT)
    assert expire_reservations.apply().get() == 1
    assert in_use() == {"all-gpus": 0, "h100": 0, "a100": 0}
