"""Pending demand: live claims holding no device, how long they have waited, what they ask
for, per team and device class, and who may see them (quota.pending)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from inventory.models import Allocation, Cluster, Device
from quota.pending import PendingDemandCollector, pending_claims, pending_demand
from teams.models import TeamNamespace
from tests.api.cast import Cast, cast
from tests.factories import ResourceClaimFactory
from tests.quota.fixtures import AT

__all__ = ["cast"]

pytestmark = pytest.mark.django_db

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
SEVENTH = Decimal("0.142857")


def spec(device_class: str, count: int = 1, **more: Any) -> dict[str, Any]:
    exactly = {"deviceClassName": device_class, "count": count, **more}
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


def make_claim(namespace: str, name: str, hours_ago: float, **fields: Any) -> Any:
    created = AT - timedelta(hours=hours_ago)
    return ResourceClaimFactory.create(
        cluster=Cluster.objects.get(name="default"),
        namespace=namespace,
        name=name,
        created_at=created,
        first_seen=created,
        **fields,
    )


def hold(claim: Any, *, start: Any, end: Any = None) -> Allocation:
    device = Device.objects.filter(cluster=claim.cluster, product_name=H100).first()
    assert device is not None
    return Allocation.objects.create(
        cluster=claim.cluster,
        claim=claim,
        device=device,
        request="gpu",
        driver=device.driver,
        pool=device.pool,
        device_name=device.name,
        start=start,
        end=end,
    )


@pytest.fixture
def queue(fleet: None, cast: Cast) -> Cast:
    """Alpha waits on two whole GPUs (3 h), one 1g.5gb MIG device (2 h) and a GPU again after
    holding one until an hour ago; beta on an A100 (30 min); a namespace of no team on a GPU
    of a class no cluster has (5 h). Allocated and released claims are not pending."""
    TeamNamespace.objects.create(team=cast.alpha, namespace="alpha")
    TeamNamespace.objects.create(team=cast.beta, namespace="beta")
    make_claim("alpha", "two-gpus", 3, spec=spec("gpu.nvidia.com", 2))
    make_claim(
        "alpha",
        "small-mig",
        2,
        spec=spec(
            "mig.nvidia.com",
            selectors=[
                {"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}}
            ],
        ),
    )
    again = make_claim("alpha", "again", 10, spec=spec("gpu.nvidia.com"))
    hold(again, start=AT - timedelta(hours=9), end=AT - timedelta(hours=1))
    running = make_claim("alpha", "running", 4, spec=spec("gpu.nvidia.com"))
    hold(running, start=AT - timedelta(hours=4))
    make_claim("alpha", "gone", 6, spec=spec("gpu.nvidia.com"), released_at=AT)
    make_claim(
        "beta",
        "a100",
        0.5,
        spec=spec(
            "gpu.nvidia.com",
            selectors=[
                {
                    "cel": {
                        "expression": f"device.attributes['gpu.nvidia.com'].productName == '{A100}'"
                    }
                }
            ],
        ),
    )
    make_claim("nobody", "odd", 5, spec=spec("tpu.example.org"))
    return cast


def test_pending_claims_wait_and_demand(queue: Cast) -> None:
    rows = pending_claims(user=queue.finance, now=AT)
    assert [(c.namespace, c.name, c.team, c.waited_seconds) for c in rows] == [
        ("nobody", "odd", "", 5 * 3600),
        ("alpha", "two-gpus", "alpha", 3 * 3600),
        ("alpha", "small-mig", "alpha", 2 * 3600),
        ("alpha", "again", "alpha", 3600),  # since its device was released, not its creation
        ("beta", "a100", "beta", 1800),
    ]
    weighed = {c.name: c.requests[0] for c in rows}
    assert weighed["two-gpus"].devices == 2
    assert weighed["two-gpus"].units == Decimal(2)
    assert weighed["two-gpus"].unit == "gpu"
    assert weighed["two-gpus"].models == (A100, H100)
    assert weighed["small-mig"].devices == 1
    assert weighed["small-mig"].units == SEVENTH
    assert weighed["small-mig"].models == (A100,)
    assert weighed["a100"].models == (A100,)
    # A class no cluster publishes: one whole device, as the webhook would count it.
    assert (weighed["odd"].devices, weighed["odd"].units, weighed["odd"].models) == (
        1,
        Decimal(1),
        (),
    )
    assert rows[0].waiting_since == AT - timedelta(hours=5)


def test_pending_demand_per_team_and_class(queue: Cast) -> None:
    summary = pending_demand(user=queue.operator, now=AT)
    assert [
        (r.team, r.device_class, r.unit, r.claims, r.devices, r.units, r.longest_wait_seconds)
        for r in summary
    ] == [
        ("", "tpu.example.org", "gpu", 1, 1, Decimal(1), 5 * 3600),
        ("alpha", "gpu.nvidia.com", "gpu", 2, 3, Decimal(3), 3 * 3600),
        ("alpha", "mig.nvidia.com", "gpu", 1, 1, SEVENTH, 2 * 3600),
        ("beta", "gpu.nvidia.com", "gpu", 1, 1, Decimal(1), 1800),
    ]


def test_each_lead_sees_only_their_team(queue: Cast) -> None:
    assert {c.name for c in pending_claims(user=queue.lead_a, now=AT)} == {
        "two-gpus",
        "small-mig",
        "again",
    }
    assert [c.name for c in pending_claims(user=queue.lead_b, now=AT)] == ["a100"]
    assert [r.team for r in pending_demand(user=queue.lead_b, now=AT)] == ["beta"]
    # A member who leads no team has no role, and sees nothing.
    assert pending_claims(user=queue.member_a, now=AT) == []


def test_unreadable_claim_is_pending_with_its_problem(queue: Cast) -> None:
    make_claim("beta", "broken", 1, spec={"devices": {"requests": [{"name": "x"}]}})
    broken = next(c for c in pending_claims(user=queue.lead_b, now=AT) if c.name == "broken")
    assert broken.requests == ()
    assert "exactly" in broken.problem
    summary = pending_demand(user=queue.lead_b, now=AT)
    assert [(r.device_class, r.claims, r.units) for r in summary] == [
        ("", 1, Decimal(0)),
        ("gpu.nvidia.com", 1, Decimal(1)),
    ]


def test_metrics_by_team_and_class(queue: Cast) -> None:
    registry = CollectorRegistry()
    registry.register(PendingDemandCollector(clock=lambda: AT))
    text = generate_latest(registry).decode()
    assert 'tally_pending_claims{device_class="gpu.nvidia.com",team="alpha",unit="gpu"} 2.0' in text
    assert (
        'tally_pending_demand_units{device_class="mig.nvidia.com",team="alpha",unit="gpu"} '
        "0.142857" in text
    )
    # A class no cluster publishes is "other": claims cannot add series by naming classes.
    assert 'tally_pending_claims{device_class="other",team="",unit="gpu"} 1.0' in text
    assert "tpu.example.org" not in text
    assert 'tally_pending_longest_wait_seconds{team="beta"} 1800.0' in text
