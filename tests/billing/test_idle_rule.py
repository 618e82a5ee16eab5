"""One rule for an idle hour wherever Tally names idle claims: the alerts (`billing.idle`), the
team page's idle holders (`billing.selectors.idle_holders`) and the week report's longest idle
claims (`billing.week`). They once disagreed on partly measured hours and on the boundary
(at most 5% of measured time, against below 5% of the time held); now all three read
`idle_hour`, or `idle_hour_q` in SQL, at the team's percent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.idle import idle_claims, idle_hour, idle_hour_q
from billing.selectors import idle_holders
from billing.week import team_week
from inventory.models import Allocation, Cluster
from metering.hours import HOUR
from metering.models import UsageHour
from teams.models import IdleAlertPolicy, Team
from tests.billing.test_idle_alerts import claim_holding
from tests.factories import AllocationFactory, ClusterFactory, DeviceFactory, owner_of

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)  # a Monday
H = 3_600_000


def _hours(allocation: Allocation, figures: list[tuple[int, int, int]]) -> None:
    """Usage rows from T0, one an hour: (allocated, utilised, unmeasured) ms each."""
    device = allocation.device
    assert device is not None
    UsageHour.objects.bulk_create(
        UsageHour(
            hour=T0 + n * HOUR,
            allocation=allocation,
            cluster_id=allocation.cluster_id,
            device_uuid=device.meter_id,
            product_name=device.product_name,
            gpu_share=device.gpu_share,
            namespace=allocation.claim.namespace,
            claim_name=allocation.claim.name,
            team=owner_of(allocation),
            job=allocation.job,
            username=allocation.username,
            allocated_gpu_ms=allocated,
            utilised_gpu_ms=utilised,
            unmeasured_gpu_ms=unmeasured,
        )
        for n, (allocated, utilised, unmeasured) in enumerate(figures)
    )


@st.composite
def _figures(draw: st.DrawFn) -> tuple[int, int, int]:
    allocated = draw(st.integers(min_value=0, max_value=8 * H))
    utilised = draw(st.integers(min_value=0, max_value=allocated))
    unmeasured = draw(st.integers(min_value=0, max_value=allocated - utilised))
    return allocated, utilised, unmeasured


@given(
    figures=st.lists(_figures(), min_size=1, max_size=12),
    below=st.sampled_from([Decimal("0.01"), Decimal("0.5"), 5, Decimal("12.34"), 100]),
)
def test_the_sql_rule_is_the_python_rule(figures: list[tuple[int, int, int]], below: Any) -> None:
    UsageHour.objects.all().delete()
    team = Team.objects.get_or_create(slug="rule", name="Rule")[0]
    cluster = Cluster.objects.filter(name="rule").first() or ClusterFactory.create(name="rule")
    allocation = (
        Allocation.objects.filter(claim__name="held").first()
        or (claim_holding(cluster, team, "held", 1)[0])
    )
    _hours(allocation, figures)
    in_sql = set(UsageHour.objects.filter(idle_hour_q(below)).values_list("hour", flat=True))
    in_python = {T0 + n * HOUR for n, f in enumerate(figures) if idle_hour(*f, below)}
    assert in_sql == in_python


@pytest.mark.parametrize(
    ("hour", "idle"),
    [
        ((H, 0, H // 2), False),  # half unmeasured, the rest at 0%: not known to be idle
        ((H, H // 20, 0), False),  # exactly 5%: not below 5%
        ((H, H // 20 - 1, 0), True),  # just under
        ((H, 0, H // 20), False),  # 5% unmeasured counts as busy
        ((0, 0, 0), False),  # not held
    ],
)
def test_every_reader_of_idle_hours_agrees(hour: tuple[int, int, int], idle: bool) -> None:
    team = Team.objects.create(slug="alpha", name="Alpha")
    IdleAlertPolicy.objects.create(team=team, below_percent=Decimal(5), for_hours=3)
    cluster = ClusterFactory.create(name="prod")
    allocation = claim_holding(cluster, team, "notebook", 1, start=T0)[0]
    # Three hours at 1% (idle by every rule), then three of the hour under test.
    _hours(allocation, [(H, H // 100, 0)] * 3 + [hour] * 3)
    now = T0 + 6 * HOUR + timedelta(minutes=10)

    alerted = {claim.claim_name for claim in idle_claims(now=now)}
    holders = {holder.claim_name for holder in idle_holders(team=team, now=now, below_percent=5)}
    week = team_week(team=team, start=T0, now=now, budget=None)
    [longest] = week.idle_claims
    assert week.idle_below_percent == 5
    # Idle in the last three hours: alerted, and still an idle holder; the week's run is six
    # hours long when they are idle, the first three otherwise.
    assert alerted == ({"notebook"} if idle else set())
    assert holders == ({"notebook"} if idle else set())
    assert longest.longest_hours == (6 if idle else 3)


def _hour_rows(allocation: Allocation, first: int, figures: list[tuple[int, int, int]]) -> None:
    """`_hours` from hour `first` after T0."""
    device = allocation.device
    assert device is not None
    UsageHour.objects.bulk_create(
        UsageHour(
            hour=T0 + (first + n) * HOUR,
            allocation=allocation,
            cluster_id=allocation.cluster_id,
            device_uuid=device.meter_id,
            product_name=device.product_name,
            gpu_share=device.gpu_share,
            namespace=allocation.claim.namespace,
            claim_name=allocation.claim.name,
            team=owner_of(allocation),
            job=allocation.job,
            username=allocation.username,
            allocated_gpu_ms=allocated,
            utilised_gpu_ms=utilised,
            unmeasured_gpu_ms=unmeasured,
        )
        for n, (allocated, utilised, unmeasured) in enumerate(figures)
    )


def test_an_hour_is_a_claims_hour_for_every_reader() -> None:
    """Issue 37: the three readers once summed different rows for the same hour (05:00): the
    alerts a claim's open allocations only, the team page each allocation (device) on its own,
    the week report all the claim's allocations. So `pair` (one device at 0%, one at 100%) was
    an idle holder on the team page and busy for the others, and `swap` (a busy device released
    at 05:30 and an idle one held from then) was alerted and an idle holder but busy in the
    week report. Now every reader judges the claim's whole hour: both are busy, everywhere."""
    team = Team.objects.create(slug="alpha", name="Alpha")
    IdleAlertPolicy.objects.create(team=team, below_percent=Decimal(5), for_hours=1)
    cluster = ClusterFactory.create(name="prod")
    # pair: two devices of one claim, one unused and one busy, in each of six hours.
    unused, busy = claim_holding(cluster, team, "pair", 2, start=T0)
    _hour_rows(unused, 0, [(H, 0, 0)] * 6)
    _hour_rows(busy, 0, [(H, H, 0)] * 6)
    # swap: busy on one device until 05:30, released, then an unused one for the rest of 05:00.
    (released,) = claim_holding(cluster, team, "swap", 1, start=T0)
    Allocation.objects.filter(pk=released.pk).update(end=T0 + 5 * HOUR + timedelta(minutes=30))
    after = AllocationFactory.create(
        claim=released.claim,
        device=DeviceFactory.create(node__cluster=cluster),
        start=T0 + 5 * HOUR + timedelta(minutes=30),
        team=team,
        username=released.username,
        job=released.job,
    )
    _hour_rows(released, 0, [(H, H, 0)] * 5 + [(H // 2, H // 2, 0)])
    _hour_rows(after, 5, [(H // 2, 0, 0)])
    # idle: one device at 1% in every hour, idle by every reader.
    (idle,) = claim_holding(cluster, team, "idle", 1, start=T0)
    _hour_rows(idle, 0, [(H, H // 100, 0)] * 6)
    now = T0 + 6 * HOUR + timedelta(minutes=10)  # rolled up to 06:00: the hour read is 05:00

    alerted = {claim.claim_name for claim in idle_claims(now=now)}
    holders = {
        holder.claim_name: holder for holder in idle_holders(team=team, now=now, below_percent=5)
    }
    week = team_week(team=team, start=T0, now=now, budget=None)
    in_week = {claim.claim_name: claim for claim in week.idle_claims}

    assert alerted == {"idle"}
    assert set(holders) == {"idle"}
    assert set(in_week) == {"idle"}
    # The same claim-hours: idle since 00:00 on the page, six hours long in the week report.
    assert holders["idle"].idle_since == T0 and holders["idle"].devices == [idle.device_name]
    assert in_week["idle"].longest_hours == 6
    # The claim's 05:00, as every reader now sums it.
    swap_hour = UsageHour.objects.filter(allocation__claim=released.claim, hour=T0 + 5 * HOUR)
    assert sorted(swap_hour.values_list("allocated_gpu_ms", "utilised_gpu_ms")) == [
        (H // 2, 0),
        (H // 2, H // 2),
    ]
    assert not idle_hour(H, H // 2, 0, 5)  # the claim's hour: 50% used
    assert idle_hour(H // 2, 0, 0, 5)  # the open allocation's part alone: what alerts read
