"""`/api/v1/compare/`: did it help? Two windows of a team or of the fleet compared, the change
in utilisation split into workload mix, the jobs' own efficiency, and jobs entering and
leaving (`billing.compare`).

Scoped as the usage endpoints are: leads compare their own teams (another team is a 404, as
if there were none), finance and operators any team, and the fleet (no `team`), which
includes namespaces of no team. JSON is one object with the job rows under `results`; CSV
(`?format=csv`) is the rows alone, the whole scope first (kind `total`).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from billing.compare import (
    PERIOD_PARAMETERS,
    ROW_COLUMNS,
    WINDOW_PARAMETERS,
    CompareInputError,
    Presence,
    compare_windows,
    job_rows,
    parse_parameters,
    summary,
    total_row,
)
from billing.windows import PERIOD_HELP
from inventory.models import Unit
from metering.moments import MOMENT_HELP
from teams.api import FINANCE, OPERATOR, AnyRole, CSVRenderer, StrictQueryParameters, request_role
from teams.models import Team
from teams.selectors import visible_teams

PLACES = 4
FLEET_ROLES = frozenset({OPERATOR, FINANCE})


def plain(value: Any) -> Any:
    """Decimals as strings (exact, as every endpoint gives them), datetimes in ISO 8601 UTC,
    nested dicts and lists alike."""
    if isinstance(value, Decimal):
        return f"{value:f}"
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, dict):
        return {name: plain(item) for name, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def _decimal(help_text: str = "") -> serializers.CharField:
    return serializers.CharField(allow_null=True, help_text=help_text)


def _row_field(name: str) -> serializers.Field[Any, Any, Any, Any]:
    if name == "kind":
        # A string, not a choice: drf-spectacular would name its enum after the statement
        # lines' `kind` too.
        kinds = ", ".join(("total", *(presence.value for presence in Presence)))
        return serializers.CharField(
            help_text=f"One of {kinds}: where the job has measured hours, both windows, only "
            "after (entering), only before (leaving), neither (unmeasured); `total`: the whole "
            "scope, the first row of a CSV.",
        )
    if name.endswith("_pp"):
        return _decimal("Its part of the change, in percentage points.")
    if name.endswith("_utilisation_pct"):
        return _decimal("Utilised over measured hours, in percent; null without measured hours.")
    if name.endswith("_share_pct"):
        return _decimal("Its share of the window's measured hours, in percent.")
    if name.endswith("_hours"):
        return _decimal("Hours of the unit.")
    return serializers.CharField(allow_blank=True, help_text=ROW_HELP.get(name, ""))


ROW_HELP = {
    "job": '"Kind/name" of the claims\' owner, as billing charges it.',
    "claim": "For a claim without an owner (job empty): its name.",
}
# One job per row (or, first in a CSV, the whole scope): the columns of `ROW_COLUMNS`.
CompareRowSerializer = type(
    "CompareRowSerializer",
    (serializers.Serializer,),
    {name: _row_field(name) for name in ROW_COLUMNS},
)


class WindowSerializer(serializers.Serializer[Any]):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField(help_text="Exclusive.")
    allocated_hours = _decimal()
    measured_hours = _decimal("Allocated less unmeasured: utilised + idle.")
    utilised_hours = _decimal()
    idle_hours = _decimal()
    unmeasured_hours = _decimal("No samples: neither utilised nor idle, left out of the ratio.")
    utilisation_pct = _decimal("Utilised over measured hours; null without measured hours.")


class PartsSerializer(serializers.Serializer[Any]):
    mix = _decimal("Which of the jobs present in both windows ran, and how much.")
    efficiency = _decimal("The jobs present in both windows' own utilisation.")
    entering = _decimal("Jobs measured only in the after window.")
    leaving = _decimal("Jobs measured only in the before window.")


class ComparisonSerializer(serializers.Serializer[Any]):
    scope = serializers.CharField(help_text='The team\'s slug, or "fleet".')
    team = serializers.CharField(allow_null=True)
    unit = serializers.CharField()
    hours_label = serializers.CharField()
    before = WindowSerializer()
    after = WindowSerializer()
    change_pp = _decimal("After less before utilisation, in points; null if either is null.")
    parts_pp = PartsSerializer(help_text="Rounded so that they add up to change_pp.")
    exact = serializers.DictField(
        child=serializers.CharField(),
        allow_null=True,
        help_text='The change and its parts as exact fractions of 1 ("1/8").',
    )
    jobs = serializers.DictField(child=serializers.IntegerField(), help_text="Jobs per kind.")
    results = CompareRowSerializer(many=True)


def _moment(name: str, side: str, bound: str) -> OpenApiParameter:
    return OpenApiParameter(
        name,
        OpenApiTypes.STR,
        description=f"The {side} window's {bound}: {MOMENT_HELP}."
        + (" Exclusive." if bound == "end" else "")
        + f" Required unless {side}_period is given.",
    )


def _period(side: str) -> OpenApiParameter:
    return OpenApiParameter(
        f"{side}_period",
        OpenApiTypes.STR,
        description=f"The {side} window as one billing period, instead of its start and end. "
        + PERIOD_HELP,
    )


@extend_schema(tags=["usage"])
class CompareView(StrictQueryParameters, GenericAPIView[Any]):
    """Did it help? Utilisation (utilised over measured hours) of a team or the fleet in two
    windows, and its change split into workload mix, the jobs' own efficiency, and jobs
    entering and leaving, which add up exactly to it; per job, each one's part."""

    permission_classes = [AnyRole]
    serializer_class = CompareRowSerializer  # a CSV's columns
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer, CSVRenderer]
    filter_backends = []
    query_parameters = ("team", *WINDOW_PARAMETERS, *PERIOD_PARAMETERS, "unit")

    @extend_schema(
        operation_id="compare",
        parameters=[
            OpenApiParameter(
                "team",
                OpenApiTypes.STR,
                description="A team's slug; none: the fleet (finance and operators).",
            ),
            _moment("before_start", "before", "start"),
            _moment("before_end", "before", "end"),
            _period("before"),
            _moment("after_start", "after", "start"),
            _moment("after_end", "after", "end"),
            _period("after"),
            OpenApiParameter(
                "unit", OpenApiTypes.STR, enum=Unit.values, description="Default gpu."
            ),
        ],
        responses={200: ComparisonSerializer},
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        team = self._team(request, params.get("team", ""))
        try:
            before, after, unit = parse_parameters(params)
        except CompareInputError as exc:
            raise ValidationError({name: [reason] for name, reason in exc.errors.items()}) from None
        comparison = compare_windows(team=team, before=before, after=after, unit=unit)
        rows = job_rows(comparison, PLACES)
        if request.accepted_renderer.format == CSVRenderer.format:
            return Response(plain([total_row(comparison, PLACES), *rows]))
        return Response(plain({**summary(comparison, PLACES), "results": rows}))

    def _team(self, request: Request, slug: str) -> Team | None:
        """The team asked for, among those the user may see (404 otherwise); None for the
        fleet, which only finance and operators may compare (403)."""
        if not slug:
            if request_role(request) not in FLEET_ROLES:
                raise PermissionDenied(
                    "Only finance and operators may compare the fleet: give team=<slug> for "
                    "one of your teams."
                )
            return None
        # PostgreSQL refuses NUL in text: no such team, rather than a database error.
        team = (
            None if "\x00" in slug else visible_teams(user=request.user).filter(slug=slug).first()
        )
        if team is None:
            raise NotFound(f"No team {slug!r} that you may see.")
        return team
