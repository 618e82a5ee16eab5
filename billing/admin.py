"""Billing in Django admin: rate cards and budgets editable and audited, the rest read-only.

Samples, usage, periods and statements are written by services only. A period is closed
through its "Close period" action, which calls `billing.pricing.close_period` (or by
`run_billing --close`, or on TALLY_CLOSE_PERIOD_DAY by Celery beat, whose schedule is edited
under "Periodic tasks": django-celery-beat's own admin). A rate card
that a closed period was priced with keeps its price, idle factor and days there (the same
rule `apply_policy` follows), and is not deleted. Agent tokens show their hash: the token
itself is never stored.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from billing.models import (
    AgentToken,
    Budget,
    DirtyHour,
    Period,
    RateCard,
    Sample,
    Statement,
    StatementLine,
    UnknownDeviceSample,
    UsageHour,
)
from billing.pricing import PricingError, close_period, period_label
from quota.admin import AuditedAdmin, ReadOnlyAdmin
from quota.policy import closed_periods, rate_change_error

_RATE_FIELDS = (
    "product_name",
    "profile",
    "currency",
    "valid_from",
    "valid_until",
    "per_gpu_hour",
    "idle_factor",
)


@admin.register(AgentToken)
class AgentTokenAdmin(ReadOnlyAdmin):
    list_display = ("cluster", "node", "created_at", "revoked_at")
    list_filter = ("cluster",)
    search_fields = ("node", "token_sha256")
    fields = ("cluster", "node", "token_sha256", "created_at", "revoked_at")


@admin.register(Sample)
class SampleAdmin(ReadOnlyAdmin):
    list_display = ("device_uuid", "ts_ms", "gpu_util", "mem_used_bytes", "node", "received_at")
    search_fields = ("device_uuid", "node")
    show_full_result_count = False


@admin.register(UnknownDeviceSample)
class UnknownDeviceSampleAdmin(SampleAdmin):
    pass


@admin.register(DirtyHour)
class DirtyHourAdmin(ReadOnlyAdmin):
    list_display = ("hour", "marked_at")
    ordering = ("-hour",)


@admin.register(UsageHour)
class UsageHourAdmin(ReadOnlyAdmin):
    list_display = (
        "hour",
        "team",
        "namespace",
        "claim_name",
        "product_name",
        "profile",
        "allocated_gpu_ms",
        "utilised_gpu_ms",
    )
    list_filter = ("team", "product_name")
    search_fields = ("namespace", "claim_name", "device_uuid", "job", "username")
    list_select_related = ("team",)
    date_hierarchy = "hour"
    ordering = ("-hour",)
    show_full_result_count = False


class RateCardForm(forms.ModelForm):
    """A rate card that prices no closed period differently than it was billed."""

    class Meta:
        model = RateCard
        fields = _RATE_FIELDS

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.errors:
            return cleaned
        stored = RateCard.objects.get(pk=self.instance.pk) if self.instance.pk else None
        wanted = RateCard(**{name: cleaned.get(name) for name in _RATE_FIELDS})
        error = rate_change_error(before=stored, after=wanted, periods=closed_periods())
        if error:
            raise forms.ValidationError(error)
        return cleaned


@admin.register(RateCard)
class RateCardAdmin(AuditedAdmin):
    form = RateCardForm
    list_display = _RATE_FIELDS
    list_filter = ("currency", "product_name")
    search_fields = ("product_name", "profile")
    ordering = ("product_name", "profile", "currency", "valid_from")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and rate_change_error(before=obj, after=None, periods=closed_periods()):
            return False
        return super().has_delete_permission(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        periods = closed_periods()
        for card in queryset:
            error = rate_change_error(before=card, after=None, periods=periods)
            if error:
                self.message_user(request, f"Not deleted: {error}", messages.ERROR)
            else:
                self.delete_model(request, card)


@admin.register(Budget)
class BudgetAdmin(AuditedAdmin):
    list_display = ("team", "gpu_hours", "mode")
    list_filter = ("mode",)
    search_fields = ("team__slug", "team__name")
    list_select_related = ("team",)


@admin.register(Period)
class PeriodAdmin(ReadOnlyAdmin):
    list_display = ("name", "start", "end", "closed_at", "closed_by")
    ordering = ("-start",)
    actions = ("close",)

    @admin.display(description="period", ordering="start")
    def name(self, period: Period) -> str:
        """As `run_billing --period` and `statement --period` take it: 2026-11, 2026-W47."""
        return period_label(period.start, period.end)

    @admin.action(description="Close period", permissions=["close"])
    def close(self, request: HttpRequest, queryset: QuerySet[Period]) -> None:
        for period in queryset.order_by("start"):
            try:
                statements = close_period(period=period, actor=request.user.get_username())
            except PricingError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                continue
            self.message_user(
                request, f"Closed period {period}: {len(statements)} statement(s) frozen."
            )

    def has_close_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("billing.change_period")


class StatementLineInline(admin.TabularInline):
    model = StatementLine
    fields = (
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
        "corrects_period",
        "reason",
        "created_by",
    )
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Statement)
class StatementAdmin(ReadOnlyAdmin):
    list_display = ("team", "period", "currency", "total", "computed_at")
    list_filter = ("period", "currency", "team")
    search_fields = ("team__slug",)
    list_select_related = ("team", "period")
    inlines = (StatementLineInline,)
