"""Reads of usage and money, for the webhook (budgets), the portal and the API."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Any

from django.db import connection
from django.db.models import F, OuterRef, Subquery, Sum
from django.db.models.functions import TruncDate

from billing.idle import claim_hours, idle_hour_q
from billing.models import Period, RateCard
from billing.periods import period_bounds
from billing.pricing import (
    LineFigures,
    LineKey,
    RateCards,
    frozen_usage_lines,
    line_key,
    rate_hours,
    unowned_lines,
)
from billing.rounding import apportion, largest_remainders, round_money
from billing.rounding import minor_unit as minor_unit
from billing.units import hours_label
from inventory.models import ResourceClaim, Unit
from inventory.selectors import team_open_allocations
from metering.hours import HOUR, MS_PER_HOUR, ONE_MS, epoch_ms, hour_start, hours_from_ms, idle_of
from metering.models import DirtyHour, Sample, UsageHour
from metering.rollup import held_allocations, rolled_through
from teams.models import Team, TeamNamespace

# Marked hours a budget read counts from the allocations hour by hour; past that many, from the
# first of them on.
MOST_MARKED_SPANS = 8


def team_gpu_hours(*, team: Team, period: Period, now: datetime, unit: str = Unit.GPU) -> Decimal:
    """Hours of `unit` (GPU-hours by default; TPU chip-hours, Gaudi card-hours) the team has
    held in the period up to `now`, charged to it hour by hour as the namespaces they ran in
    were its (`teams.ownership`).
    Hours of other units are left out: they never add up with these.

    An hour's rolled-up rows are counted where they are known to be whole: up to the hour
    before `now`'s and up to the last hour beat's rollup took as the hour just ended
    (`rollup.rolled_through`), but for hours marked for rollup again. Over the other hours the
    allocations themselves are counted, open or ended, as the rollup counts them
    (`rollup.held_allocations`, at the share each fixed when it started): the hour just ended
    until beat has rolled it up, one ended within the current hour, the hours the workers
    missed while down, and hours whose allocations the sync learnt late. So the figure the
    webhook enforces does not depend on when the rollup ran."""
    until = min(now, period.end)
    since = hour_start(now) - HOUR
    last = rolled_through()
    if last is not None:
        since = min(since, last + HOUR)
    since = min(max(since, period.start), until)
    marked = sorted(
        DirtyHour.objects.filter(hour__gte=period.start, hour__lt=since).values_list(
            "hour", flat=True
        )
    )
    if len(marked) > MOST_MARKED_SPANS:
        # Each marked hour reads the allocations ended since it: past a few, one read from the
        # first of them is cheaper, and counts the same.
        since, marked = marked[0], []
    rolled = (
        UsageHour.objects.filter(team=team, unit=unit, hour__gte=period.start, hour__lt=since)
        .exclude(hour__in=marked)
        .aggregate(total=Sum("allocated_gpu_ms"))["total"]
        or 0
    )
    spans = [(hour, hour + HOUR) for hour in marked]
    if since < until:
        spans.append((since, until))
    return hours_from_ms(Decimal(rolled) + _held_ms(team=team, unit=unit, spans=spans), places=None)


def _held_ms(*, team: Team, unit: str, spans: list[tuple[datetime, datetime]]) -> Decimal:
    """Milliseconds of `unit` the team's allocations held within `spans` (disjoint), each at
    its share, counted from the allocations as the rollup counts them: those of a device that
    kept a meter id (`rollup.held_allocations`), over the times the team owned their namespace
    (its dated ownerships, whose bounds are hour starts: the rollup's hour-by-hour rule).
    Adjacent spans are read as one, and each span apart, so that it reads by the allocations'
    `end` index only those that end in it or later (a few minutes' and the open ones, for the
    hours since the last rollup)."""
    merged: list[tuple[datetime, datetime]] = []
    for since, until in sorted(spans):
        if merged and merged[-1][1] == since:
            merged[-1] = (merged[-1][0], until)
        else:
            merged.append((since, until))
    if not merged:
        return Decimal(0)
    parts: list[str] = []
    params: list[Any] = []
    for since, until in merged:
        sql, held_params = (
            held_allocations(since, until)
            .filter(unit=unit)
            .annotate(claim_namespace=F("claim__namespace"))
            .values_list("start", "end", "gpu_share", "claim_namespace")
            .query.sql_with_params()
        )
        parts.append(
            'SELECT GREATEST(0, extract(epoch FROM LEAST(COALESCE(a."end", %s), %s,'
            " COALESCE(owned.valid_until, %s)))"
            " - extract(epoch FROM GREATEST(a.start, %s, COALESCE(owned.valid_from, %s))))"
            " * 1000 * a.gpu_share AS ms"
            f" FROM ({sql}) AS a JOIN {TeamNamespace._meta.db_table} AS owned"
            " ON owned.namespace = a.claim_namespace AND owned.team_id = %s"
        )
        params += [until, until, until, since, since, *held_params, team.pk]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COALESCE(SUM(ms), 0) FROM ({' UNION ALL '.join(parts)}) AS held",
            params,
        )
        (total,) = cursor.fetchone()
    return Decimal(total)


# --- Billed usage per person and per job ------------------------------------------------------

# The three parts of a bill: amount = rate x (utilised + unmeasured + idle_factor x idle).
UTILISED, IDLE, UNMEASURED = "utilised", "idle", "unmeasured"
BILL_PARTS = (UTILISED, IDLE, UNMEASURED)
# Who a usage row is charged to: team id, username, namespace, job.
_Holder = tuple[int, str, str, str]
# A statement line within one period of the window: the period's start, then `LineKey`.
_PeriodLine = tuple[datetime, LineKey]


@dataclass
class BilledRow:
    """One person's (or one job's) hours of one unit in a window, and what the statements bill
    for them in one currency (`currency` empty: no rate card prices these hours, so no money
    figures). The money is each statement line's amount shared out to the cent among the rows
    it bills (`apportion`), so the rows of a team add up to its statements' usage lines."""

    team: str
    unit: str
    currency: str
    username: str = ""
    namespace: str = ""
    job: str = ""
    usernames: list[str] = field(default_factory=list)  # a job's: who ran it
    allocated_ms: int = 0
    utilised_ms: int = 0
    unmeasured_ms: int = 0
    billed_parts: dict[str, Decimal] = field(default_factory=dict)
    # The idle hours at the full rate (idle factor 1): context, never billed.
    idle_list_exact: Fraction = Fraction(0)

    @property
    def idle_ms(self) -> int:
        return idle_of(self.allocated_ms, self.utilised_ms, self.unmeasured_ms)

    @property
    def hours(self) -> str:
        """What the hours count: `GPU-hours`, `TPU chip-hours`, `Gaudi card-hours`."""
        return hours_label(self.unit)

    @property
    def allocated_hours(self) -> Decimal:
        return hours_from_ms(self.allocated_ms, places=None)

    @property
    def utilised_hours(self) -> Decimal:
        return hours_from_ms(self.utilised_ms, places=None)

    @property
    def idle_hours(self) -> Decimal:
        return hours_from_ms(self.idle_ms, places=None)

    @property
    def unmeasured_hours(self) -> Decimal:
        return hours_from_ms(self.unmeasured_ms, places=None)

    @property
    def priced(self) -> bool:
        return bool(self.currency)

    def _money(self, part: str) -> Decimal | None:
        return self.billed_parts.get(part, Decimal(0)) if self.priced else None

    @property
    def billed_utilised(self) -> Decimal | None:
        return self._money(UTILISED)

    @property
    def billed_idle(self) -> Decimal | None:
        return self._money(IDLE)

    @property
    def billed_unmeasured(self) -> Decimal | None:
        return self._money(UNMEASURED)

    @property
    def billed(self) -> Decimal | None:
        """What the statements bill for these hours: the three parts together."""
        if not self.priced:
            return None
        return sum((self.billed_parts.get(part, Decimal(0)) for part in BILL_PARTS), Decimal(0))

    @property
    def idle_at_list_price(self) -> Decimal | None:
        return round_money(self.idle_list_exact, self.currency) if self.priced else None


@dataclass
class BilledUsage:
    """A window's billed usage per person and per job (`billed_usage`)."""

    since: datetime
    until: datetime
    people: list[BilledRow]
    jobs: list[BilledRow]


def period_pieces(
    since: datetime, until: datetime, *, periods: list[Period] | None = None
) -> list[tuple[datetime, datetime]]:
    """`[since, until)` cut where billing periods start: the part of each period in it, as
    `billing.pricing.period_holding` finds the periods (stored ones first), in one query
    (none when given the `stored_periods` of the window)."""
    periods = stored_periods(since, until) if periods is None else periods
    stored = [(period.start, period.end) for period in periods]
    pieces = []
    moment = since
    while moment < until:
        holding = next(((s, e) for s, e in stored if s <= moment < e), None)
        if holding is None:
            _, end = period_bounds(moment)
            end = min([end, *(s for s, _ in stored if s > moment)])
        else:
            end = holding[1]
        pieces.append((moment, min(end, until)))
        moment = end
    return pieces


def stored_periods(since: datetime, until: datetime) -> list[Period]:
    """The stored periods that overlap `[since, until)`, in order."""
    return list(Period.objects.filter(start__lt=until, end__gt=since).order_by("start"))


def billed_usage(
    *, teams: Iterable[Team], since: datetime, until: datetime, cards: RateCards | None = None
) -> BilledUsage:
    """The teams' hours in `[since, until)` per person and per job, each unit apart, with what
    the statements bill for them: per period of the window, each model's usage at one price is
    one line, priced and rounded as `billing.pricing.usage_lines` prices it; each line's amount
    is then shared out to the cent among the people (and, apart, the jobs) it bills, per part
    (utilised, idle, unmeasured). So a window of whole periods gives, per team and currency,
    to the cent, what the statements' usage lines of those periods add up to (adjustments are
    not usage of the window and are left out).

    A closed period in the window shows its frozen statement: each of its lines' hours and
    amount as frozen, shared out among the holders by their usage (`_frozen_holders`), and
    a team's usage there that no frozen line billed (data that came after the close, billed
    as adjustments in an open period) is left out. A closed period only partly in the window
    is shown as its usage rows price it.

    Two queries (periods, and rate cards unless `cards` holds the window's) plus one for the
    usage, grouped per holder, model, unit, day and share in SQL, however many hours there
    are."""
    team_slugs = {team.pk: team.slug for team in teams}
    periods = stored_periods(since, until)
    pieces = period_pieces(since, until, periods=periods)
    closed = [
        period for period in periods if period.is_closed and (period.start, period.end) in pieces
    ]
    frozen = frozen_usage_lines(periods=closed, team_ids=team_slugs)
    closed_starts = {period.start for period in closed}
    cards = cards or RateCards(
        first_day=since.astimezone(UTC).date(),
        last_day=(until - ONE_MS).astimezone(UTC).date(),
    )
    rows = (
        UsageHour.objects.filter(team_id__in=team_slugs, hour__gte=since, hour__lt=until)
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        .values(
            "team_id",
            "username",
            "namespace",
            "job",
            "product_name",
            "profile",
            "unit",
            "day",
            device_share=F("allocation__device_share"),
        )
        .annotate(
            allocated=Sum("allocated_gpu_ms"),
            utilised=Sum("utilised_gpu_ms"),
            unmeasured=Sum("unmeasured_gpu_ms"),
        )
        .order_by()
    )
    # Per line of a period of a team: each holder's milliseconds (allocated, utilised,
    # unmeasured), and the line's card.
    usage: dict[tuple[int, _PeriodLine], dict[_Holder, list[int]]] = defaultdict(dict)
    line_cards: dict[_PeriodLine, RateCard | None] = {}
    for row in rows:
        card = cards.on(row["product_name"], row["profile"], row["day"])
        key = line_key(row, card)
        # Periods start at midnight UTC, so a day's hours are in one period of the window.
        moment = max(since, datetime.combine(row["day"], datetime.min.time(), tzinfo=UTC))
        piece = next(start for start, end in pieces if start <= moment < end)
        line = (piece, key)
        line_cards[line] = card
        holder = (row["team_id"], row["username"], row["namespace"], row["job"])
        figures = usage[row["team_id"], line].setdefault(holder, [0, 0, 0])
        figures[0] += row["allocated"]
        figures[1] += row["utilised"]
        figures[2] += row["unmeasured"]

    people: dict[tuple[int, str, str, str], BilledRow] = {}
    jobs: dict[tuple[int, str, str, str, str], BilledRow] = {}
    for (team_id, line), holders in usage.items():
        piece, key = line
        card = line_cards[line]
        unit, currency = key[2], (card.currency if card else "")
        frozen_line = frozen.get((team_id, piece, key))
        if piece in closed_starts:
            if frozen_line is None:
                continue  # not in the period's statement: billed later, as an adjustment
            holders = _frozen_holders(holders, frozen_line)
        total = frozen_line.amount if frozen_line is not None else None
        money = _line_parts(holders, key, total=total) if card is not None else {}
        for holder, (allocated, utilised, unmeasured) in holders.items():
            _, username, namespace, job = holder
            targets = (
                people.setdefault(
                    (team_id, username, unit, currency),
                    BilledRow(team_slugs[team_id], unit, currency, username=username),
                ),
                jobs.setdefault(
                    (team_id, namespace, job, unit, currency),
                    BilledRow(team_slugs[team_id], unit, currency, namespace=namespace, job=job),
                ),
            )
            idle_ms = idle_of(allocated, utilised, unmeasured)
            for target in targets:
                target.allocated_ms += allocated
                target.utilised_ms += utilised
                target.unmeasured_ms += unmeasured
                if card is not None:
                    target.idle_list_exact += Fraction(card.per_gpu_hour) * rate_hours(
                        idle_ms, key[6]
                    )
                for part in BILL_PARTS:
                    if (holder, part) in money:
                        target.billed_parts[part] = (
                            target.billed_parts.get(part, Decimal(0)) + money[holder, part]
                        )
            if username not in targets[1].usernames:
                targets[1].usernames.append(username)
    for job_row in jobs.values():
        job_row.usernames.sort()
    return BilledUsage(
        since=since,
        until=until,
        people=sorted(people.values(), key=_row_order),
        jobs=sorted(jobs.values(), key=_row_order),
    )


def _frozen_holders(
    holders: Mapping[_Holder, list[int]], line: LineFigures
) -> dict[_Holder, list[int]]:
    """The holders' milliseconds (allocated, utilised, unmeasured) scaled to a frozen line's
    hours, each figure shared out by largest remainders, so they add up to the line."""
    scaled: dict[_Holder, list[int]] = {holder: [0, 0, 0] for holder in holders}
    for index, hours in enumerate((line.allocated, line.utilised, line.unmeasured)):
        target = int((hours * MS_PER_HOUR).to_integral_value(ROUND_HALF_UP))
        whole = sum(figures[index] for figures in holders.values())
        if not whole:
            continue
        parts = {
            holder: Fraction(figures[index] * target, whole) for holder, figures in holders.items()
        }
        for holder, share in largest_remainders(parts, target).items():
            scaled[holder][index] = share
    return scaled


def _line_parts(
    holders: Mapping[_Holder, list[int]], key: LineKey, *, total: Decimal | None = None
) -> dict[Any, Decimal]:
    """A priced line's amount (as `billing.pricing.usage_lines` computes it: exact, rounded
    once; `total`: a frozen line's amount) shared out among its holders and the parts of their
    bill."""
    _, _, _, currency, rate, idle_factor, share = key
    assert rate is not None and idle_factor is not None
    exact: dict[Any, Fraction] = {}
    totals = [0, 0, 0]
    for holder, (allocated, utilised, unmeasured) in holders.items():
        totals = [
            total + figure
            for total, figure in zip(totals, (allocated, utilised, unmeasured), strict=True)
        ]
        idle = idle_of(allocated, utilised, unmeasured)
        exact[holder, UTILISED] = Fraction(rate) * rate_hours(utilised, share)
        exact[holder, UNMEASURED] = Fraction(rate) * rate_hours(unmeasured, share)
        exact[holder, IDLE] = Fraction(rate) * Fraction(idle_factor) * rate_hours(idle, share)
    allocated, utilised, unmeasured = totals
    billable = rate_hours(allocated, share) - (1 - Fraction(idle_factor)) * rate_hours(
        idle_of(allocated, utilised, unmeasured), share
    )
    if total is None:
        return apportion(round_money(Fraction(rate) * billable, currency), exact, currency)
    whole = sum(exact.values(), Fraction(0))
    if not whole:
        return {}
    # The frozen amount shared in the proportions of the exact parts.
    return apportion(
        total, {part: value * Fraction(total) / whole for part, value in exact.items()}, currency
    )


def _row_order(row: BilledRow) -> tuple[Any, ...]:
    """Per team, the most billed first (unpriced rows last), then by name."""
    billed = row.billed if row.billed is not None else Decimal(-1)
    return (row.team, -billed, row.username, row.namespace, row.job, row.unit)


# --- Who holds idle devices now ---------------------------------------------------------------

# How far back the hours of a claim are read to find when it went idle.
IDLE_LOOKBACK = timedelta(days=14)


@dataclass
class IdleHolder:
    """A claim that holds devices and whose recent hours are idle (the claim as a whole, see
    `billing.idle`): who and which job it bills, the devices it holds, and since when it has
    been idle (`since_clipped`: idle for all of the `IDLE_LOOKBACK` read, perhaps longer)."""

    namespace: str
    claim_name: str
    username: str
    job: str
    devices: list[str]
    idle_since: datetime
    since_clipped: bool = False
    latest_util: float | None = None  # percent, the devices' latest sample (the highest)


def idle_holders(*, team: Team, now: datetime, below_percent: Decimal | int) -> list[IdleHolder]:
    """The team's claims holding devices (open allocations in its namespaces) whose last
    rolled-up hour, and every one since their last busy one, is idle by the idle rule
    (`billing.idle`: the claim's hour as a whole, all its allocations' rows of the hour charged
    to the team, judged by `idle_hour` at `below_percent`; unmeasured time counts as busy), with
    the devices they hold, longest idle first. A claim a device of which has a sample taken
    after the claim's last rolled-up hour at or above the percent computes again and is left
    out. Two queries."""
    lookback = hour_start(now) - IDLE_LOOKBACK
    latest = Sample.objects.filter(device_uuid=OuterRef("meter_id")).order_by("-ts_ms")
    held: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in (
        team_open_allocations(team)
        .annotate(
            gpu_util=Subquery(latest.values("gpu_util")[:1]),
            sampled_ms=Subquery(latest.values("ts_ms")[:1]),
        )
        .values(
            "claim_id",
            "claim__namespace",
            "claim__name",
            "device_name",
            "username",
            "job",
            "start",
            "gpu_util",
            "sampled_ms",
        )
        .order_by("start", "pk")
    ):
        held[row["claim_id"]].append(row)
    rows = UsageHour.objects.filter(
        allocation__claim_id=OuterRef("pk"), team=team, hour__gte=lookback
    )
    busy_hours = claim_hours(rows).exclude(
        idle_hour_q(below_percent, "allocated", "utilised", "unmeasured")
    )
    claims: list[IdleHolder] = []
    for hours in (
        ResourceClaim.objects.filter(pk__in=list(held))
        .annotate(
            first_hour=Subquery(rows.order_by("hour").values("hour")[:1]),
            last_hour=Subquery(rows.order_by("-hour").values("hour")[:1]),
            last_busy=Subquery(busy_hours.order_by("-hour").values("hour")[:1]),
        )
        .values("pk", "first_hour", "last_hour", "last_busy")
    ):
        if hours["last_hour"] is None or hours["last_busy"] == hours["last_hour"]:
            continue
        allocations = held[hours["pk"]]
        sampled = [row for row in allocations if row["gpu_util"] is not None]
        if any(
            row["gpu_util"] >= below_percent
            and row["sampled_ms"] >= epoch_ms(hours["last_hour"] + HOUR)
            for row in sampled
        ):
            continue  # computing again since its last rolled-up hour
        first = allocations[0]
        if hours["last_busy"] is not None:
            since, clipped = hours["last_busy"] + HOUR, False
        else:
            since = max(first["start"], hours["first_hour"])
            clipped = first["start"] < lookback
        claims.append(
            IdleHolder(
                namespace=first["claim__namespace"],
                claim_name=first["claim__name"],
                username=first["username"],
                job=first["job"],
                devices=sorted(row["device_name"] for row in allocations),
                idle_since=since,
                since_clipped=clipped,
                latest_util=max((row["gpu_util"] for row in sampled), default=None),
            )
        )
    return sorted(claims, key=lambda h: (h.idle_since, h.namespace, h.claim_name))


# --- Usage of no team -------------------------------------------------------------------------


@dataclass(frozen=True)
class UnownedUsage:
    """Hours of one unit in a namespace of one cluster that no team owned when they were held
    (`teams.ownership`), in a period, and what they cost at list price in one currency
    (`currency` empty: no rate card prices them)."""

    namespace: str
    cluster: str
    unit: str
    currency: str
    allocated_gpu_hours: Decimal
    utilised_gpu_hours: Decimal
    unmeasured_gpu_hours: Decimal
    list_price: Decimal


def unowned_usage(*, period: Period) -> list[UnownedUsage]:
    """The period's usage of no team per namespace, cluster, unit and currency, priced as a
    team's statement lines would be (`billing.pricing.unowned_lines`): the teams' statements
    plus these are the fleet's usage, nothing dropped. For finance and operators only (it names
    namespaces of every team and none)."""
    found: dict[tuple[str, str, str, str], list[Decimal]] = {}
    for (namespace, cluster), lines in unowned_lines(period=period).items():
        for line in lines:
            figures = found.setdefault(
                (namespace, cluster, line.unit, line.currency), [Decimal(0)] * 4
            )
            figures[0] += line.allocated
            figures[1] += line.utilised
            figures[2] += line.unmeasured
            figures[3] += line.amount
    return [
        UnownedUsage(
            namespace=namespace,
            cluster=cluster,
            unit=unit,
            currency=currency,
            allocated_gpu_hours=allocated,
            utilised_gpu_hours=utilised,
            unmeasured_gpu_hours=unmeasured,
            list_price=price,
        )
        for (namespace, cluster, unit, currency), figures in sorted(found.items())
        for allocated, utilised, unmeasured, price in [figures]
    ]
