"""Reads for the portal's pages. Each takes the user, or a team that came from `visible_team`,
so tenancy is decided once, by `quota.selectors.visible_teams`.

Usage is aggregated in SQL (per day, per model, per claim) and only small rows come back, so
a page costs the same few queries however many hours of usage a team has.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction
from typing import Any

from django.db.models import F, OuterRef, Subquery, Sum
from django.db.models.functions import TruncDate

from billing.models import GPU_HOUR, SLICE_HOUR, Period, Statement, StatementLine, unit_hour
from billing.pricing import RateCards, period_holding, rate_hours, round_money
from billing.selectors import (
    BilledRow,
    IdleHolder,
    billed_usage,
    idle_holders,
    team_gpu_hours,
)
from billing.statement_csv import STATEMENT_CSV_COLUMNS, statement_lines
from billing.units import hours_label, units_label
from inventory.models import Cluster, Unit
from inventory.profiles import unit_label
from inventory.selectors import team_open_allocations
from metering.hours import SHOWN_HOURS, hours_from_ms, idle_expression, idle_of
from metering.models import Sample, UsageHour
from quota.admission.shapes import every_fleet, rule_units
from quota.models import Budget, QuotaRule
from quota.models import Unit as RuleUnit
from teams.models import Alert, AlertState, Team
from teams.selectors import user_role, visible_teams

HOURS = SHOWN_HOURS
# Live claims shown on a team page; a team holding more sees the first ones and the count.
LIVE_CLAIMS_SHOWN = 200
# The firing alerts the team page lists.
ALERTS_SHOWN = 20
TOP_WASTERS_SHOWN = 10


def portal_role(user: Any) -> str | None:
    """`quota.selectors.user_role` (remembered on the user object for the request)."""
    return user_role(user)


def is_operator(user: Any) -> bool:
    return portal_role(user) == "operator"


def fleet_scope() -> Cluster | None:
    """The cluster the fleet pages report on: the only one when there is one (node names
    then need no cluster prefix), else None for all clusters."""
    clusters = list(Cluster.objects.order_by("pk")[:2])
    return clusters[0] if len(clusters) == 1 else None


def visible_team(*, user: Any, slug: str) -> Team | None:
    """The team `slug` if `user` may see it; None otherwise (the page answers 404)."""
    return visible_teams(user=user).filter(slug=slug).first()


def team_list(*, user: Any) -> list[Team]:
    return list(visible_teams(user=user).order_by("name", "slug"))


def usage_window(*, now: datetime, days: int) -> tuple[datetime, datetime]:
    """`[since, now)` where `since` is midnight UTC `days - 1` days before today: `days` UTC
    days, today's so far included."""
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=days - 1), now


def _hours(milliseconds: int | Decimal | None) -> Decimal:
    return hours_from_ms(milliseconds or 0, SHOWN_HOURS, ROUND_HALF_EVEN)


def _hours_of(hours: Fraction) -> Decimal:
    return (Decimal(hours.numerator) / hours.denominator).quantize(HOURS)


def _idle_ms() -> Any:
    return Sum(idle_expression())


@dataclass(frozen=True)
class RuleUsage:
    """One quota rule as the team page shows it."""

    name: str
    device_class: str
    unit: str
    in_use: Decimal
    limit: Decimal
    percent: Decimal | None
    mode: str


def quota_usage(*, team: Team) -> list[RuleUsage]:
    """The team's rules, each limit in the unit of the devices it covers ("TPU chips",
    "Gaudi cards"), as the webhook and `/api/v1/quotas/` state it."""
    rows = []
    rules = list(QuotaRule.objects.filter(team=team).order_by("name"))
    units = rule_units(rules, every_fleet()) if rules else {}
    for rule in rules:
        percent = (rule.in_use * 100 / rule.limit).quantize(Decimal(1)) if rule.limit else None
        rows.append(
            RuleUsage(
                name=rule.name,
                device_class=rule.device_class,
                unit=(
                    rule.get_unit_display()
                    if rule.unit == RuleUnit.MEMORY
                    else unit_label(units[rule.pk])
                ),
                in_use=rule.in_use.normalize(),
                limit=rule.limit.normalize(),
                percent=percent,
                mode=rule.mode,
            )
        )
    return rows


@dataclass(frozen=True)
class DayUsage:
    day: date
    allocated: Decimal
    utilised: Decimal
    idle: Decimal
    unmeasured: Decimal


@dataclass(frozen=True)
class UnitUsage:
    """A window's usage per UTC day in one unit: GPU-hours, TPU chip-hours (never added up)."""

    unit: str
    days: list[DayUsage]

    @property
    def hours(self) -> str:
        """What the figures count: `GPU-hours`, `TPU chip-hours`, `Gaudi card-hours`."""
        return hours_label(self.unit)

    @property
    def allocated(self) -> Decimal:
        return sum((day.allocated for day in self.days), Decimal(0))

    @property
    def utilised(self) -> Decimal:
        return sum((day.utilised for day in self.days), Decimal(0))


def daily_usage_by_unit(*, team: Team, since: datetime, until: datetime) -> list[UnitUsage]:
    """Hours per UTC day in `[since, until)`, one row per day (days without usage too), per
    unit the team used in the window, GPUs first; GPU-hours alone (all zero) when it used
    none. One query."""
    totals: dict[str, dict[date, dict[str, int]]] = defaultdict(dict)
    for row in (
        UsageHour.objects.filter(team=team, hour__gte=since, hour__lt=until)
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        .values("unit", "day")
        .annotate(
            allocated=Sum("allocated_gpu_ms"),
            utilised=Sum("utilised_gpu_ms"),
            unmeasured=Sum("unmeasured_gpu_ms"),
        )
        .order_by()
    ):
        totals[row["unit"]][row["day"]] = row
    units = sorted(totals, key=lambda unit: (unit != Unit.GPU, unit)) or [Unit.GPU]
    return [UnitUsage(unit=unit, days=_days(totals[unit], since, until)) for unit in units]


def daily_usage(
    *, team: Team, since: datetime, until: datetime, unit: str = Unit.GPU
) -> list[DayUsage]:
    """Hours of `unit` (GPU-hours by default) per UTC day in `[since, until)`, one row per
    day (days without usage too)."""
    for usage in daily_usage_by_unit(team=team, since=since, until=until):
        if usage.unit == unit:
            return usage.days
    return _days({}, since, until)


def _days(totals: dict[date, dict[str, int]], since: datetime, until: datetime) -> list[DayUsage]:
    days = []
    day = since.astimezone(UTC).date()
    last_day = (until - timedelta(microseconds=1)).astimezone(UTC).date()
    while day <= last_day:
        row = totals.get(day, {"allocated": 0, "utilised": 0, "unmeasured": 0})
        idle_ms = idle_of(row["allocated"], row["utilised"], row["unmeasured"])
        days.append(
            DayUsage(
                day=day,
                allocated=_hours(row["allocated"]),
                utilised=_hours(row["utilised"]),
                idle=_hours(idle_ms),
                unmeasured=_hours(row["unmeasured"]),
            )
        )
        day += timedelta(days=1)
    return days


@dataclass(frozen=True)
class BurnDay:
    day: date
    used: Decimal | None  # GPU-hours that day; None for days still to come
    remaining: Decimal | None
    ideal: Decimal  # the straight line from the budget to zero at the period's end


@dataclass(frozen=True)
class BudgetBurn:
    """The current period's budget against the GPU-hours used so far."""

    period_start: datetime
    period_end: datetime
    period_label: str  # as the commands name it: 2026-11, 2026-W47
    budget: Decimal
    mode: str
    used: Decimal
    percent: Decimal
    days: list[BurnDay]
    hours: str = "GPU-hours"  # what the budget counts: GPU-hours, TPU chip-hours


def budget_burn(*, team: Team, now: datetime) -> BudgetBurn | None:
    """None when the team has no budget. `used` includes what the allocations have held
    since the hour before the current one (`team_gpu_hours`); the per-day line is the
    rolled-up hours."""
    budget = Budget.objects.filter(team=team).first()
    if budget is None:
        return None
    # The period the webhook counts the budget in; unsaved when not stored yet: reading a
    # page must not create billing periods.
    period = period_holding(now)
    start, end = period.start, period.end
    used = team_gpu_hours(team=team, period=period, now=now, unit=budget.unit)
    per_day = daily_usage(team=team, since=start, until=now, unit=budget.unit)
    period_days = (end - start).days
    days = []
    cumulative = Decimal(0)
    for index in range(period_days):
        day = (start + timedelta(days=index)).date()
        ideal = (budget.gpu_hours * (period_days - index - 1) / period_days).quantize(HOURS)
        if index < len(per_day):
            cumulative += per_day[index].allocated
            days.append(
                BurnDay(day, per_day[index].allocated, budget.gpu_hours - cumulative, ideal)
            )
        else:
            days.append(BurnDay(day, None, None, ideal))
    percent = (
        (used * 100 / budget.gpu_hours).quantize(Decimal(1)) if budget.gpu_hours else Decimal(0)
    )
    return BudgetBurn(
        period_start=start,
        period_end=end,
        period_label=period.label,
        budget=budget.gpu_hours.normalize(),
        mode=budget.mode,
        used=used.quantize(HOURS),
        percent=percent,
        days=days,
        hours=hours_label(budget.unit),
    )


@dataclass
class IdleCost:
    """Idle GPU-hours of one model (or MIG profile) and what they are worth at its rate: per
    GPU-hour, or for a profile's own card per hour of one slice (`idle_rate_hours`: the idle
    time in the rate's `unit`; `gpu_share`: the slice's share of its GPU, None when priced per
    GPU-hour or when the profile's devices report different shares)."""

    product_name: str
    profile: str
    idle: Decimal
    rate: Decimal | None
    currency: str
    cost: Decimal | None
    unit: str = GPU_HOUR
    idle_rate_hours: Decimal | None = None
    gpu_share: Decimal | None = None
    hours: str = "GPU-hours"  # what `idle` counts: GPU-hours, TPU chip-hours, Gaudi card-hours

    @property
    def rate_per(self) -> str:
        """The rate's unit, short: `slice-h`, `GPU-h`, `TPU chip-h`."""
        return "slice-h" if self.unit == SLICE_HOUR else self.unit.removesuffix("our")


@dataclass
class IdleSummary:
    rows: list[IdleCost] = field(default_factory=list)
    total_hours: Decimal = Decimal(0)
    # currency -> cost; models without a rate card are left out of the totals.
    totals: dict[str, Decimal] = field(default_factory=dict)
    # What the window's hours count, as one label: `GPU-hours`, or `GPU-hours + TPU
    # chip-hours` where a total adds hours of several units (the page says so).
    hours: str = "GPU-hours"


def idle_cost(
    *, team: Team, since: datetime, until: datetime, cards: RateCards | None = None
) -> IdleSummary:
    """Idle GPU-hours per model in `[since, until)`, priced at each model's rate card of the
    last day of the window, at list price (idle hours x rate: what the unused allocation
    would be worth without the card's idle discount, which statements apply: the page shows
    it as context beside the idle cost billed, `team_billing`). A MIG profile's own card
    prices the idle hours of its slices, a GPU's card GPU-hours. `cards`: rate cards already
    read for a window that holds its last day."""
    summary = IdleSummary()
    totals: dict[str, Decimal] = defaultdict(Decimal)
    on = (until - timedelta(microseconds=1)).astimezone(UTC).date()
    cards = cards or RateCards(first_day=on, last_day=on)
    idle_ms: dict[tuple[str, str], int] = defaultdict(int)
    units: dict[tuple[str, str], str] = {}
    # Idle time in slice-hours, exact, for a MIG profile's own card: per device share.
    idle_slice_hours: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
    shares: dict[tuple[str, str], set[Decimal]] = defaultdict(set)
    for row in (
        UsageHour.objects.filter(team=team, hour__gte=since, hour__lt=until)
        .values("product_name", "profile", "unit", device_share=F("allocation__device_share"))
        .annotate(idle_ms=_idle_ms())
        .order_by()
    ):
        model = (row["product_name"], row["profile"])
        idle_ms[model] += row["idle_ms"]
        units[model] = row["unit"]
        if row["profile"]:
            idle_slice_hours[model] += rate_hours(row["idle_ms"], row["device_share"])
            shares[model].add(row["device_share"])
    for (product_name, profile), milliseconds in sorted(idle_ms.items()):
        idle = _hours(milliseconds)
        card = cards.on(product_name, profile, on)
        unit = units[product_name, profile]
        entry = IdleCost(
            product_name, profile, idle, rate=None, currency="", cost=None, hours=hours_label(unit)
        )
        if card is not None:
            entry.rate, entry.currency = card.per_gpu_hour, card.currency
            entry.unit = SLICE_HOUR if card.rate_unit == SLICE_HOUR else unit_hour(unit)
            entry.idle_rate_hours = (
                _hours_of(idle_slice_hours[product_name, profile])
                if entry.unit == SLICE_HOUR
                else idle
            )
            model_shares = shares[product_name, profile]
            if entry.unit == SLICE_HOUR and len(model_shares) == 1:
                entry.gpu_share = model_shares.pop().normalize()
            entry.cost = round_money(entry.idle_rate_hours * card.per_gpu_hour, card.currency)
            totals[card.currency] += entry.cost
        summary.rows.append(entry)
        summary.total_hours += idle
    summary.totals = dict(sorted(totals.items()))
    summary.hours = units_label(list(units.values()))
    return summary


@dataclass
class TeamBilling:
    """A window's hours per person and per job, with what the statements bill for them
    (`billing.selectors.billed_usage`), and the totals per currency the page states."""

    since: datetime
    until: datetime
    people: list[BilledRow]
    jobs: list[BilledRow]
    cards: RateCards
    billed: dict[str, Decimal] = field(default_factory=dict)  # currency -> billed
    billed_idle: dict[str, Decimal] = field(default_factory=dict)  # of which for idle hours


def team_billing(*, team: Team, since: datetime, until: datetime) -> TeamBilling:
    """The team's billed usage in `[since, until)` per person and per job. Three queries."""
    first_day = since.astimezone(UTC).date()
    last_day = (until - timedelta(microseconds=1)).astimezone(UTC).date()
    cards = RateCards(first_day=first_day, last_day=last_day)
    usage = billed_usage(teams=[team], since=since, until=until, cards=cards)
    billing = TeamBilling(since, until, usage.people, usage.jobs, cards)
    for row in usage.people:
        if row.billed is not None and row.billed_idle is not None:
            billing.billed[row.currency] = billing.billed.get(row.currency, Decimal(0)) + row.billed
            billing.billed_idle[row.currency] = (
                billing.billed_idle.get(row.currency, Decimal(0)) + row.billed_idle
            )
    billing.billed = dict(sorted(billing.billed.items()))
    billing.billed_idle = dict(sorted(billing.billed_idle.items()))
    return billing


def firing_alerts(*, team: Team, limit: int = ALERTS_SHOWN) -> tuple[list[Alert], int]:
    """The team's firing alerts, the most recently seen first, and how many there are (the API,
    `/api/v1/alerts/`, lists them all, resolved ones too)."""
    firing = Alert.objects.filter(team=team, state=AlertState.FIRING)
    shown = list(firing.order_by("-last_seen", "-pk")[:limit])
    return shown, firing.count() if len(shown) == limit else len(shown)


def idle_now(*, team: Team, now: datetime, below_percent: Decimal | int) -> list[IdleHolder]:
    """Who holds idle devices of the team now (`billing.selectors.idle_holders`)."""
    return idle_holders(team=team, now=now, below_percent=below_percent)


@dataclass(frozen=True)
class Waster:
    namespace: str
    claim_name: str
    owner: str
    allocated: Decimal
    idle: Decimal
    unit: str = Unit.GPU

    @property
    def hours(self) -> str:
        """What the figures count: `GPU-hours`, `TPU chip-hours`."""
        return hours_label(self.unit)


def top_wasters(
    *, team: Team, since: datetime, until: datetime, limit: int = TOP_WASTERS_SHOWN
) -> list[Waster]:
    """The claims with the most idle hours in the window (each in its unit's hours); owner is
    the user, else the job."""
    rows = (
        UsageHour.objects.filter(team=team, hour__gte=since, hour__lt=until)
        .values("namespace", "claim_name", "username", "job", "unit")
        .annotate(idle_ms=_idle_ms(), allocated_ms=Sum("allocated_gpu_ms"))
        .filter(idle_ms__gt=0)
        .order_by("-idle_ms", "namespace", "claim_name")[:limit]
    )
    return [
        Waster(
            namespace=row["namespace"],
            claim_name=row["claim_name"],
            owner=row["username"] or row["job"],
            allocated=_hours(row["allocated_ms"]),
            idle=_hours(row["idle_ms"]),
            unit=row["unit"],
        )
        for row in rows
    ]


@dataclass(frozen=True)
class LiveClaim:
    namespace: str
    claim_name: str
    device: str
    product_name: str
    node: str
    since: datetime
    gpu_util: float | None
    sampled_at: datetime | None
    cluster: str = ""


def live_claims(
    *, team: Team, limit: int = LIVE_CLAIMS_SHOWN, cluster: Cluster | None = None
) -> tuple[list[LiveClaim], int]:
    """Open allocations of claims in the team's namespaces (of `cluster`, when given), with
    the device's node and its latest utilisation sample and the claim's cluster; and how many
    there are in all."""
    latest = Sample.objects.filter(device_uuid=OuterRef("device__meter_id")).order_by("-ts_ms")
    allocations = (
        team_open_allocations(team)
        .filter(**({} if cluster is None else {"cluster": cluster}))
        .annotate(
            gpu_util=Subquery(latest.values("gpu_util")[:1]),
            sampled_ms=Subquery(latest.values("ts_ms")[:1]),
        )
        .values(
            "claim__namespace",
            "claim__name",
            "device_name",
            "device__product_name",
            "device__profile",
            "device__node__name",
            "start",
            "gpu_util",
            "sampled_ms",
            "cluster__name",
        )
        .order_by("claim__namespace", "claim__name", "cluster__name", "device_name")
    )
    total = allocations.count()
    claims = [
        LiveClaim(
            namespace=row["claim__namespace"],
            claim_name=row["claim__name"],
            device=row["device_name"],
            product_name=" ".join(
                part for part in (row["device__product_name"], row["device__profile"]) if part
            ),
            node=row["device__node__name"] or "",
            since=row["start"],
            gpu_util=row["gpu_util"],
            sampled_at=(
                datetime.fromtimestamp(row["sampled_ms"] / 1000, tz=UTC)
                if row["sampled_ms"] is not None
                else None
            ),
            cluster=row["cluster__name"],
        )
        for row in allocations[:limit]
    ]
    return claims, total


def team_statements(*, team: Team) -> list[Statement]:
    """The team's statements, newest first; totals to the currency's minor unit (they are
    stored to the thousandth, which only some currencies use)."""
    statements = list(
        Statement.objects.filter(team=team)
        .select_related("period")
        .order_by("-period__start", "currency")
    )
    for statement in statements:
        statement.total = round_money(statement.total, statement.currency)
    return statements


# The statement CSV's columns: the API's too (`billing.statement_csv`).
CSV_COLUMNS = STATEMENT_CSV_COLUMNS


def statement_csv_lines(*, team: Team, period_id: int) -> tuple[Period, list[StatementLine]] | None:
    """The period and the lines (`billing.statement_csv.statement_lines`) of the team's
    statements for it; None when the team has no statement for that period."""
    lines = list(
        statement_lines(
            StatementLine.objects.filter(statement__team=team, statement__period_id=period_id)
        )
    )
    if not lines:
        period = Period.objects.filter(pk=period_id, statements__team=team).first()
        return (period, []) if period is not None else None
    return lines[0].statement.period, lines
