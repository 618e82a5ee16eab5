"""`manage.py statement --team SLUG --period 2026-11 [--format text|json] [--currency USD]`.

Prints a team's statement for a period as stored: what `run_billing` (or Celery beat) last
computed, frozen once the period is closed. Nothing is computed or written here.

JSON is one object, `{team, period, currency, lines, total}`, decimals as strings so that
finance gets exact values. A statement is per currency: a team billed in several currencies
for the period needs `--currency` for JSON (text prints them all, one table each).
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing import periods, pricing
from billing.models import SLICE_HOUR, LineKind, Period, Statement, StatementLine
from billing.units import hours_label
from inventory.models import Unit
from metering.hours import KEPT_HOURS
from teams.models import Team

HOURS = KEPT_HOURS
RATE = Decimal("0.0001")
SHARE = Decimal("0.000001")
TEAMS_NAMED = 20


class Command(BaseCommand):
    help = (
        "Print a team's statement for a period (as computed by run_billing or Celery beat): "
        "one line per model with allocated, utilised, idle and unmeasured hours of its unit "
        "(GPU-hours, TPU chip-hours, Gaudi card-hours), rate and amount, then adjustment lines, "
        "and the total."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--team", required=True, help="The team's slug.")
        parser.add_argument(
            "--period",
            required=True,
            help="A month as 2026-11, or an ISO week as 2026-W47 when TALLY_BILLING_PERIOD=week.",
        )
        parser.add_argument(
            "--format",
            choices=("text", "json"),
            default="text",
            help="text (default): a table to read; json: one object, decimals as strings.",
        )
        parser.add_argument(
            "--currency",
            help="Only the statement in this currency (needed for --format json when the team "
            "was billed in several).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            start, end = periods.parse_period(options["period"])
        except periods.PricingError as exc:
            raise CommandError(str(exc)) from exc
        label = periods.period_label(start, end)
        team = Team.objects.filter(slug=options["team"]).first()
        if team is None:
            raise CommandError(f"no team {options['team']!r}; {_known_teams()}")
        statements = self._statements(team, start, label, options["currency"])
        if options["format"] == "json":
            if len(statements) > 1:
                currencies = ", ".join(statement.currency for statement in statements)
                raise CommandError(
                    f"team {team.slug} has statements in {currencies} for {label}: "
                    "pick one with --currency"
                )
            self.stdout.write(json.dumps(statement_json(statements[0]), indent=2))
            return
        for index, statement in enumerate(statements):
            if index:
                self.stdout.write("")
            self.stdout.write(statement_text(statement))

    @staticmethod
    def _statements(
        team: Team, start: datetime, label: str, currency: str | None
    ) -> list[Statement]:
        """The team's statements for the period, or an error that says what to do."""
        period = Period.objects.filter(start=start).first()
        if period is None:
            raise CommandError(_no_period(start, label))
        statements = list(
            Statement.objects.filter(team=team, period=period)
            .select_related("team", "period")
            .order_by("currency")
        )
        if not statements:
            # A period's row is made only by a run that prices it (run_billing, beat).
            state = "closed" if period.is_closed else "open, priced as data arrives"
            raise CommandError(
                f"{team.slug} has no usage or adjustments in {label} ({state}): "
                "there is no statement to show"
            )
        if currency is None:
            return statements
        chosen = [s for s in statements if s.currency == currency.upper()]
        if not chosen:
            held = ", ".join(s.currency for s in statements)
            raise CommandError(
                f"team {team.slug} has no {currency.upper()} statement for {label}; it has {held}"
            )
        return chosen


def _no_period(start: datetime, label: str) -> str:
    """Why no period starts at `start`, and the command that makes one, if any would."""
    _, end = periods.period_bounds(start)
    if start > timezone.now():
        return f"period {label} has not started yet"
    stored = Period.objects.filter(start__lt=end, end__gt=start).order_by("start").first()
    if stored is not None:
        # run_billing would refuse too: the period length cannot change once periods are stored.
        length = periods.period_length()
        other = periods.length_of(stored.start, stored.end)
        setting = f" with TALLY_BILLING_PERIOD={other}" if other else ""
        return (
            f"no period {label}: periods here are stored as {other or 'other'}s, not "
            f"{length}s (TALLY_BILLING_PERIOD={length}), and {stored.label} ({stored}) "
            f"overlaps it; ask for {stored.label}{setting}"
        )
    return (
        f"no statements for {label} yet: run `python manage.py run_billing --period {label}` first"
    )


def _known_teams() -> str:
    slugs = list(Team.objects.order_by("slug").values_list("slug", flat=True)[: TEAMS_NAMED + 1])
    if not slugs:
        return "there are no teams yet (apply a policy file with apply_policy)"
    more = ", ..." if len(slugs) > TEAMS_NAMED else ""
    return f"teams: {', '.join(slugs[:TEAMS_NAMED])}{more}"


def _lines(statement: Statement) -> list[StatementLine]:
    """Usage lines by model, then adjustments in the order they were made."""
    lines = list(statement.lines.select_related("corrects_period"))
    return sorted(
        lines,
        key=lambda line: (
            line.kind != LineKind.USAGE,
            (line.product_name, line.profile) if line.kind == LineKind.USAGE else ("", ""),
            line.pk,
        ),
    )


def _decimal(value: Decimal | None, exponent: Decimal) -> str | None:
    return None if value is None else f"{value.quantize(exponent):f}"


def _money(value: Decimal, currency: str) -> str:
    return f"{pricing.round_money(value, currency):f}"


def statement_json(statement: Statement) -> dict[str, Any]:
    """The statement as finance reads it: every figure exact, as a string. Besides the figures
    each line carries its `idle_factor` (so `amount = rate x (allocated - (1 - idle_factor) x
    idle)` can be checked), `kind` (`usage`, or `adjustment`: late data for the closed period
    named in `corrects_period`, or a correction finance made), the MIG `profile` priced by
    its own rate card (empty otherwise), `hours`, what its hours count (`GPU-hours`, `TPU
    chip-hours`, `Gaudi card-hours`: the `*_gpu_hours` figures are hours of that unit, and
    no figure adds up hours of two units; the total is money), `unit`, what the rate is the
    price of (`GPU-hour`, `TPU chip-hour`, `Gaudi card-hour`, or for a profile's card
    `slice-hour`, an hour of one slice, whose `gpu_share` of its GPU turns the line's
    GPU-hours into slice-hours: amount = rate x (allocated - (1 - idle_factor) x idle) /
    gpu_share), and the `reason` for an adjustment or an unpriced model."""
    period = statement.period
    return {
        "team": statement.team.slug,
        "period": period.label,
        "currency": statement.currency,
        "lines": [
            {
                "product_name": line.product_name,
                "hours": line.hours_label,
                "allocated_gpu_hours": _decimal(line.allocated_gpu_hours, HOURS),
                "utilised_gpu_hours": _decimal(line.utilised_gpu_hours, HOURS),
                "idle_gpu_hours": _decimal(line.idle_gpu_hours, HOURS),
                "unmeasured_gpu_hours": _decimal(line.unmeasured_gpu_hours, HOURS),
                "rate": _decimal(line.rate, RATE),
                "amount": _money(line.amount, statement.currency),
                "idle_factor": _decimal(line.idle_factor, RATE),
                "unit": None if line.rate is None else line.rate_unit,
                "gpu_share": _decimal(line.gpu_share, SHARE),
                "kind": line.kind,
                "profile": line.profile,
                "corrects_period": line.corrects_period.label if line.corrects_period else None,
                "reason": line.reason,
            }
            for line in _lines(statement)
        ],
        "total": _money(statement.total, statement.currency),
    }


def _units(lines: list[StatementLine]) -> list[str]:
    """What the usage lines count, GPU-hours first (`Unit`'s order)."""
    units = {line.unit for line in lines if line.kind == LineKind.USAGE}
    return [hours_label(unit) for unit in Unit.values if unit in units]


def _efficiency(line: StatementLine) -> str:
    """Utilised over measured time; blank where nothing was measured (and for adjustments)."""
    measured = line.allocated_gpu_hours - line.unmeasured_gpu_hours
    if line.kind != LineKind.USAGE or measured <= 0:
        return ""
    return f"{line.utilised_gpu_hours * 100 / measured:.1f}%"


def statement_text(statement: Statement) -> str:
    """The statement as a table to read: hours per model, in the model's unit (GPU-hours, TPU
    chip-hours, Gaudi card-hours: a column says which)."""
    period = statement.period
    label = period.label
    if period.closed_at is not None:
        state = f"closed {period.closed_at:%Y-%m-%d %H:%M} UTC by {period.closed_by}: final"
    else:
        state = "open: changes as data arrives until the period is closed"
    header = [
        f"Statement: team {statement.team.slug} ({statement.team.name}), period {label} "
        f"({period.start:%Y-%m-%d}..{period.end:%Y-%m-%d} UTC), {statement.currency}",
        f"{state}; computed {statement.computed_at:%Y-%m-%d %H:%M} UTC",
        "",
    ]
    rows = [
        (
            "kind",
            "product",
            "profile",
            "hours",
            "allocated",
            "utilised",
            "idle",
            "unmeasured",
            "efficiency",
            "rate",
            "idle factor",
            "amount",
            "note",
        )
    ]
    lines = _lines(statement)
    for line in lines:
        row = (
            line.kind,
            line.product_name or "-",
            line.profile,
            line.hours_label if line.kind == LineKind.USAGE else "",
            _decimal(line.allocated_gpu_hours, HOURS) or "",
            _decimal(line.utilised_gpu_hours, HOURS) or "",
            _decimal(line.idle_gpu_hours, HOURS) or "",
            _decimal(line.unmeasured_gpu_hours, HOURS) or "",
            _efficiency(line),
            _rate(line),
            _decimal(line.idle_factor, RATE) or "",
            _money(line.amount, statement.currency),
            line.reason,
        )
        rows.append(row)
    total = _money(statement.total, statement.currency)
    rows.append(("total", "", "", "", "", "", "", "", "", "", "", total, statement.currency))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    numeric = range(4, 12)
    table = []
    for row in rows:
        cells = [
            cell.rjust(width) if column in numeric else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=False))
        ]
        table.append("  ".join([*cells, row[-1]]).rstrip())
    units = ", ".join(_units(lines)) or hours_label(Unit.GPU)
    footer = [
        "",
        f"{units}, each line in its own unit, never added up; rate per hour of the line's "
        "unit; amount = rate x (allocated - (1 - idle factor) x idle)",
    ]
    slices = sorted({(line.profile, line.gpu_share) for line in lines if line.gpu_share})
    if slices:
        shares = ", ".join(f"{profile}: {share:f}" for profile, share in slices)
        footer.append(
            "rate/slice-h: the price of an hour of one MIG slice; amount = rate x (allocated - "
            f"(1 - idle factor) x idle) / the slice's share of its GPU ({shares})"
        )
    return "\n".join(header + table + footer)


def _rate(line: StatementLine) -> str:
    """The rate, marked `/slice-h` when it is the price of an hour of one MIG slice, and with
    its unit when that is not a GPU (`/TPU chip-h`)."""
    if line.rate is None:
        return "-"
    rate = _decimal(line.rate, RATE)
    if line.rate_unit == SLICE_HOUR:
        return f"{rate}/slice-h"
    return str(rate) if line.unit == Unit.GPU else f"{rate}/{line.rate_unit.removesuffix('our')}"
