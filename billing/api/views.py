"""Rate cards, periods, statements, adjustments and usage.

Reads are scoped to the user's teams (`TeamScopedViewSet`); the two writes, closing a period
and adding an adjustment, are for finance and operators and call one `billing.services`
service each, which audits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC
from operator import attrgetter
from typing import Any, ClassVar, TypeVar

from django.db.models import Prefetch, QuerySet, Sum
from django.db.models.functions import Trunc
from django.http import HttpResponse, HttpResponseBase
from django.utils import timezone
from django_filters.rest_framework import DjangoFilterBackend
from django_filters.utils import translate_validation
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from billing.api.filtersets import (
    PeriodFilterSet,
    RateCardFilterSet,
    StatementFilterSet,
    StatementLineFilterSet,
    UsageFilterSet,
    UsageSeriesFilterSet,
)
from billing.api.serializers import (
    BILLED_MONEY,
    AdjustmentInputSerializer,
    BilledJobSerializer,
    BilledPersonSerializer,
    BilledUsageSerializer,
    BilledWindowSerializer,
    ClaimUsageSerializer,
    FlatStatementLineSerializer,
    JobUsageSerializer,
    PeriodSerializer,
    RateCardSerializer,
    StatementDetailSerializer,
    StatementSerializer,
    UnownedQuerySerializer,
    UnownedUsageSerializer,
    UsageSerializer,
    UsageSeriesSerializer,
    UserUsageSerializer,
)
from billing.models import LineKind, Period, RateCard, Statement, StatementLine
from billing.periods import PricingError
from billing.pricing import period_holding
from billing.selectors import BilledRow, BilledUsage, billed_usage, unowned_usage
from billing.services import add_adjustment, close_period
from billing.statement_csv import (
    statement_csv_filename,
    statement_lines,
    write_statement_csv,
)
from core.parsers import JsonParser
from metering.hours import idle_expression
from metering.models import UsageHour
from teams.api import (
    CSVRenderer,
    FinanceOrOperator,
    OrderingFilter,
    TallyViewSet,
    TeamScopedViewSet,
    bad_request,
)
from teams.models import Team

LINE_ORDER = ("kind", "product_name", "profile", "id")
_Row = TypeVar("_Row")


@extend_schema(tags=["billing"])
class RateCardViewSet(mixins.ListModelMixin, TallyViewSet):
    """Prices per GPU-hour. Not secret: leads read them too, to check their statements."""

    serializer_class = RateCardSerializer
    filterset_class = RateCardFilterSet
    queryset = RateCard.objects.all()
    ordering_fields = ("product_name", "profile", "currency", "valid_from")
    ordering = ("product_name", "profile", "currency", "valid_from")


@extend_schema(tags=["billing"])
class PeriodViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TallyViewSet):
    """Billing periods (the same for every team), and closing one."""

    serializer_class = PeriodSerializer
    filterset_class = PeriodFilterSet
    queryset = Period.objects.all()
    lookup_value_regex = r"\d+"
    ordering_fields = ("start",)
    ordering = ("-start",)

    @extend_schema(operation_id="periods_close", request=None, responses={200: PeriodSerializer})
    @action(detail=True, methods=["post"], permission_classes=[FinanceOrOperator])
    def close(self, request: Request, pk: str | None = None) -> Response:
        """Compute the period's statements a last time and freeze them (finance, operators).
        400 when the period has not ended or is already closed."""
        period = self.get_object()
        try:
            close_period(period=period, actor=request.user.get_username())
        except PricingError as exc:
            raise bad_request(str(exc)) from exc
        return Response(PeriodSerializer(period, context=self.get_serializer_context()).data)


@extend_schema(tags=["billing"])
class StatementViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """What each of your teams owes per period and currency; the detail has the lines."""

    filterset_class = StatementFilterSet
    lookup_value_regex = r"\d+"
    ordering_fields = ("team", "period_start", "currency", "total")
    ordering = ("-period_start", "team", "currency")
    ordering_aliases = {"team": "team__slug", "period_start": "period__start"}

    def get_serializer_class(self) -> type[StatementSerializer]:
        return StatementDetailSerializer if self.action == "retrieve" else StatementSerializer

    # A CSV statement is a plain Django response (DRF passes it through): its rows are the
    # statement's lines, not the serializer's one object.
    def retrieve(  # type: ignore[override]
        self, request: Request, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        """A statement with its lines; in CSV (`?format=csv`), its lines one per row, as the
        portal's download gives them (`billing.statement_csv`: the same writer)."""
        if request.accepted_renderer.format != CSVRenderer.format:
            return super().retrieve(request, *args, **kwargs)
        statement: Statement = self.get_object()
        name = statement_csv_filename(
            team_slug=statement.team.slug,
            period_label=statement.period.label,
            currency=statement.currency,
        )
        response = HttpResponse(content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        write_statement_csv(response, statement_lines(statement.lines.all()))
        return response

    def scope(self, teams: QuerySet[Team]) -> QuerySet[Statement]:
        statements = Statement.objects.filter(team__in=teams).select_related("team", "period")
        if self.action == "retrieve":
            lines = StatementLine.objects.select_related("corrects_period").order_by(*LINE_ORDER)
            statements = statements.prefetch_related(Prefetch("lines", queryset=lines))
        return statements


@extend_schema(tags=["billing"])
class StatementLineViewSet(mixins.ListModelMixin, TeamScopedViewSet):
    """Statement lines one per row, with their team, period and currency: made for CSV."""

    serializer_class = FlatStatementLineSerializer
    filterset_class = StatementLineFilterSet
    ordering_fields = ("team", "period_start", "currency", "kind", "product_name", "amount")
    ordering = ("-period_start", "team", "currency", *LINE_ORDER)
    ordering_aliases = {
        "team": "statement__team__slug",
        "period_start": "statement__period__start",
        "currency": "statement__currency",
    }

    def scope(self, teams: QuerySet[Team]) -> QuerySet[StatementLine]:
        return StatementLine.objects.filter(statement__team__in=teams).select_related(
            "statement__team", "statement__period", "corrects_period"
        )


class AdjustmentViewSet(StatementLineViewSet):
    """Adjustment lines (late data, and finance's own); finance and operators add them."""

    parser_classes = [JsonParser]

    def get_permissions(self) -> Sequence[Any]:
        if self.action == "create":
            return [FinanceOrOperator()]
        return super().get_permissions()

    def scope(self, teams: QuerySet[Team]) -> QuerySet[StatementLine]:
        return super().scope(teams).filter(kind=LineKind.ADJUSTMENT)

    @extend_schema(request=AdjustmentInputSerializer, responses={201: FlatStatementLineSerializer})
    def create(self, request: Request) -> Response:
        """Add an adjustment to a team's statement of an open period; the reason is required."""
        given = AdjustmentInputSerializer(data=request.data, context=self.get_serializer_context())
        given.is_valid(raise_exception=True)
        try:
            line = add_adjustment(actor=request.user.get_username(), **given.validated_data)
        except PricingError as exc:
            raise bad_request(str(exc)) from exc
        shown = self.get_serializer(self.get_queryset().get(pk=line.pk))
        return Response(shown.data, status=status.HTTP_201_CREATED)


FIGURE_ORDERING = {
    "allocated_gpu_hours": "allocated_ms",
    "utilised_gpu_hours": "utilised_ms",
    "idle_gpu_hours": "idle_ms",
    "unmeasured_gpu_hours": "unmeasured_ms",
}


@extend_schema(tags=["usage"])
class UsageViewSet(mixins.ListModelMixin, TeamScopedViewSet):
    """Usage per team, day (or hour, `?granularity=hour`) and accelerator model, in the model's
    unit (`hours`). Filters select the hourly rows that are summed; ordering sorts the sums."""

    # Subclasses sum over other keys (`group_by`); the sums are made in SQL. Every grouping
    # keeps units apart (`unit` last): GPU-hours and TPU chip-hours are never added up.

    serializer_class: type[UsageSerializer] = UsageSeriesSerializer
    filterset_class = UsageSeriesFilterSet
    group_by: ClassVar[tuple[str, ...]] = ("team__slug", "start", "product_name", "unit")
    ordering_aliases = {"team": "team__slug", **FIGURE_ORDERING}

    @property
    def ordering_fields(self) -> tuple[str, ...]:
        # The unit keeps rows apart but is not a key to sort by (`hours` shows it).
        keys = tuple("team" if key == "team__slug" else key for key in self.group_by)
        return tuple(key for key in keys if key != "unit") + tuple(FIGURE_ORDERING)

    @property
    def ordering(self) -> tuple[str, ...]:
        keys = tuple(key for key in self.ordering_fields if key not in FIGURE_ORDERING)
        return (*keys, "unit")

    def scope(self, teams: QuerySet[Team]) -> QuerySet[UsageHour]:
        return UsageHour.objects.filter(team__in=teams)

    def filter_queryset(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        filterset = DjangoFilterBackend().get_filterset(self.request, queryset, self)
        assert filterset is not None
        if not filterset.is_valid():
            raise translate_validation(filterset.errors)
        hours = filterset.qs
        if "start" in self.group_by:
            granularity = filterset.form.cleaned_data.get("granularity") or "day"
            hours = hours.annotate(start=Trunc("hour", granularity, tzinfo=UTC))
        groups = (
            hours.values(*self.group_by)
            .annotate(
                allocated_ms=Sum("allocated_gpu_ms"),
                utilised_ms=Sum("utilised_gpu_ms"),
                unmeasured_ms=Sum("unmeasured_gpu_ms"),
            )
            .annotate(idle_ms=idle_expression("allocated_ms", "utilised_ms", "unmeasured_ms"))
            .order_by()
        )
        return OrderingFilter().filter_queryset(self.request, groups, self)


class ClaimUsageViewSet(UsageViewSet):
    """Usage per claim (namespace and name) over the chosen dates."""

    serializer_class = ClaimUsageSerializer
    filterset_class = UsageFilterSet
    group_by = ("team__slug", "namespace", "claim_name", "unit")


class JobUsageViewSet(UsageViewSet):
    """Usage per job: the claim's owner (`Kind/name`) in its namespace."""

    serializer_class = JobUsageSerializer
    filterset_class = UsageFilterSet
    group_by = ("team__slug", "namespace", "job", "unit")


class UserUsageViewSet(UsageViewSet):
    """Usage per user who made the claims."""

    serializer_class = UserUsageSerializer
    filterset_class = UsageFilterSet
    group_by = ("team__slug", "username", "unit")


@extend_schema(tags=["usage"])
class BilledUsageViewSet(mixins.ListModelMixin, TeamScopedViewSet):
    """Hours per person in a window (`start`/`end`, or a `period`; by default the current
    period), each unit apart, and what the statements bill for them per currency: utilised,
    idle (at the idle factor) and unmeasured, to the cent. Each statement line's amount is
    shared out among the rows it bills, so a team's rows add up to its statements' usage
    lines of the same window; filters and ordering pick and sort rows after pricing."""

    serializer_class: type[BilledUsageSerializer] = BilledPersonSerializer
    filter_backends = []  # the window query is validated by `BilledWindowSerializer`
    query_serializer = BilledWindowSerializer
    keys: ClassVar[tuple[str, ...]] = ("team", "username")
    # Filters on a row's keys, as the query names them.
    row_filters: ClassVar[tuple[str, ...]] = ("username", "unit", "currency")

    def scope(self, teams: QuerySet[Team]) -> QuerySet[Team]:
        return teams

    def rows(self, usage: BilledUsage) -> Sequence[BilledRow]:
        return usage.people

    @extend_schema(parameters=[BilledWindowSerializer])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        query = BilledWindowSerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        asked = query.validated_data
        teams = self.get_queryset()
        if "team" in asked:
            teams = teams.filter(slug=asked["team"])
        usage = billed_usage(teams=list(teams), since=asked["start"], until=asked["end"])
        rows = [
            row
            for row in self.rows(usage)
            if all(getattr(row, name) == asked[name] for name in self.row_filters if name in asked)
        ]
        rows = ordered(rows, asked.get("ordering", ""), self.ordering_names())
        page = self.paginate_queryset(rows)
        context = {**self.get_serializer_context(), "start": usage.since, "end": usage.until}
        shown = self.get_serializer_class()(page, many=True, context=context)
        return self.get_paginated_response(shown.data)

    def get_serializer(self, *args: Any, **kwargs: Any) -> BilledUsageSerializer:
        # The CSV renderer asks for an empty one to name the columns.
        serializer = self.get_serializer_class()(*args, **kwargs)
        assert isinstance(serializer, BilledUsageSerializer)
        return serializer

    def ordering_names(self) -> dict[str, str]:
        """The public names to order by, and the row's attribute each sorts on."""
        return {
            **{key: key for key in self.keys},
            "unit": "unit",
            "currency": "currency",
            "allocated_gpu_hours": "allocated_ms",
            "utilised_gpu_hours": "utilised_ms",
            "idle_gpu_hours": "idle_ms",
            "unmeasured_gpu_hours": "unmeasured_ms",
            **{name: name for name in BILLED_MONEY},
        }


class BilledJobViewSet(BilledUsageViewSet):
    """Hours per job (the claims' owner, `Kind/name`, in its namespace) in a window, and what
    the statements bill for them, as per person (`billed/people`)."""

    serializer_class = BilledJobSerializer
    keys = ("team", "namespace", "job")
    row_filters = ("namespace", "job", "unit", "currency")

    def rows(self, usage: BilledUsage) -> Sequence[BilledRow]:
        return usage.jobs


def ordered(rows: list[_Row], ordering: str, allowed: dict[str, str]) -> list[_Row]:
    """`rows` by `?ordering=`, of the public names `allowed` maps to row attributes (`-`
    descending; null values last either way); as they are when it is empty. An unknown name
    is a 400 naming the allowed ones, as `teams.api.OrderingFilter` answers."""
    terms = [term.strip() for term in ordering.split(",") if term.strip()]
    for term in terms:
        if term.removeprefix("-") not in allowed:
            raise ValidationError(
                {
                    "ordering": [
                        f"cannot order by {term.removeprefix('-')!r}: order by one of "
                        f"{', '.join(allowed)} (a leading '-' for descending)"
                    ]
                }
            )
    for term in reversed(terms):
        name = allowed[term.removeprefix("-")]
        present = [row for row in rows if getattr(row, name) is not None]
        missing = [row for row in rows if getattr(row, name) is None]
        present.sort(key=attrgetter(name), reverse=term.startswith("-"))
        rows = present + missing
    return rows


@extend_schema(tags=["billing"])
class UnownedUsageViewSet(TallyViewSet):
    """Usage of no team in a period (finance, operators): per namespace, cluster, unit and
    currency, the hours no team owned the namespace in, and their cost at list price. The
    teams' statements plus these are the fleet's usage."""

    serializer_class = UnownedUsageSerializer
    permission_classes = [FinanceOrOperator]
    filter_backends = []
    query_serializer = UnownedQuerySerializer

    @extend_schema(parameters=[UnownedQuerySerializer])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        query = UnownedQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        asked = query.validated_data
        period = asked.get("period") or period_holding(timezone.now())
        rows = unowned_usage(period=period) if period.pk is not None else []
        names = {name: name for name in UnownedUsageSerializer.Meta.fields}
        rows = ordered(rows, asked.get("ordering", ""), names)
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)
