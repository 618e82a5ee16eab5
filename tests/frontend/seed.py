"""A realistic portal: a simulated fleet, two teams with the standard cast of users, rules, a
budget, 30 days of usage, utilisation samples, a closed period with statements, decisions.

Usage rows are written directly (not rolled up from samples) so that every figure the pages
show is known: `Portal.daily` holds the GPU-hours per UTC day that the seed wrote for team A.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.contrib.auth.models import Group, User
from django.utils import timezone

from billing import periods, pricing, services
from billing.models import Period, RateCard
from inventory import services as inventory_services
from inventory import simulate
from inventory.models import Allocation, Cluster, Device, VersionBaseline
from metering import ingest
from metering.models import Sample, UsageHour
from quota.admission.shapes import forget_fleet_shapes
from quota.models import AdmissionDecision, Budget, QuotaRule
from teams.models import Membership, Role, Team, TeamNamespace
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP

HOUR_MS = 3_600_000
PASSWORD = "correct-horse-battery"
OUTLIER_NODE = "gpu-a100-00003"
OUTLIER_DRIVER = ("570.172.8", "12.8.0")
RATES = {
    "NVIDIA H200": Decimal("3.50"),
    "NVIDIA H100 80GB HBM3": Decimal("2.80"),
    "NVIDIA A100-SXM4-80GB": Decimal("1.60"),
}
DECISIONS = 60


@dataclass
class Portal:
    now: datetime
    cluster: Cluster
    team_a: Team
    team_b: Team
    users: dict[str, User]
    closed_period: Period
    # Team A's GPU-hours per UTC day: (allocated, utilised), as the seed wrote them.
    daily: dict[date, tuple[Decimal, Decimal]] = field(default_factory=dict)
    live_devices: int = 0


def _user(username: str, *, group: str | None = None, password: bool = False) -> User:
    user = User.objects.create_user(username=username, password=PASSWORD if password else None)
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


def _team(slug: str, name: str, namespaces: list[str]) -> Team:
    team = Team.objects.create(slug=slug, name=name, cost_centre=f"CC-{slug.upper()}")
    TeamNamespace.objects.bulk_create(
        TeamNamespace(team=team, namespace=namespace) for namespace in namespaces
    )
    return team


def _open_allocations(namespaces: list[str]) -> list[Allocation]:
    return list(
        Allocation.objects.filter(
            end__isnull=True, claim__namespace__in=namespaces, device__isnull=False
        )
        .exclude(device__uuid="")
        .select_related("claim", "device")
        .order_by("pk")
    )


def _one_per_model(allocations: list[Allocation]) -> list[Allocation]:
    """The first allocation of each GPU model, so usage spans several rate cards."""
    chosen: dict[str, Allocation] = {}
    for allocation in allocations:
        assert allocation.device is not None
        chosen.setdefault(allocation.device.product_name, allocation)
    return list(chosen.values())


def _usage_rows(
    team: Team, allocations: list[Allocation], hours: list[datetime], usernames: list[str]
) -> list[UsageHour]:
    """Per hour and allocation, an amount that varies by day and allocation; the first
    allocation idles most, so it tops the list of wasters."""
    rows = []
    for hour in hours:
        for index, allocation in enumerate(allocations):
            device = allocation.device
            assert device is not None
            allocated = HOUR_MS * (4 + hour.day % 3 + index)
            utilised = allocated * (index + 1) // (index + 5)
            unmeasured = HOUR_MS // 4 if index == 1 else 0
            rows.append(
                UsageHour(
                    hour=hour + timedelta(hours=index),
                    allocation=allocation,
                    cluster_id=allocation.cluster_id,
                    device_uuid=device.uuid,
                    product_name=device.product_name,
                    profile=device.profile,
                    gpu_share=device.gpu_share,
                    namespace=allocation.claim.namespace,
                    claim_name=allocation.claim.name,
                    team=team,
                    job=f"Pod/{allocation.claim.owner_references[0]['name']}",
                    username=usernames[index % len(usernames)],
                    allocated_gpu_ms=allocated,
                    utilised_gpu_ms=utilised,
                    unmeasured_gpu_ms=unmeasured,
                )
            )
    return rows


def seed_portal(now: datetime | None = None) -> Portal:
    now = now or timezone.now()
    forget_fleet_shapes()
    cluster = inventory_services.get_cluster("default")
    report = inventory_services.import_snapshot(
        cluster=cluster,
        objects=simulate.generate(nodes=4, seed=1, now=now - timedelta(days=35)),
        at=now - timedelta(days=35),
    )
    assert not report.errors, report.errors
    # One node lags behind on its driver, as after a half-finished upgrade. It is the only
    # A100 node, so a baseline computed per model would take its pair: operators validated one
    # pair for the whole cluster (the one its other nodes run), and it strays from that.
    VersionBaseline.objects.create(
        cluster=cluster,
        driver_version=simulate.BASELINE_DRIVER[0],
        cuda_driver_version=simulate.BASELINE_DRIVER[1],
    )
    Device.objects.filter(node__name=OUTLIER_NODE).update(
        driver_version=OUTLIER_DRIVER[0], cuda_driver_version=OUTLIER_DRIVER[1]
    )

    team_a = _team("vision", "Vision", ["vision", "research"])
    team_b = _team("nlp", "Natural Language", ["nlp"])
    users = {
        "lead_a": _user("lead_a", password=True),
        "member_a": _user("member_a"),
        "lead_b": _user("lead_b"),
        "finance": _user("finance", group=FINANCE_GROUP),
        "operator": _user("operator", group=OPERATORS_GROUP, password=True),
    }
    Membership.objects.create(team=team_a, user=users["lead_a"], role=Role.LEAD)
    Membership.objects.create(team=team_a, user=users["member_a"], role=Role.MEMBER)
    Membership.objects.create(team=team_b, user=users["lead_b"], role=Role.LEAD)
    QuotaRule.objects.create(
        team=team_a, name="gpus", device_class="gpu.nvidia.com", limit=16, in_use=6
    )
    QuotaRule.objects.create(
        team=team_a,
        name="mig",
        device_class="mig.nvidia.com",
        limit=4,
        in_use=Decimal("3.5"),
        mode="warn",
    )
    QuotaRule.objects.create(team=team_b, name="gpus", device_class="gpu.nvidia.com", limit=8)
    Budget.objects.create(team=team_a, gpu_hours=Decimal(2000), mode="soft")
    for product, rate in RATES.items():
        RateCard.objects.create(
            product_name=product,
            per_gpu_hour=rate,
            idle_factor=Decimal("0.5"),
            currency="USD",
            valid_from=date(2020, 1, 1),
        )

    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    period_start, _ = periods.period_bounds(now)
    previous_start, _ = periods.period_bounds(period_start - timedelta(days=1))
    # The 29 days before today, and one day mid-way through last month so that the closed
    # period always has usage whatever today's date.
    hours = sorted(
        {today - timedelta(days=n) for n in range(1, 30)}
        | {previous_start + timedelta(days=14, hours=12)}
    )
    allocations_a = _one_per_model(_open_allocations(["vision", "research"]))
    allocations_b = _one_per_model(_open_allocations(["nlp"]))
    assert len(allocations_a) == 3 and allocations_b, "the simulated fleet changed"
    rows_a = _usage_rows(team_a, allocations_a, hours, ["ana", "ben"])
    UsageHour.objects.bulk_create(rows_a)
    UsageHour.objects.bulk_create(_usage_rows(team_b, allocations_b, hours, ["nora"]))

    daily: dict[date, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows_a:
        daily[row.hour.date()][0] += row.allocated_gpu_ms
        daily[row.hour.date()][1] += row.utilised_gpu_ms

    closed_period = pricing.period_for(previous_start)
    services.close_period(period=closed_period, actor="finance")
    pricing.refresh_statements(period=pricing.period_for(now))

    live = _open_allocations(["vision", "research"])
    Sample.objects.bulk_create(
        Sample(
            device_uuid=allocation.device.uuid,
            ts_ms=int((now - timedelta(minutes=minutes)).timestamp() * 1000),
            gpu_util=util,
            node=allocation.device.node.name if allocation.device.node else "",
            received_at=now,
        )
        for index, allocation in enumerate(live)
        if allocation.device is not None
        # An older busy reading, then the current one: the page shows the latest.
        for minutes, util in ((10, 99.0), (1, float(10 + 7 * index % 90)))
    )
    ingest.fill_gaps(allocation.device.uuid for allocation in live if allocation.device)
    AdmissionDecision.objects.bulk_create(
        AdmissionDecision(
            at=now - timedelta(minutes=n),
            uid=f"uid-{n}",
            namespace="vision" if n % 2 else "nlp",
            name=f"train-{n}-gpu",
            username="ana",
            team=team_a if n % 2 else team_b,
            allowed=n % 3 != 0,
            message="" if n % 3 else "quota gpus exceeded: 17 > 16 GPU-equivalents",
        )
        for n in range(DECISIONS)
    )
    return Portal(
        now=now,
        cluster=cluster,
        team_a=team_a,
        team_b=team_b,
        users=users,
        closed_period=closed_period,
        daily={
            day: (Decimal(allocated) / HOUR_MS, Decimal(utilised) / HOUR_MS)
            for day, (allocated, utilised) in daily.items()
        },
        live_devices=Allocation.objects.filter(
            end__isnull=True, claim__namespace__in=["vision", "research"]
        ).count(),
    )
