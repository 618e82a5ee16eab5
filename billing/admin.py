"""Billing in Django admin: rate cards editable, the rest read-only; every write is a
`billing.services` call, which audits it.

Periods and statements are written by services only (samples and usage are metering's:
`metering.admin`). A period is closed through its "Close period" action, which calls
`billing.services.close_period` (as do `run_billing --close` and, on
TALLY_CLOSE_PERIOD_DAY, Celery beat, whose schedule is edited under "Periodic tasks":
django-celery-beat's own admin). Rate cards are saved and deleted by `billing.services`,
whose rules for a card's values (`rate_card_value_errors`: an ISO 4217 currency, a positive
price, an idle factor from 0 to 1, an end after the start) the form shows on each field; one
that a closed period was priced with keeps its price, idle factor and days there (the same
rule `apply_policy` follows), and is not deleted; the form says so before the save does. Nor
may a card overlap another of its model and profile (one price a day, in any currency, as the
policy file requires). Money shows in its currency's minor unit (`1,388.89 USD`); the API and
the exports keep exact figures.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from billing.models import Period, RateCard, Statement, StatementLine
from billing.periods import PricingError
from billing.pricing import round_money
from billing.rates import (
    closed_periods,
    overlap_error,
    overlapping_card,
    rate_card_value_errors,
    rate_change_error,
)
from billing.services import RATE_CARD_FIELDS, close_period, delete_rate_card, save_rate_card
from teams.admin import ReadOnlyAdmin, number_text


def money_text(amount: Decimal, currency: str) -> str:
    """Money as people read it: to its currency's minor unit, grouped, with the currency."""
    return f"{round_money(amount, currency):,f} {currency}"


def hours_text(hours: Decimal) -> str:
    """GPU-hours to the hundredth, grouped: `123,456.12`."""
    return f"{hours:,.2f}"


class RateCardForm(forms.ModelForm):
    """A rate card whose values keep the rules (`rate_card_value_errors`, each error on its
    field) and that prices no closed period differently than it was billed: checked here to
    show the reason on the form, and again, under lock, by the service that saves it."""

    class Meta:
        model = RateCard
        fields = RATE_CARD_FIELDS

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        for field, message in rate_card_value_errors(cleaned).items():
            self.add_error(field, message)
        if self.errors:
            return cleaned
        stored = RateCard.objects.get(pk=self.instance.pk) if self.instance.pk else None
        wanted = RateCard(
            pk=self.instance.pk, **{name: cleaned.get(name) for name in RATE_CARD_FIELDS}
        )
        error = rate_change_error(before=stored, after=wanted, periods=closed_periods())
        if error:
            raise forms.ValidationError(error)
        other = overlapping_card(wanted, pk=self.instance.pk)
        if other is not None:
            raise forms.ValidationError(overlap_error(wanted, other))
        return cleaned


@admin.register(RateCard)
class RateCardAdmin(admin.ModelAdmin):
    form = RateCardForm
    list_display = RATE_CARD_FIELDS
    list_filter = ("currency", "product_name")
    search_fields = ("product_name", "profile")
    ordering = ("product_name", "profile", "currency", "valid_from")

    def save_model(self, request: HttpRequest, obj: RateCard, form: Any, change: bool) -> None:
        saved = save_rate_card(
            card=obj if change else None,
            values={name: getattr(obj, name) for name in RATE_CARD_FIELDS},
            actor=request.user.get_username(),
        )
        obj.pk = saved.card.pk  # the admin's messages and redirect name the saved card

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and rate_change_error(before=obj, after=None, periods=closed_periods()):
            return False
        return super().has_delete_permission(request, obj)

    def delete_model(self, request: HttpRequest, obj: RateCard) -> None:
        delete_rate_card(card=obj, actor=request.user.get_username())

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[RateCard]) -> None:
        for card in queryset:
            try:
                self.delete_model(request, card)
            except PricingError as exc:
                self.message_user(request, f"Not deleted: {exc}", messages.ERROR)


@admin.register(Period)
class PeriodAdmin(ReadOnlyAdmin):
    list_display = ("name", "start", "end", "closed_at", "closed_by")
    ordering = ("-start",)
    actions = ("close",)

    @admin.display(description="period", ordering="start")
    def name(self, period: Period) -> str:
        """As `run_billing --period` and `statement --period` take it: 2026-11, 2026-W47."""
        return period.label

    @admin.action(description="Close period", permissions=["close"])
    def close(self, request: HttpRequest, queryset: QuerySet[Period]) -> None:
        for period in queryset.order_by("start"):
            try:
                statements = close_period(period=period, actor=request.user.get_username())
            except PricingError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                continue
            self.message_user(
                request, f"Closed period {period.label}: {len(statements)} statement(s) frozen."
            )

    def has_close_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("billing.change_period")


class StatementLineInline(admin.TabularInline):
    """The lines in the columns that price them (utilised = allocated - idle - unmeasured), to
    fit the window; every figure, exact, is in the API and its CSV (/api/v1/statement-lines/)."""

    model = StatementLine
    fields = (
        "kind",
        "product",
        "allocated",
        "idle",
        "unmeasured",
        "rate_shown",
        "idle_factor_shown",
        "amount_shown",
        "note",
    )
    readonly_fields = fields
    extra = 0
    can_delete = False

    @admin.display(description="model")
    def product(self, line: StatementLine) -> str:
        return f"{line.product_name} {line.profile}".strip() or "-"

    @admin.display(description="allocated GPU-h")
    def allocated(self, line: StatementLine) -> str:
        return hours_text(line.allocated_gpu_hours)

    @admin.display(description="idle GPU-h")
    def idle(self, line: StatementLine) -> str:
        return hours_text(line.idle_gpu_hours)

    @admin.display(description="unmeasured GPU-h")
    def unmeasured(self, line: StatementLine) -> str:
        return hours_text(line.unmeasured_gpu_hours)

    @admin.display(description="rate")
    def rate_shown(self, line: StatementLine) -> str:
        """Per GPU-hour, or marked `/slice-h` for an hour of one MIG slice (as `statement`)."""
        if line.rate is None:
            return "-"
        return f"{number_text(line.rate)}{'/slice-h' if line.gpu_share else ''}"

    @admin.display(description="idle factor")
    def idle_factor_shown(self, line: StatementLine) -> str:
        return "-" if line.idle_factor is None else number_text(line.idle_factor)

    @admin.display(description="amount")
    def amount_shown(self, line: StatementLine) -> str:
        return money_text(line.amount, line.statement.currency)

    @admin.display(description="note")
    def note(self, line: StatementLine) -> str:
        """The reason, and what an adjustment corrects and who made it."""
        parts = [line.reason]
        if line.corrects_period_id:
            parts.append(f"corrects {line.corrects_period}")
        if line.created_by:
            parts.append(f"by {line.created_by}")
        return "; ".join(part for part in parts if part) or "-"

    def get_queryset(self, request: HttpRequest) -> QuerySet[StatementLine]:
        return super().get_queryset(request).select_related("statement", "corrects_period")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Statement)
class StatementAdmin(ReadOnlyAdmin):
    list_display = ("team", "period", "currency", "total_shown", "computed_at")
    list_filter = ("period", "currency", "team")
    search_fields = ("team__slug",)
    list_select_related = ("team", "period")
    fields = ("team", "period", "currency", "total_shown", "computed_at")
    readonly_fields = ("total_shown",)
    inlines = (StatementLineInline,)

    @admin.display(description="total", ordering="total")
    def total_shown(self, statement: Statement) -> str:
        return money_text(statement.total, statement.currency)
