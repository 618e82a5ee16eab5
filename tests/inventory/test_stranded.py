"""Stranded gangs over a simulated week: which gangs are partial, since when, what they hold,
what that has cost, and who may see them (inventory.stranded, billing.stranded)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from billing.models import RateCard
from billing.stranded import priced_stranded_gangs
from inventory.models import Allocation, Cluster, Device, Gang, ResourceClaim
from inventory.stranded import StrandedGangCollector, stranded_gangs
from teams.models import TeamNamespace
from tests.api.cast import Cast, cast
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
    ResourceClaimFactory,
)

__all__ = ["cast"]

pytestmark = pytest.mark.django_db

MONDAY = datetime(2026, 11, 23, tzinfo=UTC)
NOW = MONDAY + timedelta(days=7)
H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class Week:
    cast: Cast
    cluster: Cluster
    gpus: list[Device]


def make_gang(cluster: Cluster, namespace: str, key: str, size: int) -> Gang:
    return Gang.objects.create(
        cluster=cluster,
        namespace=namespace,
        key=key,
        source="jobset",
        size=size,
        first_seen=MONDAY,
        last_seen=NOW,
    )


def member_claim(gang: Gang, pod: str, **fields: Any) -> ResourceClaim:
    return ResourceClaimFactory.create(
        cluster=gang.cluster,
        namespace=gang.namespace,
        name=f"{pod}-gpu",
        gang=gang,
        owner_references=[{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": f"uid-{pod}"}],
        created_at=MONDAY,
        first_seen=MONDAY,
        **fields,
    )


def hold(claim: ResourceClaim, device: Device, start: datetime, end: datetime | None = None) -> Any:
    return AllocationFactory.create(
        claim=claim, device=device, cluster=claim.cluster, start=start, end=end
    )


@pytest.fixture
def week(cast: Cast) -> Week:
    """Alpha's two-worker JobSet `train`: worker 0 holds 8 H100s all week, worker 1 never
    appears. Alpha's `ok` runs whole all week. Alpha's `blip` ran whole until worker 1's pod
    restarted 20 minutes ago. Beta's four-pod `small` has one pod holding a 1g.10gb slice for
    two hours; another pod waits, two are missing."""
    TeamNamespace.objects.create(team=cast.alpha, namespace="alpha")
    TeamNamespace.objects.create(team=cast.beta, namespace="beta")
    cluster = ClusterFactory.create(name="week")
    node = NodeFactory.create(cluster=cluster, name="h100-node")
    gpus = [DeviceFactory.create(node=node) for _ in range(12)]
    train = make_gang(cluster, "alpha", "JobSet/train", 2)
    worker0 = member_claim(train, "train-0")
    for gpu in gpus[:8]:
        hold(worker0, gpu, MONDAY)
    ok = make_gang(cluster, "alpha", "JobSet/ok", 2)
    hold(member_claim(ok, "ok-0"), gpus[8], MONDAY)
    hold(member_claim(ok, "ok-1"), gpus[9], MONDAY)
    blip = make_gang(cluster, "alpha", "JobSet/blip", 2)
    hold(member_claim(blip, "blip-0"), gpus[10], MONDAY)
    old = member_claim(blip, "blip-1-old", released_at=NOW - timedelta(minutes=20))
    hold(old, gpus[11], MONDAY, NOW - timedelta(minutes=20))
    member_claim(blip, "blip-1")  # its replacement, pending
    small = make_gang(cluster, "beta", "JobSet/small", 4)
    mig = MigDeviceFactory.create(parent=DeviceFactory.create(node=node))
    hold(member_claim(small, "small-0"), mig, NOW - timedelta(hours=2))
    member_claim(small, "small-1")
    return Week(cast=cast, cluster=cluster, gpus=gpus)


def test_a_half_held_jobset_is_stranded_all_week(week: Week) -> None:
    found = stranded_gangs(user=week.cast.operator, now=NOW)
    assert [(g.namespace, g.key) for g in found] == [
        ("alpha", "JobSet/train"),
        ("beta", "JobSet/small"),
    ]
    train = found[0]
    assert (train.team, train.size, train.members_holding, train.members_present) == (
        "alpha",
        2,
        1,
        1,
    )
    assert (train.devices_held, train.units_held, train.unit) == (8, Decimal(8), "gpu")
    assert train.stranded_since == MONDAY
    assert train.stranded_seconds == 7 * 24 * 3600
    (line,) = train.held
    assert (line.product_name, line.devices, line.unit_ms) == (H100, 8, Decimal(8 * 168 * 3600_000))


def test_threshold_and_handover(week: Week) -> None:
    # The blip is partial for 20 minutes: under the default 30, over 10.
    found = stranded_gangs(user=week.cast.operator, now=NOW, threshold=timedelta(minutes=10))
    blip = next(g for g in found if g.key == "JobSet/blip")
    assert blip.stranded_since == NOW - timedelta(minutes=20)
    assert (blip.members_holding, blip.members_present, blip.devices_held) == (1, 2, 1)
    # What it held during the stretch: one GPU for 20 minutes (the restarted pod's was released).
    assert sum(line.unit_ms for line in blip.held) == Decimal(20 * 60_000)
    # Within the first 30 minutes of the week the train gang is partial but not yet stranded.
    early = MONDAY + timedelta(minutes=29)
    assert [g.key for g in stranded_gangs(user=week.cast.operator, now=early)] == []
    later = MONDAY + timedelta(minutes=31)
    assert [g.key for g in stranded_gangs(user=week.cast.operator, now=later)] == ["JobSet/train"]


def test_a_member_handing_over_between_allocations_keeps_the_gang_whole(week: Week) -> None:
    gang = make_gang(week.cluster, "alpha", "JobSet/relay", 2)
    first = member_claim(gang, "relay-0")
    device = DeviceFactory.create(node=week.gpus[0].node)
    hold(first, device, MONDAY, MONDAY + timedelta(days=3))
    hold(first, DeviceFactory.create(node=device.node), MONDAY + timedelta(days=3))
    hold(member_claim(gang, "relay-1"), DeviceFactory.create(node=device.node), MONDAY)
    keys = [g.key for g in stranded_gangs(user=week.cast.operator, now=NOW)]
    assert "JobSet/relay" not in keys
    # An ended gang is never reported.
    Gang.objects.filter(key="JobSet/train").update(ended_at=NOW)
    assert [g.key for g in stranded_gangs(user=week.cast.operator, now=NOW)] == ["JobSet/small"]


def test_money_held_at_current_rates(week: Week) -> None:
    RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.5000"),
        idle_factor=Decimal("0.5"),
        currency="EUR",
        valid_from=MONDAY.date(),
    )
    RateCard.objects.create(
        product_name=H100,
        profile="1g.10gb",
        per_gpu_hour=Decimal("0.5000"),
        currency="USD",
        valid_from=MONDAY.date(),
    )
    priced = {p.gang.key: p for p in priced_stranded_gangs(user=week.cast.finance, now=NOW)}
    train = priced["JobSet/train"]
    assert train.unit_hours == Decimal("1344")  # 8 GPUs x 168 h
    assert train.cost == {"EUR": Decimal("3360.00")}
    assert train.unpriced_unit_hours == 0
    small = priced["JobSet/small"]
    assert small.unit_hours == Decimal("0.285714")  # 2 h of a seventh of a GPU
    assert small.cost == {"USD": Decimal("1.00")}  # 2 slice-hours at 0.50


def test_hours_without_a_rate_card_are_reported_unpriced(week: Week) -> None:
    (train,) = priced_stranded_gangs(user=week.cast.lead_a, now=NOW)
    assert train.cost == {}
    assert train.unpriced_unit_hours == Decimal("1344")


def test_each_lead_sees_only_their_team(week: Week) -> None:
    assert [g.key for g in stranded_gangs(user=week.cast.lead_a, now=NOW)] == ["JobSet/train"]
    assert [g.key for g in stranded_gangs(user=week.cast.lead_b, now=NOW)] == ["JobSet/small"]
    assert stranded_gangs(user=week.cast.member_a, now=NOW) == []
    assert [
        g.key for g in stranded_gangs(user=week.cast.finance, now=NOW, team=week.cast.beta)
    ] == ["JobSet/small"]


def test_query_count_does_not_grow_with_gangs(
    week: Week, django_assert_max_num_queries: Any
) -> None:
    for index in range(5):
        gang = make_gang(week.cluster, "alpha", f"JobSet/more-{index}", 3)
        hold(
            member_claim(gang, f"more-{index}-0"),
            DeviceFactory.create(node=week.gpus[0].node),
            MONDAY,
        )
    with django_assert_max_num_queries(4):
        assert len(stranded_gangs(user=week.cast.operator, now=NOW)) == 7


def test_metrics_per_team(week: Week) -> None:
    registry = CollectorRegistry()
    registry.register(StrandedGangCollector(clock=lambda: NOW))
    text = generate_latest(registry).decode()
    assert 'tally_stranded_gangs{team="alpha",unit="gpu"} 1.0' in text
    assert 'tally_stranded_gang_devices{team="alpha",unit="gpu"} 8.0' in text
    assert 'tally_stranded_gang_units{team="beta",unit="gpu"} 0.142857' in text
    assert Allocation.objects.filter(end__isnull=True).count() == 12
