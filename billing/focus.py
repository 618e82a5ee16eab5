"""A FOCUS 1.2 export of what the statements bill (issue 39): for finance's cost tools.

One row per team, model (and MIG profile), price, day and holder (cluster, namespace, job
and person, the row's Tags) of usage, and one row per adjustment line. Each usage row's
BilledCost is its part of a statement line's amount, shared out to the cent by largest
remainders (`billing.selectors.apportion`), so the rows of a line add up to the line and
the rows of a period add up to its statements exactly:

- a closed period wholly in the window is its frozen statements: each frozen usage line's
  hours and amount shared out among its holders by their usage now (a frozen line that no
  usage row has any more is one row for the whole period), and usage no frozen line billed
  left out (late data, billed as an adjustment of a later period);
- other periods, or parts of periods, are priced as the statements price them
  (`billing.pricing`: per model and rate card, exact, rounded once per line);
- the adjustment lines of the statements of the periods wholly in the window are rows of
  their own (`Adjustment`; a correction of a closed period's late data is a `Correction`).

The columns, their types, nullability and allowed values are `billing.focus_columns`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from django.conf import settings
from django.db.models import F, Sum
from django.db.models.functions import TruncDate

from billing.focus_columns import COLUMN_NAMES
from billing.models import SLICE_HOUR, LineKind, Period, RateCard, StatementLine
from billing.periods import period_bounds, period_label
from billing.pricing import (
    LineFigures,
    LineKey,
    RateCards,
    frozen_usage_lines,
    line_key,
    rate_hours,
    round_money,
)
from billing.rounding import apportion, largest_remainders, minor_unit
from billing.selectors import period_pieces, stored_periods
from billing.units import hours_label
from metering.hours import MS_PER_HOUR, ONE_MS, idle_of
from metering.models import UsageHour
from teams.models import Team

# The one billing account; who provides, publishes and invoices the service is the setting
# TALLY_FOCUS_PROVIDER_NAME (the organisation that charges back; "Tally" unless set).
BILLING_ACCOUNT_ID = "tally"
SERVICE_NAME = "Kubernetes accelerators"
SERVICE_CATEGORY, SERVICE_SUBCATEGORY = "Compute", "Containers"
TAG_PREFIX = "tally/"
HOURS_PLACES = Decimal("0.000001")

FocusRow = dict[str, str | None]
# Who a usage row is charged to within a line: day, cluster, namespace, job, person, profile.
_Holder = tuple[date, str, str, str, str, str]
# One figure per holder: allocated, utilised and unmeasured milliseconds.
_Figures = list[int]


@dataclass(frozen=True)
class _Line:
    """A statement line of one team in one piece of the window (a period, or the part of one
    in the window)."""

    team_id: int
    piece: tuple[datetime, datetime]
    key: LineKey


def focus_rows(*, teams: Iterable[Team], since: datetime, until: datetime) -> list[FocusRow]:
    """The FOCUS rows of the teams' billed usage in `[since, until)` and of the adjustments
    of their statements of the periods wholly in it, in `billing.focus_columns` order, each
    value as text (None: null). Per team, billing period and currency, BilledCost adds up to
    the statement's total for a period wholly in the window (closed: exactly the frozen one;
    open: as a refresh would compute it now).

    Four queries (periods, frozen lines, rate cards, usage) plus one for the adjustments."""
    by_id = {team.pk: team for team in teams}
    periods = stored_periods(since, until)
    pieces = period_pieces(since, until, periods=periods)
    whole = [period for period in periods if (period.start, period.end) in pieces]
    closed = [period for period in whole if period.is_closed]
    frozen = frozen_usage_lines(periods=closed, team_ids=by_id)
    cards = RateCards(
        first_day=since.astimezone(UTC).date(), last_day=(until - ONE_MS).astimezone(UTC).date()
    )
    usage = _usage(team_ids=list(by_id), since=since, until=until, pieces=pieces, cards=cards)
    rows: list[FocusRow] = []
    closed_starts = {period.start for period in closed}
    for line, holders in usage.items():
        frozen_line = frozen.pop((line.team_id, line.piece[0], line.key), None)
        if line.piece[0] in closed_starts and frozen_line is None:
            continue  # not in the closed period's statement: billed later, as an adjustment
        rows += _usage_rows(
            by_id[line.team_id], line, holders, frozen_line, cards=cards, periods=periods
        )
    for (team_id, start, key), frozen_line in frozen.items():
        # A frozen line no usage row has any more: one row for its whole period.
        piece = next(piece for piece in pieces if piece[0] == start)
        line = _Line(team_id=team_id, piece=piece, key=key)
        rows += _usage_rows(by_id[team_id], line, {}, frozen_line, cards=cards, periods=periods)
    rows += [_adjustment_row(line) for line in _adjustments(by_id, whole)]
    rows.sort(key=_row_order)
    return rows


def _usage(
    *,
    team_ids: list[int],
    since: datetime,
    until: datetime,
    pieces: list[tuple[datetime, datetime]],
    cards: RateCards,
) -> dict[_Line, dict[_Holder, _Figures]]:
    """The window's usage rows per statement line (a team's model at one price in one piece of
    the window, as `billing.pricing` makes lines) and holder, in one query."""
    rows = (
        UsageHour.objects.filter(team_id__in=team_ids, hour__gte=since, hour__lt=until)
        .annotate(day=TruncDate("hour", tzinfo=UTC))
        .values(
            "team_id",
            "day",
            "namespace",
            "job",
            "username",
            "product_name",
            "profile",
            "unit",
            cluster_name=F("cluster__name"),
            device_share=F("allocation__device_share"),
        )
        .annotate(
            allocated=Sum("allocated_gpu_ms"),
            utilised=Sum("utilised_gpu_ms"),
            unmeasured=Sum("unmeasured_gpu_ms"),
        )
        .order_by()
    )
    usage: dict[_Line, dict[_Holder, _Figures]] = defaultdict(dict)
    for row in rows:
        card = cards.on(row["product_name"], row["profile"], row["day"])
        key = line_key(row, card)
        # Periods start at midnight UTC, so a day's hours are in one piece of the window.
        moment = max(since, _midnight(row["day"]))
        piece = next(piece for piece in pieces if piece[0] <= moment < piece[1])
        holder = (
            row["day"],
            row["cluster_name"],
            row["namespace"],
            row["job"],
            row["username"],
            row["profile"],
        )
        figures = usage[_Line(team_id=row["team_id"], piece=piece, key=key)].setdefault(
            holder, [0, 0, 0]
        )
        figures[0] += row["allocated"]
        figures[1] += row["utilised"]
        figures[2] += row["unmeasured"]
    return usage


def _usage_rows(
    team: Team,
    line: _Line,
    holders: Mapping[_Holder, _Figures],
    frozen: LineFigures | None,
    *,
    cards: RateCards,
    periods: list[Period],
) -> list[FocusRow]:
    """A line's rows, one per holder: its usage priced and rounded once as the statements
    price it (or a frozen line's hours and amount), shared out among the holders."""
    product, line_profile, unit, currency, rate, idle_factor, share = line.key
    exact = {
        holder: _exact_amount(figures, rate=rate, idle_factor=idle_factor, share=share)
        for holder, figures in holders.items()
    }
    if frozen is not None:
        total = frozen.amount
    else:
        total = round_money(sum(exact.values(), Fraction(0)), currency)
    hours = _line_hours(holders, frozen)
    billed = _shared(total, exact, {h: Fraction(f[0]) for h, f in holders.items()}, currency)
    period_start, period_end = _billing_period(line.piece[0], periods)
    common = {
        "BillingCurrency": currency,
        "BillingPeriodStart": _moment(period_start),
        "BillingPeriodEnd": _moment(period_end),
        "ChargeCategory": "Usage",
        "ChargeClass": None,
        "ChargeFrequency": "Usage-Based",
        "InvoiceId": _invoice_id(team, period_start, period_end, currency),
        "ListUnitPrice": _number(rate or Decimal(0)),
        "ContractedUnitPrice": _number(rate or Decimal(0)),
        "PricingCategory": "Standard" if rate is not None else "Other",
        "PricingUnit": "Slice-Hours" if share else _focus_unit(hours_label(unit)),
        "ConsumedUnit": _focus_unit(hours_label(unit)),
        "SkuMeter": f"Allocated {_focus_unit(hours_label(unit))}",
        "SkuPriceDetails": _price_details(idle_factor, share),
        "x_IdleFactor": _number(idle_factor) if idle_factor is not None else None,
        "x_CorrectsPeriod": None,
    }
    if not holders:
        assert frozen is not None
        line_sku = f"{product} {line_profile}".strip()
        return [
            _row(
                team,
                **common,
                **_quantities(
                    allocated=frozen.allocated,
                    utilised=frozen.utilised,
                    unmeasured=frozen.unmeasured,
                    rate=rate,
                    share=share,
                    currency=currency,
                ),
                BilledCost=_money(total, currency),
                ChargeDescription=_usage_description(line.key, line_sku),
                ChargePeriodStart=_moment(line.piece[0]),
                ChargePeriodEnd=_moment(line.piece[1]),
                SkuId=line_sku,
                SkuPriceId=_price_id(
                    cards.on(product, line_profile, line.piece[0].date()), line_sku
                ),
                Tags=None,
                **_resource(None),
            )
        ]
    rows = []
    for holder, (allocated, utilised, unmeasured) in hours.items():
        day, cluster, namespace, job, username, profile = holder
        sku = f"{product} {profile}".strip()
        day_start = _midnight(day)
        rows.append(
            _row(
                team,
                **common,
                **_quantities(
                    allocated=allocated,
                    utilised=utilised,
                    unmeasured=unmeasured,
                    rate=rate,
                    share=share,
                    currency=currency,
                ),
                BilledCost=_money(billed[holder], currency),
                ChargeDescription=_usage_description(line.key, sku),
                ChargePeriodStart=_moment(max(day_start, line.piece[0])),
                ChargePeriodEnd=_moment(min(day_start + timedelta(days=1), line.piece[1])),
                SkuId=sku,
                SkuPriceId=_price_id(cards.on(product, profile, day), sku),
                Tags=_tags(cluster=cluster, namespace=namespace, job=job, person=username),
                **_resource((cluster, namespace, job)),
            )
        )
    return rows


def _line_hours(
    holders: Mapping[_Holder, _Figures], frozen: LineFigures | None
) -> dict[_Holder, tuple[Decimal, Decimal, Decimal]]:
    """The line's hours (allocated, utilised, unmeasured; a frozen line's as frozen, else its
    usage's, rounded to the microhour as a statement line keeps them) shared out among the
    holders in proportion to their milliseconds, by largest remainders: each row's hours are
    whole microhours, and a line's rows add up to the line's hours exactly. Empty without
    holders (a frozen line no usage row has now is one row of its own hours)."""
    if not holders:
        return {}
    shared: dict[_Holder, list[Decimal]] = {holder: [] for holder in holders}
    for index in range(3):
        if frozen is not None:
            line_hours = (frozen.allocated, frozen.utilised, frozen.unmeasured)[index]
        else:
            ms = sum(figures[index] for figures in holders.values())
            line_hours = _hours(Decimal(ms) / MS_PER_HOUR)
        micro = int(line_hours / HOURS_PLACES)
        weights = {holder: Fraction(figures[index]) for holder, figures in holders.items()}
        for holder, part in _whole_parts(micro, weights).items():
            shared[holder].append(part * HOURS_PLACES)
    return {holder: (figures[0], figures[1], figures[2]) for holder, figures in shared.items()}


def _whole_parts(total: int, weights: Mapping[_Holder, Fraction]) -> dict[_Holder, int]:
    """`total` in whole units shared in proportion to `weights` (equally when they are all
    zero), adding up to it exactly."""
    whole = sum(weights.values(), Fraction(0))
    if not whole:
        weights = dict.fromkeys(weights, Fraction(1))
        whole = Fraction(len(weights))
    sign = -1 if total < 0 else 1
    parts = {key: weight * abs(total) / whole for key, weight in weights.items()}
    return {key: sign * part for key, part in largest_remainders(parts, abs(total)).items()}


def _shared(
    total: Decimal,
    exact: Mapping[_Holder, Fraction],
    allocated: Mapping[_Holder, Fraction],
    currency: str,
) -> dict[_Holder, Decimal]:
    """A line's rounded `total` shared out to the cent in proportion to the holders' exact
    amounts (by their allocated time when those are all zero: a frozen line whose usage now
    prices to nothing), adding up to it exactly."""
    if not exact:
        return {}
    weights = exact if any(exact.values()) else allocated
    if not any(weights.values()):
        weights = dict.fromkeys(weights, Fraction(1))
    whole = sum(weights.values(), Fraction(0))
    return apportion(
        total,
        {holder: weight * Fraction(total) / whole for holder, weight in weights.items()},
        currency,
    )


def _exact_amount(
    figures: _Figures, *, rate: Decimal | None, idle_factor: Decimal | None, share: Decimal | None
) -> Fraction:
    """What `billing.pricing` bills for these milliseconds before rounding: rate x (allocated
    - (1 - idle factor) x idle), in hours of what the rate prices."""
    if rate is None or idle_factor is None:
        return Fraction(0)
    allocated, utilised, unmeasured = figures
    idle = idle_of(allocated, utilised, unmeasured)
    billable = rate_hours(allocated, share) - (1 - Fraction(idle_factor)) * rate_hours(idle, share)
    return Fraction(rate) * billable


def _quantities(
    *,
    allocated: Decimal,
    utilised: Decimal,
    unmeasured: Decimal,
    rate: Decimal | None,
    share: Decimal | None,
    currency: str,
) -> FocusRow:
    """The hours columns, and the list and contracted cost of the allocated hours at the rate
    card's price (before the idle factor's discount, which BilledCost has)."""
    pricing_quantity = _hours(allocated / share if share else allocated)
    list_cost = round_money(Fraction(rate or 0) * Fraction(pricing_quantity), currency)
    return {
        "ConsumedQuantity": _number(_hours(allocated)),
        "PricingQuantity": _number(pricing_quantity),
        "ListCost": _money(list_cost, currency),
        "ContractedCost": _money(list_cost, currency),
        "x_AllocatedHours": _number(_hours(allocated)),
        "x_UtilisedHours": _number(_hours(utilised)),
        "x_IdleHours": _number(_hours(idle_of(allocated, utilised, unmeasured))),
        "x_UnmeasuredHours": _number(_hours(unmeasured)),
    }


def _adjustments(by_id: Mapping[int, Team], periods: list[Period]) -> list[StatementLine]:
    return list(
        StatementLine.objects.filter(
            kind=LineKind.ADJUSTMENT,
            statement__team_id__in=list(by_id),
            statement__period__in=periods,
        )
        .select_related("statement__team", "statement__period", "corrects_period")
        .order_by("pk")
    )


def _adjustment_row(line: StatementLine) -> FocusRow:
    """An adjustment line as one row: a correction of a closed period's late data (its hours
    the difference), or finance's own. Neither is usage, so neither has consumed or pricing
    quantities (the specification's nullability), and its costs are its amount."""
    statement, period, corrected = line.statement, line.statement.period, line.corrects_period
    amount = _money(line.amount, line.statement.currency)
    charged = corrected or period
    return _row(
        statement.team,
        BilledCost=amount,
        EffectiveCost=amount,
        ListCost=amount,
        ContractedCost=amount,
        BillingCurrency=statement.currency,
        BillingPeriodStart=_moment(period.start),
        BillingPeriodEnd=_moment(period.end),
        ChargeCategory="Adjustment",
        ChargeClass="Correction" if corrected is not None else None,
        ChargeDescription=line.reason or None,
        ChargeFrequency="One-Time",
        ChargePeriodStart=_moment(charged.start),
        ChargePeriodEnd=_moment(charged.end),
        InvoiceId=_invoice_id(statement.team, period.start, period.end, statement.currency),
        ListUnitPrice=None,
        ContractedUnitPrice=None,
        PricingCategory=None,
        PricingQuantity=None,
        PricingUnit=None,
        ConsumedQuantity=None,
        ConsumedUnit=None,
        SkuId=(f"{line.product_name} {line.profile}".strip() or None),
        SkuMeter=f"Allocated {_focus_unit(hours_label(line.unit))}" if line.product_name else None,
        SkuPriceId=None,
        SkuPriceDetails=None,
        Tags=None,
        x_AllocatedHours=_number(line.allocated_gpu_hours),
        x_UtilisedHours=_number(line.utilised_gpu_hours),
        x_IdleHours=_number(line.idle_gpu_hours),
        x_UnmeasuredHours=_number(line.unmeasured_gpu_hours),
        x_IdleFactor=_number(line.idle_factor) if line.idle_factor is not None else None,
        x_CorrectsPeriod=corrected.label if corrected is not None else None,
        **_resource(None),
    )


def _row(team: Team, **values: str | None) -> FocusRow:
    """A row in column order: `values`, the team's sub-account, and what every row has."""
    provider = settings.TALLY_FOCUS_PROVIDER_NAME
    values = {
        "BillingAccountId": BILLING_ACCOUNT_ID,
        "BillingAccountName": provider,
        "InvoiceIssuerName": provider,
        "ProviderName": provider,
        "PublisherName": provider,
        "ServiceName": SERVICE_NAME,
        "ServiceCategory": SERVICE_CATEGORY,
        "ServiceSubcategory": SERVICE_SUBCATEGORY,
        "SubAccountId": team.slug,
        "SubAccountName": team.name,
        "SubAccountType": "Team",
        "RegionId": None,
        "RegionName": None,
        "CommitmentDiscountCategory": None,
        "CommitmentDiscountId": None,
        "CommitmentDiscountName": None,
        "CommitmentDiscountQuantity": None,
        "CommitmentDiscountStatus": None,
        "CommitmentDiscountType": None,
        "CommitmentDiscountUnit": None,
        **values,
    }
    values.setdefault("EffectiveCost", values["BilledCost"])
    missing = set(COLUMN_NAMES) - set(values)
    extra = set(values) - set(COLUMN_NAMES)
    assert not missing and not extra, f"FOCUS row columns: missing {missing}, unknown {extra}"
    return {name: values[name] for name in COLUMN_NAMES}


def _resource(place: tuple[str, str, str] | None) -> FocusRow:
    """ResourceId, ResourceName and ResourceType of usage in a cluster's namespace: the job
    (`Kind/name`, the claims' owner), else the namespace; all null without a place."""
    if place is None:
        return {"ResourceId": None, "ResourceName": None, "ResourceType": None}
    cluster, namespace, job = place
    kind, _, name = job.partition("/")
    if job and name:
        return {
            "ResourceId": f"{cluster}/{namespace}/{job}",
            "ResourceName": name,
            "ResourceType": kind,
        }
    return {
        "ResourceId": f"{cluster}/{namespace}",
        "ResourceName": namespace,
        "ResourceType": "Namespace",
    }


def _tags(**tags: str) -> str:
    """Tally's tags of a row as the specification's key-value format (a JSON object), each
    key under Tally's prefix, empty ones left out."""
    return json.dumps(
        {f"{TAG_PREFIX}{key}": value for key, value in tags.items() if value}, sort_keys=True
    )


def _price_details(idle_factor: Decimal | None, share: Decimal | None) -> str | None:
    """SkuPriceDetails: Tally's own properties of the price (`x_` prefixed), the share of the
    rate idle hours pay and, for a slice's own card, the slice's share of its GPU."""
    if idle_factor is None:
        return None
    details: dict[str, float] = {"x_IdleFactor": float(idle_factor)}
    if share:
        details["x_SliceShareOfGpu"] = float(share)
    return json.dumps(details, sort_keys=True)


def _price_id(card: RateCard | None, sku: str) -> str:
    """The rate card that priced the row (the rate cards API lists them by id); `unpriced:`
    and the SKU where no card prices it (billed at zero)."""
    return f"rate-card-{card.pk}" if card is not None else f"unpriced:{sku}"


def _usage_description(key: LineKey, sku: str) -> str:
    _, _, unit, currency, rate, idle_factor, share = key
    if rate is None or idle_factor is None:
        return f"{sku}: {hours_label(unit)}, no rate card (billed at zero)"
    per = SLICE_HOUR if share else hours_label(unit).removesuffix("s")
    return (
        f"{sku}: {hours_label(unit)} at {rate} {currency}/{per}, idle hours at "
        f"{(idle_factor * 100).normalize():f}% of the rate"
    )


def _invoice_id(team: Team, start: datetime, end: datetime, currency: str) -> str:
    """The statement a row is billed on: one per team, period and currency."""
    return f"{period_label(start, end)}/{team.slug}/{currency}"


def _billing_period(start: datetime, periods: list[Period]) -> tuple[datetime, datetime]:
    """The bounds of the billing period that holds `start`: the stored one, else the period
    TALLY_BILLING_PERIOD makes (not stored yet)."""
    for period in periods:
        if period.start <= start < period.end:
            return period.start, period.end
    return period_bounds(start)


def _focus_unit(label: str) -> str:
    """A unit as the specification's Unit Format writes it: `GPU-hours` -> `GPU-Hours`,
    `TPU chip-hours` -> `TPU Chip-Hours` (each word capitalised, acronyms kept)."""
    return " ".join(
        "-".join(part[:1].upper() + part[1:] for part in word.split("-"))
        for word in label.split(" ")
    )


def _hours(value: Decimal) -> Decimal:
    return value.quantize(HOURS_PLACES, rounding=ROUND_HALF_UP)


def _money(value: Decimal, currency: str) -> str:
    """An amount to its currency's minor unit (stored amounts keep three places)."""
    return _number(value.quantize(minor_unit(currency)))


def _number(value: Decimal) -> str:
    """A decimal in the specification's Numeric Format: no exponent, no plus sign."""
    return f"{value:f}"


def _moment(moment: datetime) -> str:
    """A date/time in the specification's format: ISO 8601 in UTC, `YYYY-MM-DDTHH:mm:ssZ`."""
    return f"{moment.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def _row_order(row: FocusRow) -> tuple[str, ...]:
    return tuple(
        row[name] or ""
        for name in (
            "BillingPeriodStart",
            "SubAccountId",
            "BillingCurrency",
            "ChargeCategory",
            "ChargePeriodStart",
            "SkuId",
            "ResourceId",
            "Tags",
        )
    )
