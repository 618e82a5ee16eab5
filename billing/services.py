"""Billing's writes: closing periods, adjustments, rate cards and agent tokens, which people
make and which are audited; and the runs that bring usage and statements up to date.

Each is one transaction that takes its own locks and, for a person's or a schedule's change,
writes its own audit entry (`teams.audit`) in the same transaction: the API, the admin, the
commands, the Celery tasks and `apply_policy` all call these, so none of them can skip a
check, a lock or the audit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from billing import late_data
from billing.currencies import currency_error
from billing.models import LineKind, Period, RateCard, Statement, StatementLine
from billing.periods import PricingError, period_bounds, period_label
from billing.pricing import already_closed, period_for, refresh_statements, round_money
from billing.rates import (
    ClosedPeriod,
    RateCardValueError,
    closed_periods,
    overlap,
    overlap_error,
    overlapping_card,
    rate_card_value_errors,
    rate_change_error,
)
from metering import ingest, retention, rollup
from metering.hours import hours_between
from metering.models import DirtyHour, UsageHour
from teams import audit
from teams.models import AuditEntry, Team

# What a rate card says, as the admin's form and `apply_policy` give it.
RATE_CARD_FIELDS = (
    "product_name",
    "profile",
    "currency",
    "valid_from",
    "valid_until",
    "per_gpu_hour",
    "idle_factor",
)


# --- Periods and statements -------------------------------------------------------------------


def close_period(*, period: Period, actor: str) -> list[Statement]:
    """Compute the period's statements one last time and freeze them; `period` is refreshed.

    Guarantees: the period's row is locked first, so no rate card that prices it changes and
    no adjustment lands in it meanwhile (both lock it too); a period closes once, and only
    once it has ended (else `PricingError`, nothing written); the close is audited as `actor`
    (the period before and after) in the same transaction; the late-data marks its last
    refresh read, which the frozen statements account for, are cleared in it too, and a
    usage row written meanwhile keeps its mark (`billing.late_data`), so its period is read
    again by the next open period's refresh.
    """
    with transaction.atomic():
        locked = Period.objects.select_for_update().get(pk=period.pk)
        if locked.is_closed:
            raise PricingError(already_closed(locked))
        if locked.end > timezone.now():
            raise PricingError(
                f"period {locked.label} has not ended yet: it ends {locked.end:%Y-%m-%d %H:%M} UTC"
            )
        before = audit.snapshot(locked)
        statements = refresh_statements(
            period=locked, closing=True, cause=f"the close of {locked.label} by {actor}"
        )
        locked.closed_at = timezone.now()
        locked.closed_by = actor
        audit.update(actor=actor, obj=locked, before=before)
    period.refresh_from_db()
    return statements


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
    """A correction finance makes by hand, with its reason, on the team's statement of an open
    period (created if needed).

    Guarantees: the amount is rounded to the currency's minor unit; the period's row is locked,
    so it cannot close (nor its statements be recomputed) while the line is added; a closed
    period, an empty reason or a currency not in ISO 4217 is refused (`PricingError`, nothing
    written); the statement's total includes the line; the line is audited as `actor` in the
    same transaction.
    """
    if not reason.strip():
        raise PricingError("an adjustment needs a reason")
    currency = currency.upper()
    if error := currency_error(currency):
        raise PricingError(error)
    with transaction.atomic():
        locked = Period.objects.select_for_update().get(pk=period.pk)
        if locked.is_closed:
            raise PricingError(
                f"period {locked.label} is closed; add the adjustment to an open period"
            )
        statement, _ = Statement.objects.get_or_create(
            team=team,
            period=locked,
            currency=currency.upper(),
            defaults={"computed_at": timezone.now()},
        )
        line = StatementLine(
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
        audit.create(actor=actor, obj=line)
        Statement.objects.filter(pk=statement.pk).update(
            total=sum((line.amount for line in statement.lines.all()), Decimal(0))
        )
    return line


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
    known at `now`, and with `close` freeze them (`close_period`, audited as `actor`).

    In order: samples set aside whose devices the sync has learnt since are adopted; every
    hour of the period up to `now` is rolled up again (so hours a missed rollup skipped are
    counted too); the hours marked for rollup elsewhere are rolled up (late data for closed
    periods, which this period's adjustment lines are computed from); then the statements are
    recomputed, or with `close` computed a last time and frozen.

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
    hours = hours_between(period.start, min(period.end, now))
    rollup.rollup_hours(hours=hours, now=now)
    # Every hour marked before `now`, however many: a bounded beat run may have left a backlog.
    marked = DirtyHour.objects.filter(hour__lt=now).count()
    if marked:
        rollup.rollup_pending(now=now, limit=marked + 1)  # + the hour just ended, as beat's
    if close:
        statements = close_period(period=period, actor=actor)
    else:
        statements = refresh_statements(
            period=period, cause=f"a billing run of {label} by {actor or 'run_billing'}"
        )
    return BillingRun(
        period=period,
        adopted_samples=adopted,
        period_hours=len(hours),
        usage_rows=UsageHour.objects.filter(hour__gte=period.start, hour__lt=period.end).count(),
        marked_hours=marked,
        statements=statements,
        closed=close,
    )


def open_charges(*, now: datetime) -> dict[tuple[str, str, str], Decimal]:
    """The statements of every open period (the one holding `now` and any older one left
    open) brought up to date with what is known at `now`, as `bill_period` does (the hours
    marked elsewhere rolled up too: closed periods' late data lands in the open period as
    adjustments): {(team slug, period label, currency): total}. It writes what `bill_period`
    writes: a dry run calls it inside a transaction it rolls back."""
    starts = {period_bounds(now)[0]}
    for start, end in Period.objects.filter(closed_at__isnull=True, start__lte=now).values_list(
        "start", "end"
    ):
        if period_bounds(start) == (start, end):  # else of another length: left to a person
            starts.add(start)
    charges: dict[tuple[str, str, str], Decimal] = {}
    for start in sorted(starts):
        run = bill_period(period_start=start, now=now)
        for statement in run.statements:
            charges[(statement.team.slug, run.period.label, statement.currency)] = statement.total
    return charges


def on_charges_requested(
    sender: Any, *, now: datetime, **_: Any
) -> dict[tuple[str, str, str], Decimal]:
    """`inventory.signals.charges_requested` receiver: `open_charges`."""
    return open_charges(now=now)


def closed_until() -> datetime | None:
    """The end of the last closed period: usage before it is billed only as late data."""
    return Period.objects.filter(closed_at__isnull=False).aggregate(end=Max("end"))["end"]


def why_samples_kept(start: datetime, end: datetime) -> str:
    """Why the samples of `[start, end)` (a UTC day) must stay for billing: a period over it
    still open, or part of it in no closed period yet (not billed); "" when closed periods
    cover it all. Metering's retention asks (`metering.retention.RETENTION_HOLDS`)."""
    periods = list(
        Period.objects.filter(start__lt=end, end__gt=start)
        .order_by("start")
        .values_list("start", "end", "closed_at")
    )
    open_periods = [f"{p_start:%Y-%m-%d}" for p_start, _, closed in periods if closed is None]
    if open_periods:
        return f"period from {', '.join(open_periods)} is open"
    covered = start
    for p_start, p_end, _ in periods:
        if p_start > covered:
            break
        covered = max(covered, p_end)
    if covered < end:
        return f"not billed yet: no closed period covers {covered:%Y-%m-%d %H:%M} UTC"
    return ""


def on_usage_closed_until(sender: Any, **_: Any) -> datetime | None:
    """`inventory.signals.usage_closed_until` receiver: `closed_until`."""
    return closed_until()


def close_due_at(end: datetime) -> datetime | None:
    """When beat closes the period that ends at `end` (`close_due_periods`): on
    TALLY_CLOSE_PERIOD_DAY of the period after it; None when closing is turned off (0)."""
    day = int(settings.TALLY_CLOSE_PERIOD_DAY)
    return end + timedelta(days=day - 1) if day else None


def close_due_periods(*, now: datetime, actor: str) -> list[BillingRun]:
    """Close every open period whose close is due at `now` (`close_due_at`), oldest first, each
    after a final rollup and statement refresh: the previous period (`close_due_period`), and
    any older one left open (`run_billing` for an old period opens it; nothing else would
    close it). A stored period of another length than TALLY_BILLING_PERIOD is left to a person
    (`bill_period` refuses it). Idempotent, as `close_due_period`.
    """
    current_start, _ = period_bounds(now)
    previous_start, _ = period_bounds(current_start - timedelta(microseconds=1))
    runs = []
    older = Period.objects.filter(closed_at__isnull=True, start__lt=previous_start)
    for period in older.order_by("start"):
        due = close_due_at(period.end)
        if due is None or due > now or period_bounds(period.start) != (period.start, period.end):
            continue
        if (run := _bill_and_close(period.start, now=now, actor=actor)) is not None:
            runs.append(run)
    previous = close_due_period(now=now, actor=actor)
    return [*runs, *([previous] if previous else [])]


def close_due_period(*, now: datetime, actor: str) -> BillingRun | None:
    """Close the period before the one holding `now` once TALLY_CLOSE_PERIOD_DAY of the new
    period has come (1: the day it starts; for weeks 1 is Monday), after a final rollup and
    statement refresh (`bill_period`). None when there is nothing to do: closing is turned
    off (0), the day has not come, or the period is closed already (by finance, or a run
    that was quicker). Run it as often as you like: the first run on or after the day closes.
    """
    current_start, _ = period_bounds(now)
    due = close_due_at(current_start)
    if due is None or now < due:
        return None
    previous_start, _ = period_bounds(current_start - timedelta(microseconds=1))
    if Period.objects.filter(start=previous_start, closed_at__isnull=False).exists():
        return None
    return _bill_and_close(previous_start, now=now, actor=actor)


def _bill_and_close(start: datetime, *, now: datetime, actor: str) -> BillingRun | None:
    """`bill_period` closing the period that starts at `start`; None when it was closed while
    this ran (by finance, or a quicker run)."""
    try:
        return bill_period(period_start=start, now=now, close=True, actor=actor)
    except PricingError:
        if Period.objects.filter(start=start, closed_at__isnull=False).exists():
            return None
        raise


def refresh_usage(*, now: datetime) -> list[datetime]:
    """What Celery beat runs every few minutes: adopt the samples set aside whose devices the
    sync has learnt since, and delete those set aside longer than
    TALLY_INGEST_UNKNOWN_RETENTION_DAYS; roll up the hour just ended and the hours marked for
    rollup (at most TALLY_ROLLUP_HOURS_PER_RUN, newest first), then recompute the statements
    of the period holding `now`. Returns the hours rolled up. Idempotent, as each step is.
    """
    ingest.adopt_unknown_samples(now=now)
    retention.purge_unknown_device_samples(now=now)  # in batches
    hours = rollup.rollup_pending(now=now)
    refresh_statements(period=period_for(now), cause="beat's periodic refresh (refresh_usage)")
    return hours


# --- Rate cards -------------------------------------------------------------------------------


class SavedRateCard(NamedTuple):
    """A rate card as `save_rate_card` left it, and its audit entry (None: nothing changed)."""

    card: RateCard
    entry: AuditEntry | None


def save_rate_card(
    *,
    card: RateCard | None,
    values: Mapping[str, Any],
    actor: str,
    closed: list[ClosedPeriod] | None = None,
    check_overlap: bool = True,
) -> SavedRateCard:
    """Create a rate card (`card` None) from `values` (`RATE_CARD_FIELDS`), or change `card`
    to them; audited as `actor`.

    Guarantees: the values keep the rules of `rate_card_value_errors` (else
    `RateCardValueError`, a `PricingError` naming each field at fault; nothing written); no
    closed billing period is priced differently afterwards: the days the card
    covers in each, its price and idle factor there stay as they were (`rate_change_error`;
    else `PricingError`, nothing written), checked while every period row is locked, so none
    closes meanwhile; only the fields that change are written, and nothing (no audit entry)
    when none does.

    `closed`: the closed periods the caller read in this transaction with their rows locked
    (`closed_periods(lock=True)`), and `card` as the caller read it then, locked
    (`apply_policy` reads them once for all its cards); without it both are read, locked,
    here.

    Nor may the card overlap another of its model and profile (`overlap_error`), checked
    while every other writer of rate cards waits (`closed_periods(lock=True)`);
    `check_overlap=False` only for a caller that checked the whole set it writes (the
    policy file: midway through its writes, two of its cards may overlap for a moment).
    """
    with transaction.atomic():
        card, closed = _locked(card, closed)
        stored = _rate_values(card) if card is not None else {}
        wanted = RateCard(**{**stored, **values})
        invalid = rate_card_value_errors(_rate_values(wanted))
        if invalid:
            raise RateCardValueError(invalid)
        error = rate_change_error(before=card, after=wanted, periods=closed)
        if error:
            raise PricingError(error)
        other = overlapping_card(wanted, pk=card.pk if card else None) if check_overlap else None
        if other is not None:
            raise PricingError(overlap_error(wanted, other))
        if card is None:
            return SavedRateCard(wanted, audit.create(actor=actor, obj=wanted))
        before = audit.snapshot(card)
        for name, value in values.items():
            setattr(card, name, value)
        entry = audit.update(actor=actor, obj=card, before=before)
        if entry is not None:
            _mark_repriced(RateCard(**stored), card, closed)
        return SavedRateCard(card, entry)


def delete_rate_card(
    *, card: RateCard, actor: str, closed: list[ClosedPeriod] | None = None
) -> AuditEntry:
    """Delete `card`, audited as `actor`; its audit entry.

    Guarantees: a card that priced a closed period is never deleted (`PricingError`, nothing
    written), checked while every period row is locked. `closed` as for `save_rate_card`.
    """
    with transaction.atomic():
        locked, closed = _locked(card, closed)
        assert locked is not None
        error = rate_change_error(before=locked, after=None, periods=closed)
        if error:
            raise PricingError(error)
        (entry,) = audit.delete(actor=actor, obj=locked)
    return entry


def _locked(
    card: RateCard | None, closed: list[ClosedPeriod] | None
) -> tuple[RateCard | None, list[ClosedPeriod]]:
    """`card` and the closed periods as the caller read them under lock, or read here with
    every period row, and the card's, locked."""
    if closed is not None:
        return card, closed
    closed = closed_periods(lock=True)
    if card is not None:
        card = RateCard.objects.select_for_update().get(pk=card.pk)
    return card, closed


def _mark_repriced(before: RateCard, after: RateCard, closed: list[ClosedPeriod]) -> None:
    """Mark the closed periods whose days a changed card covers (before or after the change)
    as late data does: `rate_change_error` keeps a card's price and days over closed periods,
    but its currency, model or profile may change there, which prices their usage anew with no
    usage row written; the next refresh then reads them again (`billing.late_data`). A card is
    never created or deleted over closed days."""
    late_data.mark_hours(
        datetime.combine(period.start, time(), tzinfo=UTC)
        for period in closed
        if any(
            overlap(card.valid_from, card.valid_until, period.start, period.end)
            for card in (before, after)
        )
    )


def _rate_values(card: RateCard) -> dict[str, Any]:
    return {name: getattr(card, name) for name in RATE_CARD_FIELDS}
