"""The standard cast of users for API tenancy tests, and a small seeded dataset.

Team alpha has a lead and a member; team beta a lead; finance and operators are groups.
`seeded` adds to it what every endpoint shows: namespaces and rules, a rate card, hourly
usage of both teams last month, that period's statements (by `billing.pricing`) with an
adjustment, a current open period, admission decisions and a small fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from rest_framework.test import APIClient

from billing import pricing, services
from billing.models import Period, RateCard
from inventory.models import Allocation
from metering.hours import MS_PER_HOUR
from metering.models import UsageHour
from quota.models import AdmissionDecision, QuotaRule
from teams.models import Membership, Role, Team, TeamNamespace
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP
from tests.factories import AllocationFactory, ClusterFactory, DeviceFactory, ResourceClaimFactory
from tests.quota.factories import UserFactory

H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class Cast:
    alpha: Team
    beta: Team
    lead_a: User
    member_a: User
    lead_b: User
    finance: User
    operator: User

    def client(self, who: str | None) -> APIClient:
        """A client logged in as `who` (a field name), or anonymous for None."""
        client = APIClient()
        if who is not None:
            client.force_authenticate(getattr(self, who))
        return client


@dataclass
class Seeded:
    cast: Cast
    last: Period  # ended, still open
    current: Period  # not ended
    closed: Period  # closed two months ago


@pytest.fixture
def cast(db: None) -> Cast:
    alpha = Team.objects.create(slug="alpha", name="Alpha", cost_centre="CC-1")
    beta = Team.objects.create(slug="beta", name="Beta", cost_centre="CC-2")
    lead_a, member_a, lead_b = (UserFactory.create(username=name) for name in ("la", "ma", "lb"))
    Membership.objects.create(team=alpha, user=lead_a, role=Role.LEAD)
    Membership.objects.create(team=alpha, user=member_a, role=Role.MEMBER)
    Membership.objects.create(team=beta, user=lead_b, role=Role.LEAD)
    finance = UserFactory.create(username="fin")
    finance.groups.add(Group.objects.create(name=FINANCE_GROUP))
    operator = UserFactory.create(username="ops")
    operator.groups.add(Group.objects.create(name=OPERATORS_GROUP))
    return Cast(alpha, beta, lead_a, member_a, lead_b, finance, operator)


def usage_hour(allocation: Allocation, team: Team, hour: datetime, **ms: int) -> UsageHour:
    return UsageHour.objects.create(
        hour=hour,
        allocation=allocation,
        cluster=allocation.cluster,
        device_uuid=allocation.device.uuid if allocation.device else "",
        product_name=H100,
        gpu_share=Decimal(1),
        namespace=allocation.claim.namespace,
        claim_name=allocation.claim.name,
        team=team,
        job=f"Job/{allocation.claim.name}",
        username=f"{team.slug}-user",
        allocated_gpu_ms=ms.get("allocated", MS_PER_HOUR),
        utilised_gpu_ms=ms.get("utilised", MS_PER_HOUR // 2),
        unmeasured_gpu_ms=ms.get("unmeasured", 0),
    )


def seed_usage(team: Team, namespace: str, start: datetime, hours: int) -> None:
    cluster = ClusterFactory.create(name="cluster-0")
    claim = ResourceClaimFactory.create(cluster=cluster, namespace=namespace)
    allocation = AllocationFactory.create(
        claim=claim, device=DeviceFactory.create(node__cluster=cluster), start=start
    )
    for offset in range(hours):
        usage_hour(allocation, team, start + timedelta(hours=offset))


@pytest.fixture
def seeded(cast: Cast) -> Seeded:
    for team in (cast.alpha, cast.beta):
        TeamNamespace.objects.create(team=team, namespace=f"{team.slug}-ns")
    QuotaRule.objects.create(
        team=cast.alpha, name="gpus", device_class="gpu.nvidia.com", limit=8, in_use=2
    )
    QuotaRule.objects.create(team=cast.beta, name="none", device_class="gpu.nvidia.com", limit=0)
    RateCard.objects.create(
        product_name=H100,
        per_gpu_hour=Decimal("2.5000"),
        idle_factor=Decimal("0.5"),
        currency="EUR",
        valid_from=datetime(2020, 1, 1).date(),
    )
    now = timezone.now()
    current = pricing.period_for(now)
    last = pricing.period_for(current.start - timedelta(days=1))
    closed = pricing.period_for(last.start - timedelta(days=1))
    Period.objects.filter(pk=closed.pk).update(closed_at=last.start, closed_by="fin")
    closed.refresh_from_db()
    seed_usage(cast.alpha, "alpha-ns", last.start + timedelta(days=2), hours=3)
    seed_usage(cast.beta, "beta-ns", last.start + timedelta(days=3), hours=1)
    pricing.refresh_statements(period=last)
    services.add_adjustment(
        team=cast.beta,
        period=last,
        currency="EUR",
        amount=Decimal("-5"),
        reason="goodwill",
        actor="fin",
    )
    decided: list[tuple[Team | None, bool]] = [(cast.alpha, True), (cast.beta, False), (None, True)]
    for owner, allowed in decided:
        AdmissionDecision.objects.create(
            at=now,
            uid=f"uid-{owner}",
            namespace=f"{owner}-ns",
            name="claim",
            team=owner,
            allowed=allowed,
            message="" if allowed else "over quota",
        )
    return Seeded(cast=cast, last=last, current=current, closed=closed)
