"""A team's week and the fleet's week: what the week report (page, CSV, email) and the
operators' node x hour heatmap show.

A week is seven days from 00:00 UTC of its first day, `[start, start + 7 days)`; by default
the last complete ISO week (Monday to Monday). Every figure comes from the rolled-up
`UsageHour` rows: allocated time from allocations, split by samples into utilised, idle and
unmeasured. Costs are billed costs, priced as statements price them (`billing.pricing`: the
rate card of each day, idle time at its idle factor, a MIG profile's own card per slice-hour),
exact until rounded once per statement line; the people's and jobs' costs are each line's
amount shared out to the cent (`billing.selectors.billed_usage`, largest remainders), so they
add up to the week's total exactly and a job's cost is what `billed/jobs` shows.

Hours of different units (GPU-hours, TPU chip-hours) are never added: rows are per unit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction
from typing import Any, NamedTuple

from django.db.models import F, Sum

from billing.idle import below_percent_of, idle_hour
from billing.models import SLICE_HOUR
from billing.pricing import RateCards, period_holding, rate_hours, round_money
from billing.selectors import BilledUsage, billed_usage, team_gpu_hours
from billing.units import hours_label
from inventory.models import Cluster
from inventory.presence import hourly_units
from metering.hours import HOUR, SHOWN_HOURS, hours_from_ms, idle_of
from metering.models import UsageHour
from metering.moments import parse_day
from teams.models import Team

WEEK = timedelta(days=7)
HOURS = SHOWN_HOURS
LONGEST_IDLE_SHOWN = 10


class WeekError(ValueError):
    """A week that cannot be reported; the message names the parameter and why."""


def last_complete_week(now: datetime) -> datetime:
    """00:00 UTC of the Monday that starts the last ISO week wholly before `now`."""
    day = datetime.combine(now.astimezone(UTC).date(), time(), UTC)
    return day - timedelta(days=day.weekday()) - WEEK


def parse_week_start(value: str | None, *, now: datetime) -> datetime:
    """The week's first moment from `?start=YYYY-MM-DD` (any day: seven days from it), or the
    last complete week when absent. A malformed day, one out of range (`metering.moments`) or
    one after today is a `WeekError` naming the parameter."""
    if not value:
        return last_complete_week(now)
    try:
        start = parse_day(value)
    except ValueError as exc:
        raise WeekError(f"start: {exc}") from None
    if start > now:
        raise WeekError(
            f"start: {start:%Y-%m-%d} is in the future; a week report starts today or before"
        )
    return start


def _hours(milliseconds: int) -> Decimal:
    return hours_from_ms(milliseconds, SHOWN_HOURS, ROUND_HALF_EVEN)


@dataclass
class Figures:
    """Usage of one group (a person, a job, the team) of one unit in one window: integer
    milliseconds, and billed costs exact per currency until shown."""

    allocated_ms: int = 0
    utilised_ms: int = 0
    unmeasured_ms: int = 0
    exact_cost: dict[str, Fraction] = field(default_factory=lambda: defaultdict(Fraction))
    exact_idle_cost: dict[str, Fraction] = field(default_factory=lambda: defaultdict(Fraction))
    # Milliseconds of models without a rate card: in the hours, not in the cost.
    unpriced_ms: int = 0
    # What the statements bill for a person, a job or the team, per currency (`_bill`): their
    # lines' amounts shared out to the cent, so the rows add up to the total exactly and a
    # job's cost is `billed/jobs`'. None: priced here and rounded once (an idle claim).
    billed: dict[str, Decimal] | None = None
    billed_idle: dict[str, Decimal] | None = None

    @property
    def idle_ms(self) -> int:
        return idle_of(self.allocated_ms, self.utilised_ms, self.unmeasured_ms)

    @property
    def allocated(self) -> Decimal:
        return _hours(self.allocated_ms)

    @property
    def utilised(self) -> Decimal:
        return _hours(self.utilised_ms)

    @property
    def idle(self) -> Decimal:
        return _hours(self.idle_ms)

    @property
    def unmeasured(self) -> Decimal:
        return _hours(self.unmeasured_ms)

    @property
    def utilisation(self) -> Decimal | None:
        """Utilised time as a percentage of measured time (allocated less unmeasured); None
        when nothing was measured."""
        measured = self.allocated_ms - self.unmeasured_ms
        if measured <= 0:
            return None
        return (Decimal(self.utilised_ms * 100) / measured).quantize(Decimal("0.1"))

    @property
    def cost(self) -> dict[str, Decimal]:
        """Billed cost per currency: as the statements bill it where known, else rounded
        once to the currency's minor unit."""
        if self.billed is not None:
            return dict(sorted(self.billed.items()))
        return {cur: round_money(v, cur) for cur, v in sorted(self.exact_cost.items())}

    @property
    def idle_cost(self) -> dict[str, Decimal]:
        """What the idle time was billed (rate x idle factor x idle hours), per currency."""
        if self.billed_idle is not None:
            return dict(sorted(self.billed_idle.items()))
        return {cur: round_money(v, cur) for cur, v in sorted(self.exact_idle_cost.items())}

    @property
    def unpriced(self) -> Decimal:
        """Hours of models without a rate card: counted in the hours, not in the cost."""
        return _hours(self.unpriced_ms)

    @property
    def cost_text(self) -> str:
        return money(self.cost)

    @property
    def idle_cost_text(self) -> str:
        return money(self.idle_cost)

    def add(self, other: Figures) -> None:
        self.allocated_ms += other.allocated_ms
        self.utilised_ms += other.utilised_ms
        self.unmeasured_ms += other.unmeasured_ms
        self.unpriced_ms += other.unpriced_ms
        for currency, amount in other.exact_cost.items():
            self.exact_cost[currency] += amount
        for currency, amount in other.exact_idle_cost.items():
            self.exact_idle_cost[currency] += amount


def money(costs: dict[str, Decimal]) -> str:
    """`12.34 USD`, `1.00 EUR + 2.00 USD`, or `—` for none."""
    return " + ".join(f"{amount:f} {currency}" for currency, amount in costs.items()) or "—"


def signed(value: Decimal | None) -> str:
    """`+1.50`, `-0.25`, `0.00`; empty for None: a change, with its sign."""
    if value is None:
        return ""
    return f"+{value:f}" if value > 0 else f"{value:f}"


def cost_delta(now: dict[str, Decimal], before: dict[str, Decimal]) -> dict[str, Decimal]:
    return {
        currency: now.get(currency, Decimal(0)) - before.get(currency, Decimal(0))
        for currency in sorted(set(now) | set(before))
    }


@dataclass
class Row:
    """One person's or job's week of one unit, beside the week before."""

    name: str
    unit: str
    week: Figures
    previous: Figures

    @property
    def hours(self) -> str:
        return hours_label(self.unit)

    @property
    def allocated_delta(self) -> Decimal:
        return self.week.allocated - self.previous.allocated

    @property
    def utilised_delta(self) -> Decimal:
        return self.week.utilised - self.previous.utilised

    @property
    def utilisation_delta(self) -> Decimal | None:
        if self.week.utilisation is None or self.previous.utilisation is None:
            return None
        return self.week.utilisation - self.previous.utilisation

    @property
    def cost_delta(self) -> dict[str, Decimal]:
        return cost_delta(self.week.cost, self.previous.cost)

    @property
    def allocated_change(self) -> str:
        return signed(self.allocated_delta)

    @property
    def utilised_change(self) -> str:
        return signed(self.utilised_delta)

    @property
    def utilisation_change(self) -> str:
        return signed(self.utilisation_delta)

    @property
    def cost_change(self) -> str:
        changes = self.cost_delta
        return " + ".join(f"{signed(v)} {c}" for c, v in changes.items()) or "—"


@dataclass
class IdleClaim:
    """A claim's idle hours in the week; `longest_hours` its longest run of consecutive idle
    hours (`billing.idle.idle_hour` at the team's percent), from `idle_from` to `idle_until`."""

    namespace: str
    claim_name: str
    username: str
    job: str
    unit: str
    longest_hours: int
    idle_from: datetime
    idle_until: datetime
    figures: Figures

    @property
    def hours(self) -> str:
        return hours_label(self.unit)


@dataclass(frozen=True)
class BudgetTerms:
    """A team's budget as `quota.models.Budget` keeps it: hours of `unit` per billing period.
    Passed in by the caller, since billing sits below quota and never imports it."""

    gpu_hours: Decimal
    unit: str
    mode: str


@dataclass(frozen=True)
class WeekBudget:
    """The team's budget in the billing period that holds the week's end, as the week left it."""

    unit: str
    hours: str  # GPU-hours, TPU chip-hours
    budget: Decimal
    mode: str
    period_label: str
    used: Decimal  # in the period up to the week's end (or now)
    percent: Decimal
    week_used: Decimal  # the week's hours that fall in the period
    week_share: Decimal  # the budget pro rata for those hours
    projected: Decimal | None  # the period's use at the pace so far


@dataclass
class TeamWeek:
    team: Team
    start: datetime
    end: datetime
    now: datetime
    totals: list[Row]
    people: list[Row]
    jobs: list[Row]
    idle_claims: list[IdleClaim]
    budget: WeekBudget | None
    # An hour is idle below this percent of the time held (`billing.idle.below_percent_of`).
    idle_below_percent: Decimal | int

    @property
    def complete(self) -> bool:
        """Whether the week has ended (else its figures are the week so far)."""
        return self.end <= self.now

    @property
    def last_day(self) -> date:
        return (self.end - timedelta(days=1)).date()


class _Cell(NamedTuple):
    """What one priced piece of usage is of: a claim's hour on one model, share and unit."""

    claim_id: int  # one claim: namesakes in other clusters, or recreated, are others
    namespace: str
    claim_name: str
    username: str
    job: str
    unit: str
    hour: datetime
    product_name: str
    profile: str
    device_share: Decimal | None


def _usage(team: Team, start: datetime, end: datetime) -> list[tuple[_Cell, Figures]]:
    """The team's usage in `[start, end)` per claim, person, job, hour, model, unit and device
    share, each priced with the rate card of its day."""
    rows = (
        UsageHour.objects.filter(team=team, hour__gte=start, hour__lt=end)
        .values_list(
            "allocation__claim_id",
            "namespace",
            "claim_name",
            "username",
            "job",
            "unit",
            "hour",
            "product_name",
            "profile",
            F("allocation__device_share"),
        )
        .annotate(
            allocated=Sum("allocated_gpu_ms"),
            utilised=Sum("utilised_gpu_ms"),
            unmeasured=Sum("unmeasured_gpu_ms"),
        )
        .order_by("namespace", "claim_name", "allocation__claim_id", "hour")
    )
    cards = RateCards(
        first_day=start.astimezone(UTC).date(),
        last_day=(end - timedelta(microseconds=1)).astimezone(UTC).date(),
    )
    priced = []
    for *values, allocated, utilised, unmeasured in rows:
        cell = _Cell(*values)
        figures = Figures(allocated_ms=allocated, utilised_ms=utilised, unmeasured_ms=unmeasured)
        _price(figures, cell, cards)
        priced.append((cell, figures))
    return priced


def _price(figures: Figures, cell: _Cell, cards: RateCards) -> None:
    """Price `figures` as a statement line would, with the rate card of the hour's day:
    rate x (allocated - (1 - idle factor) x idle), in slice-hours for a MIG profile's own
    card."""
    product, profile, day = cell.product_name, cell.profile, cell.hour.astimezone(UTC).date()
    card = cards.on(product, profile, day)
    if card is None:
        figures.unpriced_ms += figures.allocated_ms
        return
    slice_share = cell.device_share if card.rate_unit == SLICE_HOUR else None
    rate, idle_factor = Fraction(card.per_gpu_hour), Fraction(card.idle_factor)
    idle = rate_hours(figures.idle_ms, slice_share)
    allocated = rate_hours(figures.allocated_ms, slice_share)
    figures.exact_cost[card.currency] += rate * (allocated - (1 - idle_factor) * idle)
    figures.exact_idle_cost[card.currency] += rate * idle_factor * idle


def _fold(usage: Iterable[tuple[_Cell, Figures]], by: str | None) -> dict[tuple[str, str], Figures]:
    """Sum `usage` per (the cell's field `by`, unit); `by` None: per unit only."""
    folded: dict[tuple[str, str], Figures] = defaultdict(Figures)
    for cell, figures in usage:
        folded["" if by is None else getattr(cell, by), cell.unit].add(figures)
    return folded


def _bill(
    folded: dict[tuple[str, str], Figures], billed: BilledUsage, by: str | None
) -> dict[tuple[str, str], Figures]:
    """Set on each of `folded` (per `by`, as `_fold`) the money the statements bill for it:
    the rows of `billed_usage` (people, or jobs when `by` is `job`) summed into it. Each line
    is shared out to the cent once, by largest remainders (`billing.selectors.apportion`), so
    the people, the jobs and the total of a week all add up to the same money, and each job's
    is what `billed/jobs` shows for the window."""
    for group in folded.values():
        group.billed, group.billed_idle = {}, {}
    for row in billed.jobs if by == "job" else billed.people:
        figures = folded.get(("" if by is None else getattr(row, by), row.unit))
        if figures is None or not row.priced:
            continue
        assert figures.billed is not None and figures.billed_idle is not None
        for target, amount in (
            (figures.billed, row.billed),
            (figures.billed_idle, row.billed_idle),
        ):
            target[row.currency] = target.get(row.currency, Decimal(0)) + (amount or 0)
    return folded


def _rows(
    week: dict[tuple[str, str], Figures], previous: dict[tuple[str, str], Figures]
) -> list[Row]:
    """Rows for every name in either week, most allocated this week first."""
    rows = [
        Row(
            name=name,
            unit=unit,
            week=week.get((name, unit), Figures()),
            previous=previous.get((name, unit), Figures()),
        )
        for name, unit in set(week) | set(previous)
    ]
    rows.sort(
        key=lambda row: (-row.week.allocated_ms, -row.previous.allocated_ms, row.unit, row.name)
    )
    return rows


def _idle_claims(
    usage: list[tuple[_Cell, Figures]], limit: int, below_percent: Decimal | int
) -> list[IdleClaim]:
    """Claims by their longest run of consecutive idle hours (`billing.idle.idle_hour`), then
    by idle time. `usage` is ordered by claim and hour."""
    # Per claim (its id: a namesake in another cluster, or the claim recreated, is another) and
    # unit.
    per_claim_hour: dict[tuple[int, str, str, str], dict[datetime, Figures]] = defaultdict(
        lambda: defaultdict(Figures)
    )
    whole: dict[tuple[int, str, str, str], Figures] = defaultdict(Figures)
    people: dict[tuple[int, str, str, str], tuple[str, str]] = {}
    for cell, figures in usage:
        claim = (cell.claim_id, cell.namespace, cell.claim_name, cell.unit)
        per_claim_hour[claim][cell.hour].add(figures)
        whole[claim].add(figures)
        people.setdefault(claim, (cell.username, cell.job))
    found = []
    for claim, hours in per_claim_hour.items():
        longest, best_from, run, run_from, previous = 0, None, 0, None, None
        for hour in sorted(hours):
            figures = hours[hour]
            idle = idle_hour(
                figures.allocated_ms, figures.utilised_ms, figures.unmeasured_ms, below_percent
            )
            if not idle:
                run, previous = 0, None
                continue
            if previous is None or hour - previous != HOUR:
                run, run_from = 0, hour
            run, previous = run + 1, hour
            if run > longest:
                longest, best_from = run, run_from
        if longest == 0 or best_from is None:
            continue
        username, job = people[claim]
        found.append(
            IdleClaim(
                namespace=claim[1],
                claim_name=claim[2],
                username=username,
                job=job,
                unit=claim[3],
                longest_hours=longest,
                idle_from=best_from,
                idle_until=best_from + longest * HOUR,
                figures=whole[claim],
            )
        )
    found.sort(key=lambda c: (-c.longest_hours, -c.figures.idle_ms, c.namespace, c.claim_name))
    return found[:limit]


def _budget(
    team: Team, budget: BudgetTerms, start: datetime, end: datetime, now: datetime
) -> WeekBudget:
    """The budget in the period holding the week's last moment (a week across two months
    reports the month it ends in), counted as the budget is, in hours of its unit."""
    until = min(end, now)
    period = period_holding(until - timedelta(microseconds=1))
    used = team_gpu_hours(team=team, period=period, now=until, unit=budget.unit)
    in_period_from, in_period_to = max(start, period.start), min(until, period.end)
    # Rolled-up hours only, as the days of the team page's burn chart.
    week_ms = (
        UsageHour.objects.filter(
            team=team, unit=budget.unit, hour__gte=in_period_from, hour__lt=in_period_to
        ).aggregate(total=Sum("allocated_gpu_ms"))["total"]
        or 0
    )
    period_seconds = Decimal((period.end - period.start).total_seconds())
    week_seconds = Decimal(max((min(end, period.end) - in_period_from).total_seconds(), 0))
    elapsed = Decimal((until - period.start).total_seconds())
    return WeekBudget(
        unit=budget.unit,
        hours=hours_label(budget.unit),
        budget=budget.gpu_hours.normalize(),
        mode=budget.mode,
        period_label=period.label,
        used=used.quantize(HOURS),
        percent=(used * 100 / budget.gpu_hours).quantize(Decimal(1))
        if budget.gpu_hours
        else Decimal(0),
        week_used=_hours(week_ms),
        week_share=(budget.gpu_hours * week_seconds / period_seconds).quantize(HOURS),
        projected=(used * period_seconds / elapsed).quantize(HOURS) if elapsed > 0 else None,
    )


def team_week(
    *,
    team: Team,
    start: datetime,
    now: datetime,
    budget: BudgetTerms | None,
    idle_claims: int = LONGEST_IDLE_SHOWN,
) -> TeamWeek:
    """The team's week `[start, start + 7 days)` beside the seven days before it: totals,
    per person and per job (allocated, utilised, idle, unmeasured hours and billed cost), the
    claims idle longest, and the budget. A week not over yet counts what is rolled up so far.
    `team` must come from `visible_teams` (tenancy is decided there)."""
    end = start + WEEK
    usage = _usage(team, start, end)
    before = _usage(team, start - WEEK, start)
    billed = billed_usage(teams=[team], since=start, until=end)
    billed_before = billed_usage(teams=[team], since=start - WEEK, until=start)

    def rows(by: str | None) -> list[Row]:
        return _rows(
            _bill(_fold(usage, by), billed, by), _bill(_fold(before, by), billed_before, by)
        )

    below_percent = below_percent_of(team)
    return TeamWeek(
        team=team,
        start=start,
        end=end,
        now=now,
        totals=rows(None),
        people=rows("username"),
        jobs=rows("job"),
        idle_claims=_idle_claims(usage, idle_claims, below_percent),
        budget=None if budget is None else _budget(team, budget, start, end, now),
        idle_below_percent=below_percent,
    )


WEEK_CSV_COLUMNS = (
    "section",  # total, person, job or idle_claim
    "name",
    "unit",
    "hours",  # what the hours count: GPU-hours, TPU chip-hours
    "allocated_hours",
    "utilised_hours",
    "idle_hours",
    "unmeasured_hours",
    "utilisation_percent",  # utilised of measured (allocated less unmeasured)
    "cost",
    "idle_cost",
    "currency",
    "previous_allocated_hours",
    "previous_utilised_hours",
    "previous_cost",
    "longest_idle_hours",
    "idle_from",
)


def _csv_row(
    section: str,
    name: str,
    unit: str,
    week: Figures,
    previous: Figures | None,
    currency: str,
    longest: int | None = None,
    idle_from: datetime | None = None,
) -> list[Any]:
    return [
        section,
        name,
        unit,
        hours_label(unit),
        week.allocated,
        week.utilised,
        week.idle,
        week.unmeasured,
        week.utilisation,
        week.cost.get(currency, "") if currency else "",
        week.idle_cost.get(currency, "") if currency else "",
        currency,
        previous.allocated if previous else "",
        previous.utilised if previous else "",
        (previous.cost.get(currency, "") if currency else "") if previous else "",
        longest,
        idle_from.isoformat() if idle_from else "",
    ]


def week_csv_rows(report: TeamWeek) -> list[list[Any]]:
    """The report as CSV rows in `WEEK_CSV_COLUMNS` order: one per group and currency (a
    group without a priced model: one row, its cost empty)."""
    rows: list[list[Any]] = []
    for section, group in (
        ("total", report.totals),
        ("person", report.people),
        ("job", report.jobs),
    ):
        for row in group:
            currencies = sorted(set(row.week.cost) | set(row.previous.cost)) or [""]
            rows += [
                _csv_row(section, row.name, row.unit, row.week, row.previous, currency)
                for currency in currencies
            ]
    for claim in report.idle_claims:
        for currency in sorted(claim.figures.cost) or [""]:
            rows.append(
                _csv_row(
                    "idle_claim",
                    f"{claim.namespace}/{claim.claim_name}",
                    claim.unit,
                    claim.figures,
                    None,
                    currency,
                    claim.longest_hours,
                    claim.idle_from,
                )
            )
    return rows


# The fleet's week.


@dataclass
class HeatRow:
    """One node's hours: device-equivalents allocated and utilised in each hour (the hour's
    GPU-milliseconds over an hour), against the units the node had in each hour
    (`capacities`, from the devices' presence: `inventory.presence`)."""

    node: str
    unit: str
    capacities: list[int]
    allocated: list[Decimal]
    utilised: list[Decimal]
    unmeasured: list[Decimal]

    @property
    def capacity(self) -> int:
        """The most units the node had in any hour of the week."""
        return max(self.capacities, default=0)

    def shade(self, value: Decimal, hour: int) -> int:
        """`value` as a percentage of the node's units in hour `hour` (its index in the
        week), 0 to 100, for the cell's shade: full where usage met no unit present."""
        capacity = self.capacities[hour]
        if capacity <= 0:
            return 100 if value > 0 else 0
        return int(min(value * 100 / capacity, Decimal(100)))


@dataclass
class FleetWeek:
    start: datetime
    end: datetime
    hours: list[datetime]
    rows: list[HeatRow]

    @property
    def days(self) -> list[date]:
        return [(self.start + timedelta(days=n)).date() for n in range(7)]


def _node_label(cluster: str, node: str | None, qualify: bool) -> str:
    name = node or "(no node)"
    return f"{cluster}/{name}" if qualify else name


def fleet_week(*, start: datetime, now: datetime, cluster: Cluster | None = None) -> FleetWeek:
    """Per node (and unit) and hour of the week `[start, start + 7 days)`: the device-equivalents
    allocated and utilised (a device held half the hour counts 0.5), and the units the node had
    in each hour: the physical units present at some moment of it, before `now`
    (`inventory.presence.hourly_units`, from the devices' first seen and gone times and their
    allocations). A node with units present in the week is a row, held or not. `cluster`
    None: every cluster, nodes named `cluster/node`. Usage of devices without a node is one
    row, `(no node)`."""
    end = start + WEEK
    qualify = cluster is None and Cluster.objects.count() > 1
    usage = UsageHour.objects.filter(hour__gte=start, hour__lt=end)
    if cluster is not None:
        usage = usage.filter(cluster=cluster)
    hours = [start + n * HOUR for n in range(7 * 24)]
    index = {hour: n for n, hour in enumerate(hours)}
    rows: dict[tuple[str, str], HeatRow] = {}

    def row(node: str, unit: str) -> HeatRow:
        if (node, unit) not in rows:
            empty = [Decimal("0.00")] * len(hours)
            rows[node, unit] = HeatRow(
                node, unit, [0] * len(hours), list(empty), list(empty), list(empty)
            )
        return rows[node, unit]

    present = hourly_units(start=start, hours=len(hours), now=now, cluster=cluster)
    for node_units, counts in present.items():
        heat = row(_node_label(node_units.cluster, node_units.node, qualify), node_units.unit)
        heat.capacities = [a + b for a, b in zip(heat.capacities, counts, strict=True)]
    for cluster_name, node, unit, hour, allocated, utilised, unmeasured in (
        usage.values_list("cluster__name", "allocation__device__node__name", "unit", "hour")
        .annotate(Sum("allocated_gpu_ms"), Sum("utilised_gpu_ms"), Sum("unmeasured_gpu_ms"))
        .order_by()
    ):
        heat = row(_node_label(cluster_name, node, qualify), unit)
        at = index[hour.astimezone(UTC)]
        heat.allocated[at] = _hours(allocated)
        heat.utilised[at] = _hours(utilised)
        heat.unmeasured[at] = _hours(unmeasured)
    return FleetWeek(start=start, end=end, hours=hours, rows=[rows[key] for key in sorted(rows)])


FLEET_CSV_COLUMNS = ("node", "unit", "capacity", "hour", "allocated", "utilised", "unmeasured")


def fleet_csv_rows(report: FleetWeek) -> list[list[Any]]:
    """One row per node, unit and hour with usage (hours without any are left out); its
    capacity is the units the node had in that hour."""
    return [
        [
            row.node,
            row.unit,
            row.capacities[n],
            hour.isoformat(),
            row.allocated[n],
            row.utilised[n],
            row.unmeasured[n],
        ]
        for row in report.rows
        for n, hour in enumerate(report.hours)
        if row.allocated[n] or row.utilised[n] or row.unmeasured[n]
    ]
