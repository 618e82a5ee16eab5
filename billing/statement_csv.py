"""A statement as CSV: one writer for the portal's download and the API's `?format=csv` of a
statement, so both give the same columns, in the same order, with the same numbers (issue 35:
they used to differ).

One row per statement line, in the statement's order (currency, kind, model, profile). Hours
and prices as stored (exact decimals), amounts rounded once to the currency's minor unit; cells
through `teams.api.write_csv`, which neutralises spreadsheet formulas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.db.models import QuerySet

from billing.models import StatementLine
from billing.pricing import round_money
from teams.api import write_csv

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

STATEMENT_CSV_COLUMNS = (
    "team",
    "period_label",
    "period_start",
    "currency",
    "kind",
    "product_name",
    "profile",
    "allocated_gpu_hours",
    "utilised_gpu_hours",
    "idle_gpu_hours",
    "unmeasured_gpu_hours",
    "rate",
    "idle_factor",
    "amount",
    "reason",
    "unit",  # what `rate` is the price of: a GPU-hour (TPU chip-hour...), or a MIG slice-hour
    "gpu_share",  # for a price per slice-hour: the slice's share of its GPU
    "hours",  # what the line's hours count: GPU-hours, TPU chip-hours, Gaudi card-hours
)


def statement_lines(lines: QuerySet[StatementLine]) -> QuerySet[StatementLine]:
    """`lines` in a statement's order, with what a row shows of their statement."""
    return lines.select_related("statement__team", "statement__period").order_by(
        "statement__currency", "kind", "product_name", "profile", "pk"
    )


def _blank_none(value: Any) -> str:
    return "" if value is None else str(value)


def statement_row(line: StatementLine) -> list[str]:
    """One line as the cells of `STATEMENT_CSV_COLUMNS`."""
    statement = line.statement
    return [
        statement.team.slug,
        statement.period.label,
        statement.period.start.date().isoformat(),
        statement.currency,
        line.kind,
        line.product_name,
        line.profile,
        str(line.allocated_gpu_hours),
        str(line.utilised_gpu_hours),
        str(line.idle_gpu_hours),
        str(line.unmeasured_gpu_hours),
        _blank_none(line.rate),
        _blank_none(line.idle_factor),
        f"{round_money(line.amount, statement.currency):f}",
        line.reason,
        "" if line.rate is None else line.rate_unit,
        _blank_none(line.gpu_share),
        line.hours_label,
    ]


def write_statement_csv(out: SupportsWrite[str], lines: Iterable[StatementLine]) -> None:
    """The CSV of `lines` (from `statement_lines`): a header, then a row per line."""
    write_csv(out, columns=STATEMENT_CSV_COLUMNS, rows=(statement_row(line) for line in lines))


def statement_csv_filename(*, team_slug: str, period_label: str, currency: str = "") -> str:
    """The download's name: the team and period, and the currency for one statement of
    several."""
    return f"tally-{team_slug}-{period_label}{f'-{currency}' if currency else ''}.csv"
