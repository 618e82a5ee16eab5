"""`/api/v1/billed/focus/`: the FOCUS 1.2 export of a period or a window (`billing.focus`),
for finance and operators. JSON is the list of rows; CSV (`?format=csv` or `Accept:
text/csv`) the same rows under a header of the columns, as a download. Not paged: a
period's rows add up to its statements only all together.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from billing.api.serializers import BilledWindowSerializer
from billing.focus import FocusRow, focus_rows
from billing.focus_columns import COLUMNS, DATE_TIME, DECIMAL, FOCUS_VERSION, JSON, FocusColumn
from billing.periods import period_label
from teams.api import FinanceOrOperator, TallyViewSet
from teams.models import Team

FOCUS_VERSION_HEADER = "X-Focus-Version"


class FocusQuerySerializer(BilledWindowSerializer):
    """The export's window: `period` (`2026-11`), or `start`/`end`; the current period when
    neither is given. `team` narrows it to one team (its slug)."""

    # The billed-usage endpoints' row filters, removed (DRF's way: None): a FOCUS dataset is
    # every row of its window.
    username = None  # type: ignore[assignment]
    namespace = None  # type: ignore[assignment]
    job = None  # type: ignore[assignment]
    unit = None  # type: ignore[assignment]
    currency = None  # type: ignore[assignment]
    ordering = serializers.CharField(
        required=False,
        help_text="Columns to sort the rows by, comma-separated (a leading '-' for descending); "
        "by default by billing period, team, currency, category and day.",
    )

    def validate_ordering(self, ordering: str) -> list[str]:
        terms = [term.strip() for term in ordering.split(",") if term.strip()]
        for term in terms:
            if term.removeprefix("-") not in COLUMN_TYPES:
                raise serializers.ValidationError(
                    f"cannot order by {term.removeprefix('-')!r}: order by one of "
                    f"{', '.join(COLUMN_TYPES)} (a leading '-' for descending)"
                )
        return terms

    def validate_team(self, slug: str) -> str:
        if not Team.objects.filter(slug=slug).exists():
            raise serializers.ValidationError(f"No team {slug!r}.")
        return slug


COLUMN_TYPES = {column.name: column.data_type for column in COLUMNS}


def ordered(rows: list[FocusRow], terms: list[str]) -> list[FocusRow]:
    """`rows` sorted by the columns `terms` name (`-` descending; nulls last either way),
    Decimal columns as numbers."""
    for term in reversed(terms):
        name = term.removeprefix("-")
        present = [row for row in rows if row[name] is not None]
        missing = [row for row in rows if row[name] is None]
        number = COLUMN_TYPES[name] == DECIMAL
        present.sort(
            key=lambda row: Decimal(row[name] or 0) if number else (row[name] or ""),
            reverse=term.startswith("-"),
        )
        rows = present + missing
    return rows


def _field(column: FocusColumn) -> serializers.Field[Any, Any, Any, Any]:
    """The column as the schema shows it: Decimal as an exact decimal string, Date/Time as
    ISO 8601 in UTC, JSON as the serialized object (the specification's key-value format)."""
    help_text = f"FOCUS {column.data_type}; {column.source}."
    options: dict[str, Any] = {"allow_null": column.nullable, "help_text": help_text}
    if column.allowed:
        return serializers.ChoiceField(choices=list(column.allowed), **options)
    if column.data_type == DECIMAL:
        return serializers.DecimalField(max_digits=None, decimal_places=None, **options)
    if column.data_type == DATE_TIME:
        return serializers.DateTimeField(**options)
    if column.data_type == JSON:
        options["help_text"] = f"FOCUS JSON (an object, serialized); {column.source}."
    return serializers.CharField(**options)


FocusRowSerializer = type(
    "FocusRowSerializer",
    (serializers.Serializer,),
    {
        "__doc__": f"One row of a FOCUS {FOCUS_VERSION} dataset: the specification's columns, "
        "then Tally's `x_` ones.",
        **{column.name: _field(column) for column in COLUMNS},
    },
)


@extend_schema(tags=["billing"])
class FocusViewSet(TallyViewSet):
    """What the statements bill, as a FOCUS 1.2 dataset (finance and operators): one row per
    team, model, price, day and job of usage, one per adjustment line. BilledCost adds up
    to the statements of the periods wholly in the window to the cent."""

    permission_classes = [FinanceOrOperator]
    serializer_class = FocusRowSerializer
    filter_backends = []
    pagination_class = None  # type: ignore[assignment]  # not paged: see the module
    query_serializer = FocusQuerySerializer

    @extend_schema(
        parameters=[FocusQuerySerializer], responses={200: FocusRowSerializer(many=True)}
    )
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        query = FocusQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        asked = query.validated_data
        teams = Team.objects.order_by("slug")
        if "team" in asked:
            teams = teams.filter(slug=asked["team"])
        rows = focus_rows(teams=list(teams), since=asked["start"], until=asked["end"])
        rows = ordered(rows, asked.get("ordering", []))
        response = Response(rows, headers={FOCUS_VERSION_HEADER: FOCUS_VERSION})
        if getattr(request.accepted_renderer, "format", "") == "csv":
            name = f"focus-{period_label(asked['start'], asked['end'])}.csv"
            response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
