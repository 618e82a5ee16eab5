"""Rate cards, periods, statements and usage as the API shows them, and the one write input
(an adjustment). Money and hours are decimal strings, never floats.

The `*_gpu_hours` figures are hours of the row's unit, which `hours` names (`GPU-hours`, `TPU
chip-hours`, `Gaudi card-hours`): usage is grouped by unit too, so no figure adds TPU
chip-hours to GPU-hours."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from operator import attrgetter
from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from billing.api.filtersets import PERIOD_HELP, period_lookups
from billing.currencies import currency_error
from billing.models import Period, RateCard, Statement, StatementLine
from billing.pricing import period_holding, round_money
from billing.units import hours_label
from billing.windows import (
    END,
    END_HELP,
    PERIOD,
    START,
    START_HELP,
    WINDOW_PERIOD_HELP,
    WindowError,
    parse_window,
)
from inventory.models import Unit
from metering.hours import HOUR, MS_PER_HOUR
from teams.api import ReadOnlyModelSerializer, VisibleTeamField
from teams.models import Team


class EfficiencyField(serializers.DecimalField):
    """utilised / (allocated - unmeasured): how busy the GPUs were while measured; null when
    nothing was measured. Reads the three figures from the object by the names given."""

    def __init__(self, *, utilised: str, allocated: str, unmeasured: str, **kwargs: Any) -> None:
        self.figure_names = (utilised, allocated, unmeasured)
        kwargs.setdefault("help_text", "utilised / (allocated - unmeasured); null if unmeasured.")
        super().__init__(
            max_digits=16, decimal_places=6, source="*", read_only=True, allow_null=True, **kwargs
        )

    def to_representation(self, value: Any) -> Any:
        utilised, allocated, unmeasured = (
            value[name] if isinstance(value, Mapping) else getattr(value, name)
            for name in self.figure_names
        )
        measured = Decimal(allocated) - Decimal(unmeasured)
        if measured <= 0:
            return None
        return super().to_representation(Decimal(utilised) / measured)


class GpuHoursField(serializers.DecimalField):
    """Integer milliseconds of a unit (as UsageHour keeps them) shown as hours of it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=24, decimal_places=6, read_only=True, **kwargs)

    def to_representation(self, value: Any) -> Any:
        return super().to_representation(Decimal(value) / MS_PER_HOUR)


class MoneyField(serializers.DecimalField):
    """Money as stored (to the thousandth, which only some currencies use) shown to its
    currency's minor unit: `5.49` USD, `1.235` KWD, `500` JPY. Reads the amount and the
    currency from the object by the dotted names given."""

    def __init__(self, *, amount: str, currency: str, **kwargs: Any) -> None:
        self.names = (amount, currency)
        super().__init__(max_digits=17, decimal_places=3, source="*", read_only=True, **kwargs)

    def to_representation(self, value: Any) -> Any:
        amount, currency = (attrgetter(name)(value) for name in self.names)
        return f"{round_money(amount, currency):f}"


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "integer"}]})
class PeriodField(serializers.Field[Period, Any, int, Any]):
    """A period as the filters take it (`period_lookups`): by name (2026-11), id or start
    date; shown as its id."""

    default_error_messages = {
        "invalid": "Expected a period's name, id or start date, got {kind}.",
        "does_not_exist": "No billing period {value} yet: a period is made when its usage is "
        "first rolled up (run_billing, or beat for the current one).",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(help_text=PERIOD_HELP, **kwargs)

    def to_internal_value(self, data: Any) -> Period:
        if isinstance(data, bool) or not isinstance(data, str | int):
            self.fail("invalid", kind=type(data).__name__)
        try:
            lookups = period_lookups(str(data))
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        period = Period.objects.filter(**lookups).order_by("start").first()
        if period is None:
            self.fail("does_not_exist", value=data)
        return period

    def to_representation(self, value: Period) -> int:
        return value.pk


class RateCardSerializer(ReadOnlyModelSerializer):
    class Meta:
        model = RateCard
        fields = (
            "id",
            "product_name",
            "profile",
            "per_gpu_hour",
            "idle_factor",
            "currency",
            "valid_from",
            "valid_until",
        )


LABEL_HELP = "The period's name, as the commands give it: 2026-11, or 2026-W47 for a week."


class PeriodSerializer(ReadOnlyModelSerializer):
    is_closed = serializers.BooleanField(read_only=True)

    class Meta:
        model = Period
        # `label`: the model's property (a declared field would hide the serializer's label).
        fields = ("id", "label", "start", "end", "is_closed", "closed_at", "closed_by")
        extra_kwargs = {"label": {"help_text": LABEL_HELP}}


class StatementSerializer(ReadOnlyModelSerializer):
    team: serializers.SlugRelatedField[Team] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    period_label = serializers.CharField(
        source="period.label", read_only=True, help_text=LABEL_HELP
    )
    period_start = serializers.DateTimeField(source="period.start", read_only=True)
    total = MoneyField(amount="total", currency="currency")

    class Meta:
        model = Statement
        fields: tuple[str, ...] = (
            "id",
            "team",
            "period",
            "period_label",
            "period_start",
            "currency",
            "total",
            "computed_at",
        )


class StatementLineSerializer(ReadOnlyModelSerializer):
    """A line within its statement."""

    efficiency = EfficiencyField(
        utilised="utilised_gpu_hours",
        allocated="allocated_gpu_hours",
        unmeasured="unmeasured_gpu_hours",
    )
    corrects_period_label = serializers.CharField(
        source="corrects_period.label", read_only=True, allow_null=True, help_text=LABEL_HELP
    )
    corrects_period_start = serializers.DateTimeField(
        source="corrects_period.start", read_only=True, allow_null=True
    )
    amount = MoneyField(amount="amount", currency="statement.currency")
    unit = serializers.SerializerMethodField(
        help_text="What `rate` is the price of: `GPU-hour`, `TPU chip-hour`, `Gaudi card-hour`, "
        "or `slice-hour` (an hour of one MIG slice, for a profile's own rate card); null when "
        "the line has no rate."
    )
    hours = serializers.CharField(
        source="hours_label",
        read_only=True,
        help_text="What the line's `*_gpu_hours` count: `GPU-hours`, `TPU chip-hours`, "
        "`Gaudi card-hours`, `accelerator-hours`.",
    )

    class Meta:
        model = StatementLine
        fields: tuple[str, ...] = (
            "id",
            "kind",
            "product_name",
            "profile",
            "allocated_gpu_hours",
            "utilised_gpu_hours",
            "idle_gpu_hours",
            "unmeasured_gpu_hours",
            "efficiency",
            "rate",
            "unit",
            "hours",
            "gpu_share",
            "idle_factor",
            "amount",
            "corrects_period",
            "corrects_period_label",
            "corrects_period_start",
            "reason",
            "created_by",
        )
        extra_kwargs = {
            "gpu_share": {
                "help_text": "For a `slice-hour` rate: the slice's share of its GPU, which turns "
                "the line's GPU-hours into slice-hours; else null."
            }
        }

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_unit(self, line: StatementLine) -> str | None:
        return None if line.rate is None else line.rate_unit


class FlatStatementLineSerializer(StatementLineSerializer):
    """A line on its own (lists, CSV): with its statement's team, period and currency."""

    team = serializers.CharField(source="statement.team.slug", read_only=True)
    period = serializers.IntegerField(source="statement.period_id", read_only=True)
    period_label = serializers.CharField(
        source="statement.period.label", read_only=True, help_text=LABEL_HELP
    )
    period_start = serializers.DateTimeField(source="statement.period.start", read_only=True)
    currency = serializers.CharField(source="statement.currency", read_only=True)

    class Meta(StatementLineSerializer.Meta):
        fields = (
            "id",
            "team",
            "period",
            "period_label",
            "period_start",
            "currency",
            *StatementLineSerializer.Meta.fields[1:],
        )


class StatementDetailSerializer(StatementSerializer):
    lines = StatementLineSerializer(many=True, read_only=True)

    class Meta(StatementSerializer.Meta):
        fields = (*StatementSerializer.Meta.fields, "lines")


class AdjustmentInputSerializer(serializers.Serializer[Any]):
    """What finance sends to add an adjustment line to a team's statement of an open period."""

    team = VisibleTeamField()
    period = PeriodField()
    currency = serializers.RegexField(r"^[A-Za-z]{3}\Z", help_text="ISO 4217 code, e.g. EUR.")
    amount = serializers.DecimalField(
        max_digits=16,
        decimal_places=4,
        help_text="Negative for a credit; rounded to the currency's minor unit.",
    )
    reason = serializers.CharField(max_length=2000)
    product_name = serializers.CharField(
        max_length=253, required=False, default="", allow_blank=True
    )

    def validate_currency(self, value: str) -> str:
        if error := currency_error(value.upper()):
            raise serializers.ValidationError(error)
        return value.upper()

    def validate_amount(self, value: Decimal) -> Decimal:
        if not value:
            raise serializers.ValidationError("An adjustment of zero changes nothing.")
        return value


USAGE_FIGURES = (
    "hours",
    "allocated_gpu_hours",
    "utilised_gpu_hours",
    "idle_gpu_hours",
    "unmeasured_gpu_hours",
    "efficiency",
)


class UsageSerializer(serializers.Serializer[Any]):
    """GPU-hours of one group of UsageHour rows; subclasses add what the group is (its keys),
    which come first, the figures last."""

    team = serializers.CharField(source="team__slug", read_only=True)
    hours = serializers.SerializerMethodField(
        help_text="What the figures count: `GPU-hours`, `TPU chip-hours`, `Gaudi card-hours`, "
        "`accelerator-hours` (rows are grouped by it)."
    )
    allocated_gpu_hours = GpuHoursField(source="allocated_ms")
    utilised_gpu_hours = GpuHoursField(source="utilised_ms")
    idle_gpu_hours = GpuHoursField(source="idle_ms")
    unmeasured_gpu_hours = GpuHoursField(source="unmeasured_ms")
    efficiency = EfficiencyField(
        utilised="utilised_ms", allocated="allocated_ms", unmeasured="unmeasured_ms"
    )

    @extend_schema_field(serializers.CharField())
    def get_hours(self, row: Mapping[str, Any]) -> str:
        return hours_label(row["unit"])

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        keys = {name: field for name, field in fields.items() if name not in USAGE_FIGURES}
        return keys | {name: fields[name] for name in USAGE_FIGURES}


class UsageSeriesSerializer(UsageSerializer):
    start = serializers.DateTimeField(read_only=True, help_text="Start of the day or hour (UTC).")
    product_name = serializers.CharField(read_only=True)


class ClaimUsageSerializer(UsageSerializer):
    namespace = serializers.CharField(read_only=True)
    claim_name = serializers.CharField(read_only=True)


class JobUsageSerializer(UsageSerializer):
    namespace = serializers.CharField(read_only=True)
    job = serializers.CharField(read_only=True, help_text="Kind/name of the claim's owner.")


class UserUsageSerializer(UsageSerializer):
    username = serializers.CharField(read_only=True)


# --- Billed usage per person and per job ---------------------------------------------------


class BilledWindowSerializer(serializers.Serializer[Any]):
    """The query of the billed-usage endpoints: a window (`start`/`end`, or a `period`; the
    current period when neither is given, or from `start` to the current period's end) and
    which rows to show, parsed by `billing.windows.parse_window`. Filters pick rows after
    pricing, so a row's money is the same whatever else is asked."""

    start = serializers.CharField(required=False, help_text=START_HELP)
    end = serializers.CharField(required=False, help_text=END_HELP)
    period = serializers.CharField(required=False, help_text=WINDOW_PERIOD_HELP)
    team = serializers.CharField(required=False, help_text="Team slug")
    username = serializers.CharField(required=False)
    namespace = serializers.CharField(required=False)
    job = serializers.CharField(required=False, help_text="Kind/name of the claims' owner.")
    unit = serializers.ChoiceField(choices=Unit.choices, required=False)
    currency = serializers.CharField(required=False)
    ordering = serializers.CharField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            window = parse_window(attrs)
        except WindowError as exc:
            raise serializers.ValidationError(
                {name: [reason] for name, reason in exc.errors.items()}
            ) from None
        for name in (START, END, PERIOD):
            attrs.pop(name, None)
        start, end = window.start, window.end
        if start is None or end is None:
            current = period_holding(timezone.now())
            if start is None:
                start = current.start
                if end is not None and end <= start:
                    raise serializers.ValidationError(
                        {"end": [f"{end:%Y-%m-%dT%H:%MZ} is not after the current period's "
                                 f"start ({start:%Y-%m-%dT%H:%MZ}): give start too"]}
                    )  # fmt: skip
            end = end or max(current.end, start + HOUR)
        if end - start > MAX_WINDOW:
            raise serializers.ValidationError(
                {"end": [f"A window is at most {MAX_WINDOW.days} days long."]}
            )
        attrs["start"], attrs["end"] = start, end
        return attrs


# A year and a bit: a year of usage, priced per day, is still one query and a few thousand rows.
MAX_WINDOW = timedelta(days=400)


class BilledMoneyField(serializers.DecimalField):
    """An amount already rounded to its row's currency (null on hours no rate card prices),
    shown to the currency's minor unit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=17, decimal_places=3, read_only=True, allow_null=True, **kwargs)

    def to_representation(self, value: Any) -> Any:
        return f"{value:f}"


BILLED_MONEY = (
    "billed",
    "billed_utilised",
    "billed_idle",
    "billed_unmeasured",
    "idle_at_list_price",
)
BILLED_FIGURES = ("currency", *BILLED_MONEY)
# The window of a billed row, under the API's names (`since` and `until` are their deprecated
# aliases, sent until the next release as the query parameters' old names are taken).
WINDOW_FIELDS = ("start", "end")


@extend_schema_serializer(deprecate_fields=["since", "until"])
class BilledUsageSerializer(UsageSerializer):
    """A person's or a job's hours of one unit in the window, and what the statements bill for
    them in one currency, per part: utilised and unmeasured hours at the rate, idle hours at the
    rate times the card's idle factor. Each statement line's amount is shared out to the
    cent among the rows it bills, so a team's rows add up to its statements' usage lines."""

    team = serializers.CharField(read_only=True)
    since = serializers.SerializerMethodField(
        help_text="Deprecated: the window's start, as `start`; dropped in the next release."
    )
    until = serializers.SerializerMethodField(
        help_text="Deprecated: the window's end, as `end`; dropped in the next release."
    )
    start = serializers.SerializerMethodField(help_text="The window's start (UTC).")
    end = serializers.SerializerMethodField(help_text="The window's end, exclusive (UTC).")
    unit = serializers.CharField(read_only=True, help_text="gpu, tpu, gaudi, accelerator.")
    currency = serializers.CharField(
        read_only=True, help_text="The rate cards' currency; empty where no card prices the hours."
    )
    billed = BilledMoneyField(help_text="What the statements bill: the three parts together.")
    billed_utilised = BilledMoneyField(help_text="Utilised hours at the rate.")
    billed_idle = BilledMoneyField(help_text="Idle hours at the rate times its idle factor.")
    billed_unmeasured = BilledMoneyField(help_text="Unmeasured hours at the rate.")
    idle_at_list_price = BilledMoneyField(
        help_text="The idle hours at the full rate: what idle would cost without its discount "
        "(context, never billed)."
    )

    @extend_schema_field(serializers.DateTimeField())
    def get_start(self, row: Any) -> str:
        return _iso(self.context["start"])

    @extend_schema_field(serializers.DateTimeField())
    def get_end(self, row: Any) -> str:
        return _iso(self.context["end"])

    @extend_schema_field(serializers.DateTimeField())
    def get_since(self, row: Any) -> str:
        return self.get_start(row)

    @extend_schema_field(serializers.DateTimeField())
    def get_until(self, row: Any) -> str:
        return self.get_end(row)

    @extend_schema_field(serializers.CharField())
    def get_hours(self, row: Any) -> str:
        return hours_label(row.unit)

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        # `start` and `end` come last, after the money, so a spreadsheet that reads the CSV's
        # columns by position keeps working while `since` and `until` are still sent.
        fields = super().get_fields()
        last = (*BILLED_FIGURES, *WINDOW_FIELDS)
        keys = {name: field for name, field in fields.items() if name not in last}
        return keys | {name: fields[name] for name in last}


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


class BilledPersonSerializer(BilledUsageSerializer):
    username = serializers.CharField(
        read_only=True, help_text="Who made the claims; empty where no one is known."
    )


class BilledJobSerializer(BilledUsageSerializer):
    namespace = serializers.CharField(read_only=True)
    job = serializers.CharField(read_only=True, help_text="Kind/name of the claims' owner.")
    usernames = serializers.ListField(
        child=serializers.CharField(), read_only=True, help_text="Who ran the job's claims."
    )


class UnownedQuerySerializer(serializers.Serializer[Any]):
    """The query of `billed/unowned`: a period (the current one when not given)."""

    period = PeriodField(required=False)
    ordering = serializers.CharField(required=False)


class UnownedUsageSerializer(serializers.Serializer[Any]):
    """Hours no team owned (`billing.selectors.UnownedUsage`): the namespace no team owned
    when they were held, its cluster, and their cost at list price."""

    namespace = serializers.CharField(read_only=True)
    cluster = serializers.CharField(read_only=True)
    unit = serializers.CharField(read_only=True)
    currency = serializers.CharField(
        read_only=True, help_text="Empty where no rate card prices the hours."
    )
    allocated_gpu_hours = serializers.DecimalField(max_digits=24, decimal_places=6, read_only=True)
    utilised_gpu_hours = serializers.DecimalField(max_digits=24, decimal_places=6, read_only=True)
    unmeasured_gpu_hours = serializers.DecimalField(max_digits=24, decimal_places=6, read_only=True)
    list_price = BilledMoneyField(help_text="What the hours cost at the rate cards' prices.")

    class Meta:
        # The names `?ordering=` takes (each a field of `UnownedUsage`).
        fields = (
            "namespace",
            "cluster",
            "unit",
            "currency",
            "allocated_gpu_hours",
            "utilised_gpu_hours",
            "unmeasured_gpu_hours",
            "list_price",
        )
