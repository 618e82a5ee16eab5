"""Finance's home page and its close action (issue 35, finding 7).

The home page: each team's spend in the open period and the last one, each period's state and
closing day, a trend over the last `TREND_PERIODS` periods (a table with inline bars, and its
CSV), and a button that closes an ended period. Finance is not staff, so before this it could
close a period only through the API: the button leads to a confirmation page that says what
will be frozen, whose form (a POST with Django's CSRF token) calls the API's service,
`billing.services.close_period`, which audits the close. Only finance closes here; operators
have the admin's action and the API.

Spend is what the statements say (refreshed by beat every few minutes for the open period,
frozen for a closed one), so the page agrees with the team pages, the statement CSVs and
`/api/v1/statements/`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Max, Min, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods

from billing.models import Period, Statement
from billing.periods import PricingError
from billing.pricing import period_holding, round_money
from billing.services import close_due_at, close_period
from frontend import selectors
from frontend.views import csv_attachment, forbidden, not_found
from teams.models import Team

# The periods the trend shows, the open one included.
TREND_PERIODS = 6
FINANCE = "finance"
TREND_CSV_COLUMNS = (
    "period",
    "start",
    "end",
    "state",
    "closed_at",
    "closes_on",
    "currency",
    "total",
    "teams_billed",
)


@dataclass
class PeriodSpend:
    """One billing period as finance sees it: its state, when it closes (or closed), and what
    its statements total per currency."""

    start: datetime
    end: datetime
    label: str
    stored: Period | None  # None: nothing was billed in it yet (no row)
    now: datetime
    totals: dict[str, Decimal] = field(default_factory=dict)  # currency -> total, rounded
    teams_billed: int = 0
    as_of: datetime | None = None  # the oldest statement's computation, for an open period
    # currency -> the bar's length in percent of the trend's largest total in that currency
    bars: dict[str, Decimal] = field(default_factory=dict)
    # (currency, total or None, bar or None) for every currency of the trend, in order
    columns: list[tuple[str, Decimal | None, Decimal | None]] = field(default_factory=list)

    @property
    def is_closed(self) -> bool:
        return self.stored is not None and self.stored.is_closed

    @property
    def state(self) -> str:
        """`closed`, `open`, or `not billed`: an ended period nothing was billed in (no row,
        nothing to close)."""
        if self.is_closed:
            return "closed"
        return "not billed" if self.stored is None and self.has_ended else "open"

    @property
    def has_ended(self) -> bool:
        return self.end <= self.now

    @property
    def closed_at(self) -> datetime | None:
        return self.stored.closed_at if self.stored is not None else None

    @property
    def closed_by(self) -> str:
        return self.stored.closed_by if self.stored is not None else ""

    @property
    def closes_on(self) -> datetime | None:
        """When beat closes it (TALLY_CLOSE_PERIOD_DAY of the next period); None when closed,
        when it was never billed and has ended, or when closing is turned off."""
        if self.is_closed or (self.stored is None and self.has_ended):
            return None
        return close_due_at(self.end)

    @property
    def may_close(self) -> bool:
        """Ended, billed and still open: what `close_period` accepts."""
        return self.stored is not None and not self.is_closed and self.has_ended


def recent_periods(*, now: datetime, count: int = TREND_PERIODS) -> list[PeriodSpend]:
    """The period holding `now` and the `count - 1` before it, newest first: the stored
    periods where there are some (whatever their length), else the configured length's
    windows, unsaved (reading a page creates no period). One query per period."""
    periods = []
    moment = now
    for _ in range(count):
        period = period_holding(moment)
        periods.append(
            PeriodSpend(
                start=period.start,
                end=period.end,
                label=period.label,
                stored=period if period.pk is not None else None,
                now=now,
            )
        )
        moment = period.start - timedelta(microseconds=1)
    return periods


def with_totals(periods: list[PeriodSpend]) -> list[PeriodSpend]:
    """`periods` with their statements' totals per currency (each total rounded to the
    currency's minor unit, as statements show it), the teams they bill, and the bars: each
    total against the largest of its currency. One query."""
    stored = {period.stored.pk: period for period in periods if period.stored is not None}
    rows = (
        Statement.objects.filter(period_id__in=stored)
        .values("period_id", "currency")
        .annotate(
            total=Sum("total"), teams=Count("team_id", distinct=True), as_of=Min("computed_at")
        )
        .order_by("period_id", "currency")
    )
    for row in rows:
        period = stored[row["period_id"]]
        period.totals[row["currency"]] = round_money(row["total"], row["currency"])
        period.teams_billed = max(period.teams_billed, row["teams"])
        if period.as_of is None or row["as_of"] < period.as_of:
            period.as_of = row["as_of"]
    largest: dict[str, Decimal] = defaultdict(Decimal)
    for period in periods:
        for currency, total in period.totals.items():
            largest[currency] = max(largest[currency], total)
    for period in periods:
        period.bars = {
            currency: (total * 100 / largest[currency]).quantize(Decimal("0.1"))
            if largest[currency] > 0
            else Decimal(0)
            for currency, total in period.totals.items()
        }
        period.columns = [
            (currency, period.totals.get(currency), period.bars.get(currency))
            for currency in sorted(largest)
        ]
    return periods


@dataclass(frozen=True)
class TeamSpend:
    """A team's statement totals in the open and the last period, per currency."""

    team: Team
    open: dict[str, Decimal]
    last: dict[str, Decimal]


def team_spend(
    *, teams: list[Team], open_period: PeriodSpend, last: PeriodSpend
) -> list[TeamSpend]:
    """Each of `teams` with its totals in the two periods ({} where it has no statement).
    One query."""
    ids = [period.stored.pk for period in (open_period, last) if period.stored is not None]
    totals: dict[tuple[int, int], dict[str, Decimal]] = defaultdict(dict)
    for statement in Statement.objects.filter(period_id__in=ids).values(
        "team_id", "period_id", "currency", "total"
    ):
        totals[statement["team_id"], statement["period_id"]][statement["currency"]] = round_money(
            statement["total"], statement["currency"]
        )

    def of(team: Team, period: PeriodSpend) -> dict[str, Decimal]:
        if period.stored is None:
            return {}
        return dict(sorted(totals.get((team.pk, period.stored.pk), {}).items()))

    return [TeamSpend(team, of(team, open_period), of(team, last)) for team in teams]


def finance_home(request: HttpRequest, teams: list[Team]) -> HttpResponse:
    """The home page of finance (`frontend.views.home` hands it on)."""
    periods = with_totals(recent_periods(now=timezone.now()))
    open_period, last = periods[0], periods[1]
    context = {
        "role": FINANCE,
        "teams": teams,
        "periods": periods,
        "open_period": open_period,
        "last_period": last,
        "spend": team_spend(teams=teams, open_period=open_period, last=last),
        "currencies": sorted({currency for period in periods for currency in period.totals}),
        # Older ended periods still open (beat closes only the last one on its day).
        "closable": [period for period in periods if period.may_close],
    }
    return render(request, "frontend/finance_home.html", context)


def _finance_only(request: HttpRequest) -> HttpResponse | None:
    if selectors.portal_role(request.user) != FINANCE:
        return forbidden(
            request,
            "Only finance closes billing periods in the portal; operators close them in the "
            "admin or with POST /api/v1/periods/{id}/close/.",
        )
    return None


@login_required
@require_GET
def trend_csv(request: HttpRequest) -> HttpResponse:
    """The trend table as CSV: one row per period and currency (a period with no statement
    yet: one row with no currency and a total of 0)."""
    if (refused := _finance_only(request)) is not None:
        return refused
    periods = with_totals(recent_periods(now=timezone.now()))
    rows: list[list[str]] = []
    for period in periods:
        common = [
            period.label,
            f"{period.start:%Y-%m-%dT%H:%M:%SZ}",
            f"{period.end:%Y-%m-%dT%H:%M:%SZ}",
            period.state,
            "" if period.closed_at is None else f"{period.closed_at:%Y-%m-%dT%H:%M:%SZ}",
            "" if period.closes_on is None else f"{period.closes_on:%Y-%m-%d}",
        ]
        for currency, total in period.totals.items() or [("", Decimal(0))]:
            rows.append([*common, currency, f"{total:f}", str(period.teams_billed)])
    return csv_attachment("tally-spend-trend.csv", TREND_CSV_COLUMNS, rows)


@login_required
@require_http_methods(["GET", "POST"])
def close(request: HttpRequest, period_id: int) -> HttpResponse:
    """GET: what closing the period freezes, each team's statements as they stand, and a
    button; POST (CSRF-checked by Django's middleware): `close_period`, audited as the user,
    then back home saying what was done or why not."""
    if (refused := _finance_only(request)) is not None:
        return refused
    period = Period.objects.filter(pk=period_id).first()
    if period is None:
        return not_found(request)
    if request.method == "POST":
        try:
            statements = close_period(period=period, actor=request.user.get_username())
        except PricingError as exc:
            messages.error(request, f"Period {period.label} was not closed: {exc}.")
            return redirect(reverse("home") + "#periods-heading")
        frozen = f"{len(statements)} statement{'s' if len(statements) != 1 else ''}"
        messages.success(
            request, f"Closed {period.label}: {frozen} frozen, by {request.user.get_username()}."
        )
        return redirect(reverse("home") + "#periods-heading")
    now = timezone.now()
    statements = list(
        Statement.objects.filter(period=period)
        .select_related("team")
        .order_by("team__name", "team__slug", "currency")
    )
    for statement in statements:
        statement.total = round_money(statement.total, statement.currency)
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for statement in statements:
        totals[statement.currency] += statement.total
    refusal = ""
    if period.is_closed:
        by = period.closed_by or "—"
        refusal = f"It was closed on {period.closed_at:%Y-%m-%d %H:%M} UTC by {by}."
    elif period.end > now:
        refusal = f"It has not ended yet: it ends {period.end:%Y-%m-%d %H:%M} UTC."
    context: dict[str, Any] = {
        "period": period,
        "statements": statements,
        "totals": dict(sorted(totals.items())),
        "last_computed": Statement.objects.filter(period=period).aggregate(at=Max("computed_at"))[
            "at"
        ],
        "closes_on": None if period.is_closed else close_due_at(period.end),
        "now": now,
        "refusal": refusal,
    }
    return render(request, "frontend/period_close.html", context, status=400 if refusal else 200)
