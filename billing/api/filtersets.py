"""Query filters for rate cards, periods, statements, their lines and usage."""

from __future__ import annotations

from datetime import date
from typing import Any, ClassVar

import django_filters
from django.db.models import Q, QuerySet
from rest_framework.exceptions import ValidationError

from billing.models import Period, RateCard, Statement, StatementLine
from billing.windows import (
    END_HELP,
    PERIOD_HELP,
    START_HELP,
    WINDOW_PERIOD_HELP,
    WindowError,
    parse_window,
    period_lookups,
)
from metering.models import UsageHour
from teams.api import TeamSlugFilter

__all__ = ["PERIOD_HELP", "period_lookups"]


def period_filter_lookups(value: str) -> dict[str, Any]:
    """`period_lookups` for a `?period=` filter: a bad value is a 400 naming the parameter."""
    try:
        return period_lookups(value)
    except ValueError as exc:
        raise ValidationError({"period": [str(exc)]}) from None


class WindowFilterSet(django_filters.FilterSet):
    """Rows whose `date_field` lies in the window of `start`/`end` (and, with `window_period`,
    `period`), parsed once by `billing.windows.parse_window`: a bad bound, a reversed or empty
    window is a 400 naming the parameter."""

    date_field: ClassVar[str] = ""
    window_period: ClassVar[bool] = False
    start = django_filters.CharFilter(method="in_window", label=START_HELP)
    end = django_filters.CharFilter(method="in_window", label=END_HELP)

    def in_window(self, queryset: QuerySet[Any], name: str, value: str) -> QuerySet[Any]:
        return queryset  # the window is applied once, in `filter_queryset`

    def filter_queryset(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        try:
            window = parse_window(self.data, with_period=self.window_period)
        except WindowError as exc:
            raise ValidationError({name: [reason] for name, reason in exc.errors.items()}) from None
        return window.filter(super().filter_queryset(queryset), self.date_field)


class PeriodFilter(django_filters.CharFilter):
    """Rows of one period, through the relation `field_name` (`period`, `statement__period`)."""

    def __init__(self, field_name: str, **kwargs: Any) -> None:
        super().__init__(field_name=field_name, label=PERIOD_HELP, **kwargs)

    def filter(self, qs: QuerySet[Any], value: str) -> QuerySet[Any]:
        if not value:
            return qs
        return qs.filter(
            **{
                f"{self.field_name}__{lookup}": v
                for lookup, v in period_filter_lookups(value).items()
            }
        )


PRODUCT_HELP = "GPU model: the device's productName attribute"


class RateCardFilterSet(django_filters.FilterSet):
    product_name = django_filters.CharFilter(label=PRODUCT_HELP)
    valid_on = django_filters.DateFilter(method="filter_valid_on", label="Cards in force that day")

    class Meta:
        model = RateCard
        fields = ("profile", "currency")

    def filter_valid_on(self, queryset: QuerySet[RateCard], name: str, value: date) -> Any:
        return queryset.filter(valid_from__lte=value).filter(
            Q(valid_until__isnull=True) | Q(valid_until__gt=value)
        )


class PeriodFilterSet(WindowFilterSet):
    """Periods starting in the window."""

    date_field = "start"
    closed = django_filters.BooleanFilter(
        field_name="closed_at", lookup_expr="isnull", exclude=True, label="Closed or open"
    )

    class Meta:
        model = Period
        fields: tuple[str, ...] = ()


class StatementFilterSet(WindowFilterSet):
    """Statements of periods starting in the window."""

    date_field = "period__start"
    team = TeamSlugFilter()
    period = PeriodFilter("period")

    class Meta:
        model = Statement
        fields = ("currency",)


class StatementLineFilterSet(WindowFilterSet):
    """Lines of statements of periods starting in the window."""

    date_field = "statement__period__start"
    team = TeamSlugFilter("statement__team__slug")
    period = PeriodFilter("statement__period")
    currency = django_filters.CharFilter(field_name="statement__currency")
    product_name = django_filters.CharFilter(label=PRODUCT_HELP)

    class Meta:
        model = StatementLine
        fields = ("kind", "profile")


class UsageFilterSet(WindowFilterSet):
    """Usage hours in the window (`start`/`end`, or a `period`)."""

    date_field = "hour"
    window_period = True
    period = django_filters.CharFilter(method="in_window", label=WINDOW_PERIOD_HELP)
    team = TeamSlugFilter()
    product_name = django_filters.CharFilter(label=PRODUCT_HELP)
    cluster = django_filters.CharFilter(field_name="cluster__name")

    class Meta:
        model = UsageHour
        fields = ("namespace", "username", "job", "profile")


class UsageSeriesFilterSet(UsageFilterSet):
    # Read by the view to group rows, not a filter on them.
    granularity = django_filters.ChoiceFilter(
        choices=(("day", "day"), ("hour", "hour")),
        method="group_only",
        label="Rows per day (default) or per hour",
    )

    def group_only(self, queryset: QuerySet[UsageHour], name: str, value: str) -> Any:
        return queryset
