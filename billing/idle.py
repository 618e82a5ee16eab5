"""Idle claims: claims holding devices they barely use, by their team's idle-alert policy.

A team's policy (`teams.models.IdleAlertPolicy`, the policy file's `idleAlert`) says a claim is
idle when in each of the last `for_hours` hours it used less than `below_percent` of what it
held; a team whose policy says nothing has the default rule (TALLY_IDLE_ALERT_DEFAULT_*), one
whose policy says `idleAlert: off` none (`idle_policies`, `idle_policy_of`). The figures are
the ledger's (`UsageHour`, per allocation and hour), summed per claim and hour; a claim is
alerted only while it holds devices (an open allocation).

One rule says what an idle hour is, everywhere Tally names idle claims (the alerts, the team
page's idle holders, the week report's longest idle claims): it is an hour of a claim, the
claim as a whole: the team's usage rows of that hour for every allocation of the claim (open,
or released since) added up (`claim_hours`), judged by `idle_hour` (`idle_hour_q` in SQL) at
the team's `below_percent` (`below_percent_of`; the default's without a policy). Unmeasured
time counts as busy (an hour no sample covers is not known to be idle), so an hour is idle
when utilised + unmeasured < below_percent of allocated; and an hour the rollup has no row for
(not yet rolled up, or the claim did not hold it) is not idle either. A claim holding one idle
device and one busy one is busy while the sum is; a device of it is never idle on its own.
The alerts read the hours up to the last one rolled up, so an evaluation running before the
rollup of the hour just ended sees the same claims idle as the one after it.

`IdleCollector` gives Prometheus the idle unit-hours per team over the last rolled-up day.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import F, Max, Q, QuerySet, Sum
from django.db.models.lookups import GreaterThan, LessThan
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inventory.models import Allocation, ResourceClaim
from metering.hours import HOUR, MS_PER_HOUR, hour_start, hours_from_ms, idle_of
from metering.models import UsageHour
from teams.models import IdleAlertPolicy, Team

HUNDREDTH = Decimal("0.01")  # of a percent
# The window of `tally_idle_unit_hours`.
METRIC_HOURS = 24


@dataclass(frozen=True)
class IdleClaim:
    """A claim idle by its team's policy over [`since`, `until`)."""

    team: Team
    policy: IdleAlertPolicy
    cluster: str
    namespace: str
    claim_name: str
    claim_uid: str
    # Who is charged for its open allocations (fixed when each started), else its creator.
    usernames: tuple[str, ...]
    job: str
    unit: str  # what it holds: gpu, tpu, ...; "accelerator" when its devices mix
    units_held: Decimal  # the open allocations' shares of their unit
    # The model, profile and device share of its devices when they are all alike (what a
    # rate card prices), else "", "" and None.
    product_name: str
    profile: str
    device_share: Decimal | None
    since: datetime
    until: datetime
    allocated_ms: int
    utilised_ms: int
    unmeasured_ms: int

    @property
    def key(self) -> str:
        """Stable for the claim's life: its uid never changes, nor its name and namespace."""
        return f"{self.cluster}/{self.namespace}/{self.claim_name}/{self.claim_uid}"

    @property
    def utilised_percent(self) -> Decimal:
        if not self.allocated_ms:
            return Decimal(0)
        share = Decimal(self.utilised_ms * 100) / self.allocated_ms
        return share.quantize(HUNDREDTH, ROUND_HALF_UP)

    @property
    def idle_ms(self) -> int:
        return idle_of(self.allocated_ms, self.utilised_ms, self.unmeasured_ms)

    @property
    def idle_unit_hours(self) -> Decimal:
        return hours_from_ms(self.idle_ms)


def rolled_up_until(now: datetime) -> datetime | None:
    """The end of the last hour before `now`'s that the rollup has rows for; None: none."""
    last = UsageHour.objects.filter(hour__lt=hour_start(now)).aggregate(last=Max("hour"))["last"]
    return None if last is None else last + HOUR


def idle_claims(*, now: datetime) -> list[IdleClaim]:
    """The claims idle now by their team's policy, by team, namespace and name. Four queries,
    whatever the number of claims."""
    policies = {policy.team_id: policy for policy in idle_policies()}
    until = rolled_up_until(now)
    if not policies or until is None:
        return []
    longest = max(policy.for_hours for policy in policies.values())
    hours: dict[tuple[int, int], dict[datetime, tuple[int, int, int]]] = defaultdict(dict)
    held_now = Allocation.objects.filter(end__isnull=True).values("claim_id")
    for row in claim_hours(
        UsageHour.objects.filter(
            hour__gte=until - timedelta(hours=longest),
            hour__lt=until,
            team_id__in=policies,
            allocation__claim_id__in=held_now,
        ),
        "team_id",
    ):
        assert row["team_id"] is not None
        hours[(row["team_id"], row["allocation__claim_id"])][row["hour"]] = (
            row["allocated"],
            row["utilised"],
            row["unmeasured"],
        )
    idle: dict[int, tuple[IdleAlertPolicy, datetime, tuple[int, int, int]]] = {}
    for (team_id, claim_id), by_hour in hours.items():
        policy = policies[team_id]
        since = until - timedelta(hours=policy.for_hours)
        window = [by_hour.get(since + HOUR * index) for index in range(policy.for_hours)]
        if all(
            figures is not None and idle_hour(*figures, policy.below_percent) for figures in window
        ):
            figures_held = [figures for figures in window if figures is not None]
            idle[claim_id] = (
                policy,
                since,
                (
                    sum(figures[0] for figures in figures_held),
                    sum(figures[1] for figures in figures_held),
                    sum(figures[2] for figures in figures_held),
                ),
            )
    if not idle:
        return []
    claims = {
        claim.pk: claim
        for claim in ResourceClaim.objects.filter(pk__in=idle).select_related("cluster")
    }
    held: dict[int, list[Allocation]] = defaultdict(list)
    for allocation in Allocation.objects.filter(claim_id__in=idle, end__isnull=True).only(
        "claim_id",
        "username",
        "job",
        "unit",
        "gpu_share",
        "product_name",
        "profile",
        "device_share",
    ):
        held[allocation.claim_id].append(allocation)
    found = []
    for claim_id, (policy, since, (allocated, utilised, unmeasured)) in idle.items():
        claim = claims[claim_id]
        allocations = held[claim_id]
        usernames = sorted({a.username for a in allocations if a.username})
        if not usernames and claim.created_by:
            usernames = [claim.created_by]
        units = {a.unit for a in allocations if a.unit}
        kinds = {(a.product_name, a.profile, a.device_share) for a in allocations}
        product_name, profile, device_share = kinds.pop() if len(kinds) == 1 else ("", "", None)
        found.append(
            IdleClaim(
                team=policy.team,
                policy=policy,
                cluster=claim.cluster.name,
                namespace=claim.namespace,
                claim_name=claim.name,
                claim_uid=claim.uid,
                usernames=tuple(usernames),
                job=next((a.job for a in allocations if a.job), claim.job),
                unit=units.pop() if len(units) == 1 else ("accelerator" if units else ""),
                units_held=sum((a.gpu_share for a in allocations), Decimal(0)),
                product_name=product_name,
                profile=profile,
                device_share=device_share,
                since=since,
                until=until,
                allocated_ms=allocated,
                utilised_ms=utilised,
                unmeasured_ms=unmeasured,
            )
        )
    found.sort(key=lambda c: (c.team.slug, c.cluster, c.namespace, c.claim_name))
    return found


def idle_hour(allocated: int, utilised: int, unmeasured: int, below_percent: Decimal | int) -> bool:
    """Whether an hour's figures (milliseconds of a claim's or an allocation's hour) are idle:
    used (or unmeasured) less than `below_percent` of the time held; an hour held not at all
    is not idle."""
    return allocated > 0 and (utilised + unmeasured) * 100 < below_percent * allocated


def idle_hour_q(
    below_percent: Decimal | int,
    allocated: str = "allocated_gpu_ms",
    utilised: str = "utilised_gpu_ms",
    unmeasured: str = "unmeasured_gpu_ms",
) -> Q:
    """`idle_hour` over a `UsageHour` row, for a query; or over the named annotations (a
    claim's hour from `claim_hours`: then a HAVING condition)."""
    return Q(GreaterThan(F(allocated), 0)) & Q(
        LessThan((F(utilised) + F(unmeasured)) * 100, F(allocated) * below_percent)
    )


def claim_hours(rows: QuerySet[UsageHour], *by: str) -> QuerySet[UsageHour, dict[str, Any]]:
    """`rows` added up per claim and hour (and the fields `by`): the hours the idle rule
    judges, as dicts with `allocation__claim_id`, `hour`, `by`'s fields and the claim's
    `allocated`, `utilised` and `unmeasured` milliseconds (`idle_hour`, or `idle_hour_q` with
    those names)."""
    return rows.values(*by, "allocation__claim_id", "hour").annotate(**CLAIM_HOUR_SUMS)


CLAIM_HOUR_SUMS: dict[str, Any] = {
    "allocated": Sum("allocated_gpu_ms"),
    "utilised": Sum("utilised_gpu_ms"),
    "unmeasured": Sum("unmeasured_gpu_ms"),
}


def default_policy(team: Team) -> IdleAlertPolicy | None:
    """The rule of a team whose policy has no `idleAlert` (unsaved: nothing is written for
    it), from TALLY_IDLE_ALERT_DEFAULT_*; None where the default is off (hours 0)."""
    hours = settings.TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS
    if not hours:
        return None
    below = Decimal(settings.TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT)
    return IdleAlertPolicy(team=team, team_id=team.pk, below_percent=below, for_hours=hours)


def _in_force(team: Team) -> IdleAlertPolicy | None:
    """`team`'s own policy, or the default; None: off. Reads the team's cached policy."""
    try:
        policy: IdleAlertPolicy = team.idle_alert_policy
    except ObjectDoesNotExist:
        return default_policy(team)
    return policy if policy.enabled else None


def idle_policies() -> list[IdleAlertPolicy]:
    """The idle-alert rule in force of every team alerted: its own, or the default where its
    policy says nothing; none for a team whose policy says `idleAlert: off`. One query."""
    teams = Team.objects.select_related("idle_alert_policy").order_by("slug")
    return [policy for team in teams if (policy := _in_force(team)) is not None]


def idle_policy_of(team: Team) -> IdleAlertPolicy | None:
    """`team`'s idle-alert rule in force (see `idle_policies`); None: alerts are off."""
    return _in_force(team)


def below_percent_of(team: Team) -> Decimal | int:
    """The percent under which `team`'s hours are idle: its idle-alert policy's
    (`idleAlert.belowPercent`, kept when it is off), else the default's."""
    policy = IdleAlertPolicy.objects.filter(team=team).values_list("below_percent", flat=True)
    return next(iter(policy), settings.TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT)


class IdleCollector(Collector):
    """`tally_idle_unit_hours` by team and unit: allocated less utilised and unmeasured time
    over the last METRIC_HOURS rolled-up hours, from the database at scrape time (see
    `core.metrics`); one aggregate query over those hours' rows."""

    def __init__(self, clock: Callable[[], datetime] = timezone.now) -> None:
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tally_idle_unit_hours",
            f"Idle unit-hours (GPU-hours for GPUs: held, measured, not used) over the last "
            f"{METRIC_HOURS} rolled-up hours, by team ('' for none) and unit.",
            labels=["team", "unit"],
        )
        until = rolled_up_until(self.clock())
        if until is not None:
            slugs = dict(Team.objects.values_list("pk", "slug"))
            rows = (
                UsageHour.objects.filter(
                    hour__gte=until - timedelta(hours=METRIC_HOURS), hour__lt=until
                )
                .values("team_id", "unit")
                .annotate(
                    allocated=Sum("allocated_gpu_ms"),
                    utilised=Sum("utilised_gpu_ms"),
                    unmeasured=Sum("unmeasured_gpu_ms"),
                )
                .order_by("team_id", "unit")
            )
            for row in rows:
                idle = idle_of(row["allocated"], row["utilised"], row["unmeasured"])
                team = slugs.get(row["team_id"], "") if row["team_id"] is not None else ""
                family.add_metric([team, row["unit"]], idle / MS_PER_HOUR)
        yield family
