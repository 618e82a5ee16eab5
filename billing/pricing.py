"""Statements: usage priced by rate card, per team and period, frozen when the period closes.

amount = rate * (allocated - (1 - idleFactor) * idle), in GPU-hours, rounded half-up to the
currency's minor unit once per line. Data that arrives for a closed period never edits it:
the difference becomes adjustment lines in the next open period.

Periods are calendar months in UTC, or ISO weeks (Monday 00:00 UTC) with
`TALLY_BILLING_PERIOD=week`; `2026-11` names a month, `2026-W47` a week.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing import ingest, rollup
from billing.models import (
    DirtyHour,
    LineKind,
    Period,
    RateCard,
    Statement,
    StatementLine,
    UsageHour,
)
from quota.models import Team

MS_PER_HOUR = Decimal(3_600_000)
# ISO 4217 currencies whose minor unit is not the cent.
MINOR_UNITS = {"JPY": 0, "KRW": 0, "ISK": 0, "CLP": 0, "BHD": 3, "KWD": 3, "JOD": 3, "OMR": 3}
MONTH, WEEK = "month", "week"
PERIOD_LENGTHS = (MONTH, WEEK)
_MONTH_TEXT = re.compile(r"(\d{4})-(\d{2})")
_WEEK_TEXT = re.compile(r"(\d{4})-[Ww](\d{2})")
_EXAMPLES = {MONTH: "2026-11", WEEK: "2026-W47"}


class PricingError(ValueError):
    """A pricing step that cannot be done; the message says why."""


def period_length() -> str:
    """`month` or `week`, from TALLY_BILLING_PERIOD (read per call, so tests can change it)."""
    return str(settings.TALLY_BILLING_PERIOD)


def period_bounds(moment: datetime, *, length: str | None = None) -> tuple[datetime, datetime]:
    """The period `[start, end)` that holds `moment`: its calendar month in UTC, or its ISO
    week (from Monday 00:00 UTC) when the length (default TALLY_BILLING_PERIOD) is `week`."""
    length = length or period_length()
    day = moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if length == WEEK:
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    if length != MONTH:
        raise PricingError(f"unknown period length {length!r}; use {' or '.join(PERIOD_LENGTHS)}")
    start = day.replace(day=1)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return start, end


def period_label(start: datetime, end: datetime) -> str:
    """How people name a period: `2026-11` for a calendar month, `2026-W47` for an ISO week,
    else its days (a period stored before the length was changed)."""
    start = start.astimezone(UTC)
    if (start, end) == period_bounds(start, length=MONTH):
        return f"{start:%Y-%m}"
    if (start, end) == period_bounds(start, length=WEEK):
        year, week, _ = start.isocalendar()
        return f"{year}-W{week:02d}"
    return f"{start:%Y-%m-%d}..{end.astimezone(UTC):%Y-%m-%d}"


def parse_period(text: str) -> tuple[datetime, datetime]:
    """The bounds of the period named `text` (`2026-11` for a month, `2026-W47` for an ISO
    week), which must be of the configured length: a week named where billing is monthly
    would bill a span no statement covers."""
    length = period_length()
    text = text.strip()
    month, week = _MONTH_TEXT.fullmatch(text), _WEEK_TEXT.fullmatch(text)
    wanted = f"give the period as {_EXAMPLES[length]}"
    if month is None and week is None:
        raise PricingError(
            f"{text!r} is not a period; billing periods are {length}s: {wanted} "
            f"({'YYYY-MM' if length == MONTH else 'YYYY-Www, an ISO week'})"
        )
    if (length == MONTH and week) or (length == WEEK and month):
        other = WEEK if week else MONTH
        raise PricingError(
            f"{text!r} names a {other}, but billing periods are {length}s "
            f"(TALLY_BILLING_PERIOD={length}): {wanted}"
        )
    try:
        if month is not None:
            first = date(int(month[1]), int(month[2]), 1)
        else:
            assert week is not None
            first = date.fromisocalendar(int(week[1]), int(week[2]), 1)
    except ValueError as exc:
        raise PricingError(f"{text!r} is not a {length}: {exc}") from None
    return period_bounds(datetime(first.year, first.month, first.day, tzinfo=UTC))


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


def round_money(amount: Decimal, currency: str) -> Decimal:
    exponent = Decimal(1).scaleb(-MINOR_UNITS.get(currency.upper(), 2))
    return amount.quantize(exponent, rounding=ROUND_HALF_UP)


def rate_for(product_name: str, profile: str, on: date) -> RateCard | None:
    """The rate card for a model on a day. A MIG device takes its profile's card, else the
    parent's: its GPU-hours are already its share of the GPU."""
    cards = RateCard.objects.filter(product_name=product_name, valid_from__lte=on).exclude(
        valid_until__lte=on
    )
    if profile:
        card = cards.filter(profile=profile).order_by("-valid_from").first()
        if card is not None:
            return card
    return cards.filter(profile="").order_by("-valid_from").first()


@dataclass
class _Usage:
    allocated_ms: int = 0
    utilised_ms: int = 0
    unmeasured_ms: int = 0


@dataclass
class LineFigures:
    """One priced line before it is stored."""

    product_name: str
    profile: str
    currency: str
    rate: Decimal | None
    idle_factor: Decimal | None
    allocated: Decimal
    utilised: Decimal
    unmeasured: Decimal
    amount: Decimal
    days: list[date] = field(default_factory=list)

    @property
    def idle(self) -> Decimal:
        return self.allocated - self.utilised - self.unmeasured


def usage_lines(*, team: Team | None, period: Period) -> list[LineFigures]:
    """The team's usage in the period priced per model and rate card (`team=None`: usage of no
    team). MIG devices are priced by their profile's card when there is one."""
    usage: dict[tuple[str, str, date], _Usage] = defaultdict(_Usage)
    rows = (
        UsageHour.objects.filter(team=team, hour__gte=period.start, hour__lt=period.end)
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        .values("product_name", "profile", "day")
        .annotate(
            allocated=Sum("allocated_gpu_ms"),
            utilised=Sum("utilised_gpu_ms"),
            unmeasured=Sum("unmeasured_gpu_ms"),
        )
        .order_by()
    )
    for row in rows:
        entry = usage[(row["product_name"], row["profile"], row["day"])]
        entry.allocated_ms += row["allocated"]
        entry.utilised_ms += row["utilised"]
        entry.unmeasured_ms += row["unmeasured"]
    lines: dict[tuple[str, str, int | None], LineFigures] = {}
    totals: dict[tuple[str, str, int | None], _Usage] = defaultdict(_Usage)
    for (product, profile, day), entry in sorted(usage.items()):
        card = rate_for(product, profile, day)
        line_profile = profile if card is not None and card.profile else ""
        key = (product, line_profile, card.pk if card else None)
        if key not in lines:
            lines[key] = LineFigures(
                product_name=product,
                profile=line_profile,
                currency=card.currency if card else "",
                rate=card.per_gpu_hour if card else None,
                idle_factor=card.idle_factor if card else None,
                allocated=Decimal(0),
                utilised=Decimal(0),
                unmeasured=Decimal(0),
                amount=Decimal(0),
            )
        total = totals[key]
        total.allocated_ms += entry.allocated_ms
        total.utilised_ms += entry.utilised_ms
        total.unmeasured_ms += entry.unmeasured_ms
        lines[key].days.append(day)
    for key, line in lines.items():
        total = totals[key]
        line.allocated = Decimal(total.allocated_ms) / MS_PER_HOUR
        line.utilised = Decimal(total.utilised_ms) / MS_PER_HOUR
        line.unmeasured = Decimal(total.unmeasured_ms) / MS_PER_HOUR
        if line.rate is not None and line.idle_factor is not None:
            billable = line.allocated - (1 - line.idle_factor) * line.idle
            line.amount = round_money(line.rate * billable, line.currency)
    return list(lines.values())


def _hours(value: Decimal) -> Decimal:
    return value.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)


def refresh_statements(*, period: Period, teams: list[Team] | None = None) -> list[Statement]:
    """Recompute the usage lines of an open period's statements, and the adjustments for data
    that arrived late for closed periods. Rerunning it changes nothing; a closed period's
    statements are never touched."""
    if period.is_closed:
        raise PricingError(f"period {period} is closed; its statements are frozen")
    statements = []
    with transaction.atomic():
        Period.objects.select_for_update().get(pk=period.pk)
        for team in teams if teams is not None else list(Team.objects.order_by("slug")):
            statements += _refresh_team(team, period)
    return statements


def _refresh_team(team: Team, period: Period) -> list[Statement]:
    now = timezone.now()
    lines = usage_lines(team=team, period=period)
    adjustments = _late_data_adjustments(team, period)
    by_currency: dict[str, list[tuple[LineFigures, str, Period | None]]] = defaultdict(list)
    for line in lines:
        by_currency[line.currency or "USD"].append((line, LineKind.USAGE, None))
    for line, corrected in adjustments:
        by_currency[line.currency or "USD"].append((line, LineKind.ADJUSTMENT, corrected))
    # Lines finance added by hand stay; everything computed is replaced.
    kept_currencies = set(
        StatementLine.objects.filter(
            statement__team=team,
            statement__period=period,
            kind=LineKind.ADJUSTMENT,
            corrects_period__isnull=True,
        ).values_list("statement__currency", flat=True)
    )
    statements = []
    for currency in sorted(set(by_currency) | kept_currencies):
        statement, _ = Statement.objects.get_or_create(
            team=team, period=period, currency=currency, defaults={"computed_at": now}
        )
        statement.lines.exclude(kind=LineKind.ADJUSTMENT, corrects_period__isnull=True).delete()
        StatementLine.objects.bulk_create(
            StatementLine(
                statement=statement,
                kind=kind,
                product_name=line.product_name,
                profile=line.profile,
                allocated_gpu_hours=_hours(line.allocated),
                utilised_gpu_hours=_hours(line.utilised),
                idle_gpu_hours=_hours(line.idle),
                unmeasured_gpu_hours=_hours(line.unmeasured),
                rate=line.rate,
                idle_factor=line.idle_factor,
                amount=line.amount,
                corrects_period=corrected,
                reason=(
                    f"late data for {corrected}"
                    if corrected
                    else ("" if line.rate is not None else "no rate card for this model")
                ),
            )
            for line, kind, corrected in by_currency.get(currency, [])
        )
        statement.total = sum((line.amount for line in statement.lines.all()), Decimal(0))
        statement.computed_at = now
        statement.save(update_fields=["total", "computed_at"])
        statements.append(statement)
    return statements


def _late_data_adjustments(team: Team, period: Period) -> list[tuple[LineFigures, Period]]:
    """For each closed period before this one: what its usage is now, less what it was billed
    (its frozen lines and the adjustments already issued for it), per model."""
    adjustments = []
    for closed in Period.objects.filter(closed_at__isnull=False, start__lt=period.start).order_by(
        "start"
    ):
        billed: dict[tuple[str, str, str], list[Decimal]] = defaultdict(lambda: [Decimal(0)] * 4)
        billed_lines = (
            StatementLine.objects.filter(statement__team=team)
            .filter(
                Q(statement__period=closed, kind=LineKind.USAGE)
                | (Q(corrects_period=closed) & ~Q(statement__period=period))
            )
            .select_related("statement")
        )
        for stored in billed_lines:
            figures = billed[(stored.product_name, stored.profile, stored.statement.currency)]
            figures[0] += stored.allocated_gpu_hours
            figures[1] += stored.utilised_gpu_hours
            figures[2] += stored.unmeasured_gpu_hours
            figures[3] += stored.amount
        for line in usage_lines(team=team, period=closed):
            key = (line.product_name, line.profile, line.currency or "USD")
            allocated, utilised, unmeasured, amount = billed.pop(key, [Decimal(0)] * 4)
            delta = LineFigures(
                product_name=line.product_name,
                profile=line.profile,
                currency=line.currency,
                rate=line.rate,
                idle_factor=line.idle_factor,
                allocated=_hours(line.allocated) - allocated,
                utilised=_hours(line.utilised) - utilised,
                unmeasured=_hours(line.unmeasured) - unmeasured,
                amount=line.amount - amount,
            )
            if delta.allocated or delta.utilised or delta.unmeasured or delta.amount:
                adjustments.append((delta, closed))
    return adjustments


def close_period(*, period: Period, actor: str) -> list[Statement]:
    """Compute the period's statements one last time and freeze them. Closing twice is an error;
    a period can close only once it has ended."""
    with transaction.atomic():
        locked = Period.objects.select_for_update().get(pk=period.pk)
        if locked.is_closed:
            raise PricingError(already_closed(locked))
        if locked.end > timezone.now():
            raise PricingError(f"period {period} has not ended yet")
        statements = refresh_statements(period=locked)
        Period.objects.filter(pk=period.pk).update(closed_at=timezone.now(), closed_by=actor)
    period.refresh_from_db()
    return statements


def already_closed(period: Period) -> str:
    """Why a closed period cannot be billed or closed again: when, by whom, and where its late
    data goes instead."""
    closed_at = f"{period.closed_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" if period.closed_at else ""
    return (
        f"period {period_label(period.start, period.end)} ({period}) is already closed, "
        f"at {closed_at} by {period.closed_by or 'an unnamed user'}; its statements are frozen "
        "and late data for it is billed as adjustments in the next open period"
    )


@dataclass
class BillingRun:
    """What `bill_period` did, for its caller to report."""

    period: Period
    adopted_samples: int
    period_hours: int
    usage_rows: int  # the period's, after the rollup
    marked_hours: int  # rolled up because late data or the sync marked them
    statements: list[Statement]
    closed: bool

    @property
    def totals(self) -> dict[str, Decimal]:
        """The statements' totals per currency."""
        totals: dict[str, Decimal] = defaultdict(Decimal)
        for statement in self.statements:
            totals[statement.currency] += statement.total
        return dict(sorted(totals.items()))


def bill_period(
    *, period_start: datetime, now: datetime, close: bool = False, actor: str = ""
) -> BillingRun:
    """Bring the statements of the period holding `period_start` up to date with everything
    known at `now`, and with `close` freeze them.

    In order: samples set aside whose devices the sync has learnt since are adopted; every
    hour of the period up to `now` is rolled up again (so hours a missed rollup skipped are
    counted too); the hours marked for rollup elsewhere are rolled up (late data for closed
    periods, which this period's adjustment lines are computed from); then the statements are
    recomputed, or with `close` computed a last time and frozen (`close_period`).

    Idempotent: a second run writes the same rows. Refused before anything is written: a
    period that has not started (no period row is created for it), a closed period (its
    statements are frozen), and closing a period that has not ended.
    """
    start, end = period_bounds(period_start)
    label = period_label(start, end)
    if start > now:
        raise PricingError(
            f"period {label} has not started yet: it starts {start:%Y-%m-%d %H:%M} UTC"
        )
    if close and end > now:
        raise PricingError(
            f"period {label} cannot be closed before it ends, at {end:%Y-%m-%d %H:%M} UTC"
        )
    period = period_for(start)
    if period.is_closed:
        raise PricingError(already_closed(period))
    adopted = ingest.adopt_unknown_samples(now=now)
    hours = rollup.hours_between(period.start, min(period.end, now))
    rollup.rollup_hours(hours=hours, now=now)
    # Every hour marked before `now`, however many: a bounded beat run may have left a backlog.
    marked = DirtyHour.objects.filter(hour__lt=now).count()
    if marked:
        rollup.rollup_pending(now=now, limit=marked + 1)  # + the hour just ended, as beat's
    if close:
        statements = close_period(period=period, actor=actor)
    else:
        statements = refresh_statements(period=period)
    return BillingRun(
        period=period,
        adopted_samples=adopted,
        period_hours=len(hours),
        usage_rows=UsageHour.objects.filter(hour__gte=period.start, hour__lt=period.end).count(),
        marked_hours=marked,
        statements=statements,
        closed=close,
    )


def close_due_period(*, now: datetime, actor: str) -> BillingRun | None:
    """Close the period before the one holding `now` once TALLY_CLOSE_PERIOD_DAY of the new
    period has come (1: the day it starts; for weeks 1 is Monday), after a final rollup and
    statement refresh (`bill_period`). None when there is nothing to do: closing is turned
    off (0), the day has not come, or the period is closed already (by finance, or a run
    that was quicker). Run it as often as you like: the first run on or after the day closes.
    """
    day = int(settings.TALLY_CLOSE_PERIOD_DAY)
    current_start, _ = period_bounds(now)
    if not day or now < current_start + timedelta(days=day - 1):
        return None
    previous_start, _ = period_bounds(current_start - timedelta(microseconds=1))
    if Period.objects.filter(start=previous_start, closed_at__isnull=False).exists():
        return None
    try:
        return bill_period(period_start=previous_start, now=now, close=True, actor=actor)
    except PricingError:
        if Period.objects.filter(start=previous_start, closed_at__isnull=False).exists():
            return None  # closed while this ran
        raise


def add_adjustment(
    *,
    team: Team,
    period: Period,
    currency: str,
    amount: Decimal,
    reason: str,
    actor: str,
    product_name: str = "",
) -> StatementLine:
    """A correction finance makes by hand, with its reason, in an open period."""
    if period.is_closed:
        raise PricingError(f"period {period} is closed; add the adjustment to an open period")
    if not reason.strip():
        raise PricingError("an adjustment needs a reason")
    with transaction.atomic():
        statement, _ = Statement.objects.get_or_create(
            team=team,
            period=period,
            currency=currency.upper(),
            defaults={"computed_at": timezone.now()},
        )
        line = StatementLine.objects.create(
            statement=statement,
            kind=LineKind.ADJUSTMENT,
            product_name=product_name,
            allocated_gpu_hours=0,
            utilised_gpu_hours=0,
            idle_gpu_hours=0,
            unmeasured_gpu_hours=0,
            amount=round_money(amount, currency),
            reason=reason,
            created_by=actor,
        )
        Statement.objects.filter(pk=statement.pk).update(
            total=sum((line.amount for line in statement.lines.all()), Decimal(0))
        )
    return line
