"""Statements: usage priced by rate card, per team and period, frozen when the period closes.

amount = rate * (allocated - (1 - idleFactor) * idle), rounded half-up to the currency's minor
unit once per line, computed exactly (fractions of integer milliseconds, never a float). The
hours are hours of the devices' unit (GPU-hours, TPU chip-hours, Gaudi card-hours: one line
per unit, never added up), a model's rate card the price of one such hour; except on a line
priced by a MIG profile's own card: that card is the price of an hour of one slice, so the
line's GPU-hours are divided by the slice's share of its GPU (a 3g.40gb slice of an A100 is
3/7 of it). A MIG device without its profile's card pays its GPU's price for its GPU-hours,
which is that price times its share. Data that arrives for a closed period never edits it:
the difference becomes adjustment lines in the next open period, computed only for the
closed periods it reached (`billing.late_data`).

Periods are calendar months in UTC, or ISO weeks (Monday 00:00 UTC) with
`TALLY_BILLING_PERIOD=week`; `2026-11` names a month, `2026-W47` a week.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Any

from django.db import transaction
from django.db.models import F, Q, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing import late_data, shock
from billing.models import SLICE_HOUR, LineKind, Period, RateCard, Statement, StatementLine
from billing.periods import PricingError, period_bounds, period_label, period_length

# Money's rounding is billing.rounding's; the names stay importable here.
from billing.rounding import MINOR_UNITS as MINOR_UNITS
from billing.rounding import round_money as round_money
from db.locks import advisory_xact_lock
from metering.hours import KEPT_HOURS, MS_PER_HOUR, hours_from_ms, idle_of
from metering.models import UsageHour
from teams.models import Team

ZERO = Decimal(0)


def period_for(moment: datetime) -> Period:
    """The period holding `moment`, created when first needed.

    Periods never overlap: when TALLY_BILLING_PERIOD changed after periods were stored, the
    new period would bill hours an old one already billed, so that is an error naming both.
    """
    start, end = period_bounds(moment)
    period = Period.objects.filter(start=start).first()
    if period is None:
        clash = Period.objects.filter(start__lt=end, end__gt=start).order_by("start").first()
        if clash is None:
            period, _ = Period.objects.get_or_create(start=start, defaults={"end": end})
        else:
            period = clash
    if (period.start, period.end) != (start, end):
        raise PricingError(
            f"TALLY_BILLING_PERIOD={period_length()} makes {period_label(start, end)} the "
            f"period {start:%Y-%m-%d}..{end:%Y-%m-%d}, but the stored period "
            f"{period_label(period.start, period.end)} ({period}) overlaps it: the period "
            "length cannot change once periods are stored"
        )
    return period


def period_holding(moment: datetime) -> Period:
    """The period that holds `moment`, to count a budget in: the stored period holding it,
    whatever its length; else the configured period, unsaved, less what stored periods hold
    (so that no hour counts twice after TALLY_BILLING_PERIOD changed).

    Unlike `period_for` it neither writes nor raises: the admission webhook asks it, and
    stored periods of another length must not make admission fail.
    """
    start, end = period_bounds(moment)
    overlapping = list(Period.objects.filter(start__lt=end, end__gt=start))
    for period in overlapping:
        if period.start <= moment < period.end:
            return period
    start = max([start, *(period.end for period in overlapping if period.end <= moment)])
    end = min([end, *(period.start for period in overlapping if period.start > moment)])
    return Period(start=start, end=end)


def rate_hours(gpu_ms: int, slice_share: Decimal | None) -> Fraction:
    """`gpu_ms` GPU-milliseconds in the hours a rate card prices, exactly: GPU-hours, or hours
    of one MIG slice for a profile's own card (`slice_share`: the slice's share of its GPU)."""
    hours = Fraction(gpu_ms, MS_PER_HOUR)
    return hours / Fraction(slice_share) if slice_share else hours


def rate_for(product_name: str, profile: str, on: date) -> RateCard | None:
    """The rate card for a model on a day, by the one rule (`RateCards.on`): the cards of that
    model in force that day read in one query, then chosen as every other price is."""
    cards = RateCards(first_day=on, last_day=on, product_names=[product_name])
    return cards.on(product_name, profile, on)


class RateCards:
    """The rate cards in force on any day of `[first_day, last_day]` (of `product_names`
    only, when given), read once; `on` picks a model's card for a day, without a query per
    model and day. The one definition of which card prices an hour (`rate_for` asks it too):

    1. the cards of the model in force that day (`valid_from` <= day < `valid_until`);
    2. for a MIG device, its profile's own card (a price per hour of the slice), else its
       GPU's, the card without a profile (a price per GPU-hour: a slice's GPU-hours are
       already its share of the GPU);
    3. of those, the one that came into force last (the latest `valid_from`); two from the
       same day (in two currencies) by the one written last (the highest id).
    """

    def __init__(
        self, *, first_day: date, last_day: date, product_names: Iterable[str] | None = None
    ) -> None:
        cards = RateCard.objects.filter(valid_from__lte=last_day).exclude(
            valid_until__lte=first_day
        )
        if product_names is not None:
            cards = cards.filter(product_name__in=list(product_names))
        # Rule 3's order: later cards overwrite earlier ones in `_choose`.
        self.cards = list(cards.order_by("valid_from", "pk"))
        self.chosen: dict[tuple[str, str, date], RateCard | None] = {}

    def on(self, product_name: str, profile: str, day: date) -> RateCard | None:
        if (product_name, profile, day) not in self.chosen:
            self.chosen[product_name, profile, day] = self._choose(product_name, profile, day)
        return self.chosen[product_name, profile, day]

    def _choose(self, product_name: str, profile: str, day: date) -> RateCard | None:
        newest: dict[str, RateCard] = {}
        for card in self.cards:  # rule 3: oldest first, so the newest is kept per profile
            if (
                card.product_name == product_name  # rule 1
                and card.valid_from <= day
                and not (card.valid_until is not None and card.valid_until <= day)
            ):
                newest[card.profile] = card
        return (newest.get(profile) if profile else None) or newest.get("")  # rule 2


@dataclass
class _Usage:
    allocated_ms: int = 0
    utilised_ms: int = 0
    unmeasured_ms: int = 0

    @property
    def idle_ms(self) -> int:
        return idle_of(self.allocated_ms, self.utilised_ms, self.unmeasured_ms)


LineKey = tuple[str, str, str, str, Decimal | None, Decimal | None, Decimal | None]


@dataclass
class LineFigures:
    """One priced line before it is stored. Its hours are hours of `unit` (GPU-hours, TPU
    chip-hours, Gaudi card-hours); `gpu_share` is set on a line priced per slice-hour (a MIG
    profile's own card): the slice's share of its GPU, which turns the line's GPU-hours into
    hours of the slice."""

    product_name: str
    profile: str
    unit: str
    currency: str
    rate: Decimal | None
    idle_factor: Decimal | None
    allocated: Decimal
    utilised: Decimal
    unmeasured: Decimal
    amount: Decimal
    gpu_share: Decimal | None = None

    @property
    def idle(self) -> Decimal:
        return idle_of(self.allocated, self.utilised, self.unmeasured)

    @property
    def key(self) -> LineKey:
        """What a line of a period's statements is for: a model and its unit, at a price (its
        currency, rate and idle factor), for hours of the unit or hours of a slice of a
        share."""
        return (
            self.product_name,
            self.profile,
            self.unit,
            self.currency or "USD",
            self.rate,
            self.idle_factor,
            self.gpu_share,
        )


def line_key(row: Mapping[str, Any], card: RateCard | None) -> LineKey:
    """The statement line a usage row is billed on (`LineFigures.key`): its model and unit at
    `card`'s price, the card its model has on the row's day (none: unpriced, in USD); for a
    card priced per slice-hour, its profile and the device's share too (`row` has
    `product_name`, `profile`, `unit` and `device_share`). Statements, the billed breakdowns
    and the FOCUS export key their lines by it."""
    per_slice = card is not None and card.rate_unit == SLICE_HOUR
    return (
        row["product_name"],
        row["profile"] if per_slice else "",
        row["unit"],
        card.currency if card else "USD",
        card.per_gpu_hour if card else None,
        card.idle_factor if card else None,
        row["device_share"] if per_slice else None,
    )


def usage_lines(*, team: Team | None, period: Period) -> list[LineFigures]:
    """The team's usage in the period priced per model and rate card (`team=None`: usage of no
    team), one line per model, unit and price. A MIG device whose profile has a card of its own is
    priced per hour of the slice, on a line per profile (and share of the GPU); without one its
    GPU-hours go on its GPU's line, at its GPU's price per GPU-hour.

    The amount is exact before its one rounding: integer GPU-milliseconds, and the decimal
    rate, idle factor and share as fractions."""
    return _lines(_usage_rows(period).filter(team=team), cards=_period_cards(period))


def usage_lines_by_team(
    *, period: Period, teams: list[Team] | None = None, cards: RateCards | None = None
) -> dict[int | None, list[LineFigures]]:
    """`usage_lines` of every team (of `teams`; None: every team, and usage of no team
    under None) in one pass over the period's usage rows: a team's rows are spread over the
    whole table, so reading them team by team reads the table once per team. `cards` caches
    rate cards across calls."""
    rows = _usage_rows(period, by=("team_id",))
    if teams is not None:
        rows = rows.filter(team__in=teams)
    by_team: dict[int | None, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_team[row.pop("team_id")].append(row)
    cards = _period_cards(period) if cards is None else cards
    return {team_id: _lines(team_rows, cards=cards) for team_id, team_rows in by_team.items()}


def unowned_lines(
    *, period: Period, cards: RateCards | None = None
) -> dict[tuple[str, str], list[LineFigures]]:
    """The period's usage of no team (hours of a namespace no team owned then), per namespace
    and cluster name, priced as a team's would be (list price): what finance is shown as
    unowned usage, so that team totals and these add up to the fleet's."""
    rows = _usage_rows(period, by=("namespace", "cluster__name")).filter(team__isnull=True)
    by_place: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_place[row.pop("namespace"), row.pop("cluster__name")].append(row)
    cards = _period_cards(period) if cards is None else cards
    return {place: _lines(place_rows, cards=cards) for place, place_rows in by_place.items()}


def _usage_rows(period: Period, *, by: tuple[str, ...] = ()) -> Any:
    """The period's usage rows summed per model, unit, day and device share (and `by`)."""
    return (
        UsageHour.objects.filter(hour__gte=period.start, hour__lt=period.end)
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        # The device's share of its GPU (as the allocation kept it from its start), not the
        # row's: a consumable share of a slice (KEP-5075) holds part of the slice, and pays
        # that part of the slice's price.
        .values(
            *by,
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


def _period_cards(period: Period, *, since: datetime | None = None) -> RateCards:
    """The rate cards of the days of `period` (from `since`, when earlier)."""
    first = min(period.start, since) if since is not None else period.start
    return RateCards(
        first_day=first.astimezone(UTC).date(),
        last_day=(period.end - timedelta(microseconds=1)).astimezone(UTC).date(),
    )


def _lines(rows: Iterable[dict[str, Any]], *, cards: RateCards) -> list[LineFigures]:
    """The summed usage `rows` priced, one line per model, unit and price."""
    lines: dict[LineKey, LineFigures] = {}
    totals: dict[LineKey, _Usage] = defaultdict(_Usage)
    for row in sorted(
        rows,
        key=lambda row: (
            row["product_name"],
            row["profile"],
            row["unit"],
            row["day"],
            row["device_share"] or 0,
        ),
    ):
        product, profile, day = row["product_name"], row["profile"], row["day"]
        card = cards.on(product, profile, day)
        per_slice = card is not None and card.rate_unit == SLICE_HOUR
        figures = LineFigures(
            product_name=product,
            profile=profile if per_slice else "",
            unit=row["unit"],
            currency=card.currency if card else "",
            rate=card.per_gpu_hour if card else None,
            idle_factor=card.idle_factor if card else None,
            allocated=Decimal(0),
            utilised=Decimal(0),
            unmeasured=Decimal(0),
            amount=Decimal(0),
            gpu_share=row["device_share"] if per_slice else None,
        )
        lines.setdefault(figures.key, figures)
        total = totals[figures.key]
        total.allocated_ms += row["allocated"]
        total.utilised_ms += row["utilised"]
        total.unmeasured_ms += row["unmeasured"]
    for key, line in lines.items():
        total = totals[key]
        line.allocated = hours_from_ms(total.allocated_ms, places=None)
        line.utilised = hours_from_ms(total.utilised_ms, places=None)
        line.unmeasured = hours_from_ms(total.unmeasured_ms, places=None)
        if line.rate is not None and line.idle_factor is not None:
            billable = rate_hours(total.allocated_ms, line.gpu_share) - (
                1 - Fraction(line.idle_factor)
            ) * rate_hours(total.idle_ms, line.gpu_share)
            line.amount = round_money(Fraction(line.rate) * billable, line.currency)
    return list(lines.values())


def _hours(value: Decimal) -> Decimal:
    return value.quantize(KEPT_HOURS, rounding=ROUND_HALF_UP)


def refresh_statements(
    *,
    period: Period,
    teams: list[Team] | None = None,
    closing: bool = False,
    cause: str = "a statement refresh",
) -> list[Statement]:
    """Recompute the usage lines of an open period's statements, and the adjustments for data
    that arrived late for closed periods. Rerunning it changes nothing; a closed period's
    statements are never touched.

    The period's row is locked first and only then checked open: `period` may have been read
    before a close that committed while this waited for the lock (a beat run, `run_billing`
    after its rollup), and its statements are frozen since (`PricingError`, nothing written).

    A closed period is read only while it holds late-data marks (`billing.late_data`): one
    without them is billed as its frozen lines and the adjustments already issued for it
    say, so this period's adjustment lines for it are kept as they are. `closing` (the close's
    last refresh, every team): the marks it read are deleted, those of this period and of the
    closed periods it read, as the statements about to be frozen account for them; a mark
    made since stays.

    Money that jumps, or a closed period's that changes, raises an operator alert naming
    `cause`, what ran this refresh (`billing.shock`).
    """
    if closing and teams is not None:
        raise ValueError("a closing refresh is every team's")
    with transaction.atomic():
        if Period.objects.select_for_update().get(pk=period.pk).is_closed:
            raise PricingError(f"period {period} is closed; its statements are frozen")
        chosen = teams if teams is not None else list(Team.objects.order_by("slug"))
        earlier = list(
            Period.objects.filter(closed_at__isnull=False, start__lt=period.start).order_by("start")
        )
        if earlier:
            # Two open periods (last month not closed yet) each bill a closed period's late
            # data less what the others already billed for it: refreshed at once, both would
            # bill it. One at a time, the second reads the first's adjustments.
            advisory_xact_lock("billing.late_data", [0])
        # The marks before any usage: a write this refresh's reads miss keeps a mark it did
        # not read.
        marks = late_data.read_marks([*earlier, period])
        reread = [before for before in earlier if before.pk in marks]
        # Each period's usage read once for all the teams, not once per team; the rate cards
        # of all their days once.
        cards = _period_cards(period, since=reread[0].start if reread else None)
        usage = usage_lines_by_team(period=period, teams=chosen, cards=cards)
        closed = {
            before: usage_lines_by_team(period=before, teams=chosen, cards=cards)
            for before in reread
        }
        billed = _billed_lines(period, reread, teams=chosen)
        adjustments_before = _closed_adjustments(period, chosen)
        statements = _write_statements(
            period,
            {
                team: _computed_lines(
                    usage.get(team.pk, []), _late_data_adjustments(team, closed, billed)
                )
                for team in chosen
            },
            reread=reread,
        )
        shock.check_statements(
            period=period,
            statements=statements,
            adjustments_before=adjustments_before,
            adjustments_after=_closed_adjustments(period, chosen),
            cause=cause,
            now=timezone.now(),
        )
        if closing:
            late_data.clear_marks(
                mark for read in [period, *reread] for mark in marks.get(read.pk, [])
            )
    return statements


def _closed_adjustments(period: Period, teams: list[Team]) -> dict[tuple[int, int, str], Decimal]:
    """What `period`'s statements bill for closed periods' late data, per team, closed period
    and currency."""
    return {
        (team_id, corrected, currency): total
        for team_id, corrected, currency, total in StatementLine.objects.filter(
            statement__period=period,
            statement__team__in=teams,
            kind=LineKind.ADJUSTMENT,
            corrects_period__isnull=False,
        )
        .values_list("statement__team_id", "corrects_period_id", "statement__currency")
        .annotate(total=Sum("amount"))
        .order_by()
    }


ClosedUsage = dict[Period, dict[int | None, list[LineFigures]]]
# Per team and closed period (by pks): what the period was billed, per line, before this one.
BilledLines = dict[tuple[int, int], dict[LineKey, LineFigures]]


def _billed_lines(period: Period, closed: list[Period], *, teams: list[Team]) -> BilledLines:
    """What each of the `closed` periods billed each team: its frozen usage lines and the
    adjustments issued for it in other periods than `period` (whose own are recomputed), per
    line key, in one query for all of them."""
    billed: BilledLines = defaultdict(dict)
    if not closed:
        return billed
    for stored in (
        StatementLine.objects.filter(statement__team__in=teams)
        .filter(
            Q(statement__period__in=closed, kind=LineKind.USAGE)
            | (Q(corrects_period__in=closed) & ~Q(statement__period=period))
        )
        .select_related("statement")
        .order_by("pk")
    ):
        usage = stored.kind == LineKind.USAGE
        billed_for = stored.statement.period_id if usage else stored.corrects_period_id
        assert billed_for is not None  # the filter's: a closed period's usage, or a correction
        lines = billed[stored.statement.team_id, billed_for]
        figures = _stored_figures(stored)
        if figures.key in lines:
            figures = _plus(lines[figures.key], figures)
        lines[figures.key] = figures
    return billed


# A statement line computed: its figures, kind and the closed period it corrects (if any).
ComputedLine = tuple[LineFigures, str, Period | None]


def _computed_lines(
    usage: list[LineFigures], adjustments: list[tuple[LineFigures, Period]]
) -> list[ComputedLine]:
    return [
        *((line, LineKind.USAGE, None) for line in usage),
        *((line, LineKind.ADJUSTMENT, corrected) for line, corrected in adjustments),
    ]


def _write_statements(
    period: Period, computed: dict[Team, list[ComputedLine]], *, reread: list[Period]
) -> list[Statement]:
    """Replace the computed lines of the teams' statements of `period` with `computed` (per
    team, one statement per currency) and set the statements' totals, in a few statements
    whatever the number of teams; the teams' statements, in order (as `computed`, then by
    currency).

    Lines finance added by hand stay, as do the adjustments for closed periods not read again
    (`reread`: nothing reached the others since their adjustments were frozen); usage lines
    and the adjustments for the periods read again are replaced. Every statement a team has
    in the period is recomputed, so one whose lines all went (a model's card moved to
    another currency) keeps none of them."""
    now = timezone.now()
    teams = list(computed)
    stored = {
        (statement.team_id, statement.currency): statement
        for statement in Statement.objects.filter(period=period, team__in=teams)
    }
    wanted = {
        (team.pk, line.currency or "USD")
        for team, team_lines in computed.items()
        for line, _, _ in team_lines
    }
    made = Statement.objects.bulk_create(
        Statement(team_id=team_id, period=period, currency=currency, computed_at=now)
        for team_id, currency in sorted(wanted - stored.keys())
    )
    stored.update({(statement.team_id, statement.currency): statement for statement in made})
    lines = StatementLine.objects.filter(statement__period=period, statement__team__in=teams)
    lines.filter(
        Q(kind=LineKind.USAGE) | Q(kind=LineKind.ADJUSTMENT, corrects_period__in=reread)
    ).delete()
    StatementLine.objects.bulk_create(
        StatementLine(
            statement=stored[team.pk, line.currency or "USD"],
            kind=kind,
            product_name=line.product_name,
            profile=line.profile,
            unit=line.unit,
            allocated_gpu_hours=_hours(line.allocated),
            utilised_gpu_hours=_hours(line.utilised),
            idle_gpu_hours=_hours(line.idle),
            unmeasured_gpu_hours=_hours(line.unmeasured),
            rate=line.rate,
            idle_factor=line.idle_factor,
            gpu_share=line.gpu_share,
            amount=line.amount,
            corrects_period=corrected,
            reason=(
                f"late data for {corrected}"
                if corrected
                else ("" if line.rate is not None else "no rate card for this model")
            ),
        )
        for team, team_lines in computed.items()
        for line, kind, corrected in team_lines
    )
    totals = dict(
        lines.values("statement").annotate(total=Sum("amount")).values_list("statement", "total")
    )
    for statement in stored.values():
        statement.total = totals.get(statement.pk) or Decimal(0)
        statement.computed_at = now
    Statement.objects.bulk_update(list(stored.values()), ["total", "computed_at"])
    order = {team.pk: index for index, team in enumerate(teams)}
    return [stored[key] for key in sorted(stored, key=lambda key: (order[key[0]], key[1]))]


def _late_data_adjustments(
    team: Team, closed_usage: ClosedUsage, billed_lines: BilledLines
) -> list[tuple[LineFigures, Period]]:
    """For each closed period read again (`closed_usage`: their usage now, per team): what its
    usage is now, less what it was billed (`billed_lines`: its frozen lines and the adjustments
    already issued for it), per model and price. What was billed for a line its usage no
    longer has is taken back whole."""
    adjustments = []
    for closed, by_team in closed_usage.items():
        billed = billed_lines.get((team.pk, closed.pk), {})
        usage = {
            line.key: replace(
                line,
                allocated=_hours(line.allocated),
                utilised=_hours(line.utilised),
                unmeasured=_hours(line.unmeasured),
            )
            for line in by_team.get(team.pk, [])
        }
        for key in [*usage, *(key for key in billed if key not in usage)]:
            now = usage.get(key) or replace(
                billed[key], allocated=ZERO, utilised=ZERO, unmeasured=ZERO, amount=ZERO
            )
            delta = _plus(now, billed[key], sign=-1) if key in billed else now
            if delta.allocated or delta.utilised or delta.unmeasured or delta.amount:
                adjustments.append((delta, closed))
    return adjustments


def frozen_usage_lines(
    *, periods: Iterable[Period], team_ids: Iterable[int]
) -> dict[tuple[int, datetime, LineKey], LineFigures]:
    """The usage lines of the teams' frozen statements of the closed `periods`, per team,
    period start and line: what those periods billed, which every surface shows for them
    (late data is in the adjustments of the open period that billed it)."""
    lines = StatementLine.objects.filter(
        kind=LineKind.USAGE,
        statement__period__in=[period for period in periods if period.is_closed],
        statement__team_id__in=list(team_ids),
    ).select_related("statement__period")
    return {
        (line.statement.team_id, line.statement.period.start, figures.key): figures
        for line in lines
        for figures in [_stored_figures(line)]
    }


def _stored_figures(stored: StatementLine) -> LineFigures:
    return LineFigures(
        product_name=stored.product_name,
        profile=stored.profile,
        unit=stored.unit,
        currency=stored.statement.currency,
        rate=stored.rate,
        idle_factor=stored.idle_factor,
        allocated=stored.allocated_gpu_hours,
        utilised=stored.utilised_gpu_hours,
        unmeasured=stored.unmeasured_gpu_hours,
        amount=stored.amount,
        gpu_share=stored.gpu_share,
    )


def _plus(line: LineFigures, other: LineFigures, *, sign: int = 1) -> LineFigures:
    """`line` with `other`'s hours and amount added (`sign=-1`: taken away)."""
    return replace(
        line,
        allocated=line.allocated + sign * other.allocated,
        utilised=line.utilised + sign * other.utilised,
        unmeasured=line.unmeasured + sign * other.unmeasured,
        amount=line.amount + sign * other.amount,
    )


def already_closed(period: Period) -> str:
    """Why a closed period cannot be billed or closed again: when, by whom, and where its late
    data goes instead."""
    closed_at = f"{period.closed_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" if period.closed_at else ""
    return (
        f"period {period_label(period.start, period.end)} ({period}) is already closed, "
        f"at {closed_at} by {period.closed_by or 'an unnamed user'}; its statements are frozen "
        "and late data for it is billed as adjustments in the next open period"
    )
