"""Query filters for rate cards, periods, statements, their lines and usage."""

from __future__ import annotations

from datetime import date
from typing import Any

import django_filters
from django.db.models import Q, QuerySet
from rest_framework.exceptions import ValidationError

from billing.models import Period, RateCard, Statement, StatementLine
from billing.periods import PricingError, is_period_label, parse_period
from metering.models import UsageHour
from teams.api import DateRangeFilterSet, TeamSlugFilter, next_day, start_of_day

PERIOD_HELP = (
    "A billing period: its name as the commands give it (2026-11, or 2026-W47 when "
    "TALLY_BILLING_PERIOD=week), its id, or its start as a UTC date (2026-10-01)."
)


def period_lookups(value: str) -> dict[str, Any]:
    """Lookups on Period for a period given by name (`2026-11`, `2026-W47`), id, or start date
    (the period starting that day); `ValueError` saying why `value` is none of them."""
    value = value.strip()
    if value.isascii() and value.isdigit():
        return {"pk": int(value)}
    # Before dates: Python reads 2026-W47 as a date too (its Monday).
    if is_period_label(value):
        try:
            start, _ = parse_period(value)
        except PricingError as exc:
            raise ValueError(str(exc)) from None
        return {"start": start}
    try:
        day = start_of_day(date.fromisoformat(value))
    except ValueError:
        raise ValueError(f"{value!r} is not a period. {PERIOD_HELP}") from None
    after = next_day(day)
    return {"start__gte": day, **({"start__lt": after} if after else {})}


def period_filter_lookups(value: str) -> dict[str, Any]:
    """`period_lookups` for a `?period=` filter: a bad value is a 400 naming the parameter."""
    try:
        return period_lookups(value)
    except ValueError as exc:
        raise ValidationError({"period": [str(exc)]}) from None


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


class UsagePeriodFilter(django_filters.CharFilter):
    """Usage hours within one period `[start, end)`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(label=PERIOD_HELP, **kwargs)

    def filter(self, qs: QuerySet[Any], value: str) -> QuerySet[Any]:
        if not value:
            return qs
        period = Period.objects.filter(**period_filter_lookups(value)).first()
        if period is None:
            return qs.none()
        return qs.filter(hour__gte=period.start, hour__lt=period.end)


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


class PeriodFilterSet(DateRangeFilterSet):
    date_field = "start"
    closed = django_filters.BooleanFilter(
        field_name="closed_at", lookup_expr="isnull", exclude=True, label="Closed or open"
    )

    class Meta:
        model = Period
        fields: tuple[str, ...] = ()


class StatementFilterSet(DateRangeFilterSet):
    date_field = "period__start"
    team = TeamSlugFilter()
    period = PeriodFilter("period")

    class Meta:
        model = Statement
        fields = ("currency",)


class StatementLineFilterSet(DateRangeFilterSet):
    date_field = "statement__period__start"
    team = TeamSlugFilter("statement__team__slug")
    period = PeriodFilter("statement__period")
    currency = django_filters.CharFilter(field_name="statement__currency")
    product_name = django_filters.CharFilter(label=PRODUCT_HELP)

    class Meta:
        model = StatementLine
        fields = ("kind", "profile")


class UsageFilterSet(DateRangeFilterSet):
    date_field = "hour"
    team = TeamSlugFilter()
    period = UsagePeriodFilter()
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
