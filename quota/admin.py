"""Quota in Django admin: teams, their rules and budgets for operators, everything else
read-only.

Edits of teams, memberships and namespaces go through `teams.audit`, so each writes an audit
entry naming the admin user; a rule is saved through `quota.rules.save_rule`, as the policy
file saves it (checked, audited, its `in_use` never saved from here). A save that may change what a
team's rules count (a rule, a namespace) takes the usage lock first and recounts the team's
usage from the ledger in the same transaction (`quota.services.lock_usage`, `recount_usage`),
as `apply_policy` does. A budget is set through `quota.services.set_budget`, as
`apply_policy` sets it. A team's gang policy is edited (audited) on its own page. Reservations,
gangs' holds, their lines, admission decisions and the audit trail are written by services only
and shown read-only.

Memory is shown in binary units (`2 TiB`) beside the exact byte count a limit is edited in; the
API and the exports keep exact figures.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from billing.rates import open_since
from quota import rules, services
from quota.models import (
    AdmissionDecision,
    Budget,
    GangPolicy,
    GangReservation,
    GangReservationLine,
    Mode,
    NarrowingPolicy,
    QuotaRule,
    Reservation,
    ReservationLine,
    Unit,
)
from teams import audit
from teams.admin import ADMIN_CSS, AuditedAdmin, ReadOnlyAdmin, bytes_text, number_text
from teams.models import Membership, Team, TeamNamespace
from teams.ownership import assign_namespace, release_namespace


def quantity_text(amount: Decimal, unit: str) -> str:
    """An amount in a rule's unit as people write it: `2 TiB` of memory, `1.5` GPUs."""
    return bytes_text(amount) if unit == Unit.MEMORY else number_text(amount)


class LimitInput(forms.NumberInput):
    """The exact limit without trailing zeros (`2199023255552`, not `2199023255552.000000`)
    and, for a memory rule, the same in binary units beside it (`= 2 TiB`)."""

    unit: str | None = None

    def format_value(self, value: Any) -> str | None:
        if isinstance(value, Decimal):
            return number_text(value)
        return super().format_value(value)

    def render(self, name: str, value: Any, attrs: Any = None, renderer: Any = None) -> SafeString:
        html = super().render(name, value, attrs, renderer)
        if self.unit != Unit.MEMORY or value in (None, ""):
            return html
        try:
            amount = Decimal(value)
        except InvalidOperation:
            return html
        return format_html('{} <span class="tally-quantity">= {}</span>', html, bytes_text(amount))


class QuotaRuleForm(forms.ModelForm):
    """A rule whose selector must compile, and whose unit stays while capacity is in use."""

    class Meta:
        model = QuotaRule
        fields = ("team", "name", "device_class", "selector", "unit", "limit", "mode")
        widgets = {"limit": LimitInput, "selector": forms.Textarea(attrs={"rows": 2})}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "limit" in self.fields:
            self.fields["limit"].widget.unit = self.instance.unit if self.instance.pk else None

    def clean_selector(self) -> str:
        selector = str(self.cleaned_data.get("selector") or "").strip()
        error = rules.selector_error(selector)
        if error is not None:
            raise forms.ValidationError(error)
        return selector

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if "unit" in self.changed_data and "unit" in cleaned:
            # The instance is the rule as stored until the form's values are put on it, after
            # `clean`.
            error = rules.unit_change_error(stored=self.instance, unit=cleaned["unit"])
            if error is not None:
                self.add_error("unit", error)
        return cleaned


def save_rule_from_admin(request: HttpRequest, obj: QuotaRule, *, recount: bool) -> None:
    """Save the rule the admin's form filled in through `quota.rules.save_rule`, as the policy
    file does; the form's object takes the saved row's key (its messages and links)."""
    stored = QuotaRule.objects.filter(pk=obj.pk).first() if obj.pk else None
    saved = rules.save_rule(
        team=obj.team,
        stored=stored,
        values=rules.RuleValues(
            name=obj.name,
            device_class=obj.device_class,
            selector=obj.selector,
            unit=obj.unit,
            limit=obj.limit,
            mode=obj.mode,
        ),
        actor=request.user.get_username(),
        recount=recount,
    )
    obj.pk = saved.rule.pk
    obj._state.adding = False


class QuotaRuleInlineForm(QuotaRuleForm):
    """A rule as one row of the team's table: the unit's and mode's short names, explained in
    the columns' help, so that the row fits the window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unit, mode = self.fields["unit"], self.fields["mode"]
        unit.choices = [(Unit.GPUS, "GPUs"), (Unit.MEMORY, "bytes")]  # type: ignore[attr-defined]
        unit.help_text = "GPUs: GPU-equivalents (a MIG slice counts its share); bytes: of memory"
        mode.choices = [(Mode.ENFORCE, "enforce"), (Mode.WARN, "warn")]  # type: ignore[attr-defined]
        mode.help_text = "enforce: deny past the limit; warn: admit with a warning"


class TeamNamespaceInline(admin.TabularInline):
    """The namespaces the team owns now (saved through `teams.ownership`, dated)."""

    model = TeamNamespace
    extra = 0
    fields = ("namespace", "valid_from")
    readonly_fields = ("valid_from",)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)
    # Set by sign-ins only (teams.sso): one added here is the admin's, which no sign-in takes.
    readonly_fields = ("granted_by_sso",)


class InUseMixin:
    """A rule's limit and usage in its unit, for the rule's list and the team's table."""

    @admin.display(description="in use")
    def in_use_shown(self, rule: QuotaRule | None) -> str:
        return quantity_text(rule.in_use, rule.unit) if rule and rule.pk else "-"

    @admin.display(description="limit", ordering="limit")
    def limit_shown(self, rule: QuotaRule) -> str:
        return quantity_text(rule.limit, rule.unit)


class QuotaRuleInline(InUseMixin, admin.TabularInline):
    model = QuotaRule
    form = QuotaRuleInlineForm
    extra = 0
    fields = ("name", "device_class", "selector", "unit", "limit", "mode", "in_use_shown")
    readonly_fields = ("in_use_shown",)


class RuleRefusalMixin:
    """A rule the form passed but `save_rule` refused (a claim admitted between the form's
    check and the save put its unit in use): the page again with the reason and nothing
    saved (the admin's transaction rolled back), never a 500."""

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        try:
            return super().changeform_view(  # type: ignore[misc]
                request, object_id, form_url, extra_context
            )
        except rules.RuleError as exc:
            messages.error(request, f"Nothing was saved: {exc.field}: {exc}")
            return HttpResponseRedirect(request.get_full_path())


@admin.register(Team)
class TeamAdmin(RuleRefusalMixin, AuditedAdmin):
    list_display = ("slug", "name", "cost_centre", "created_at")
    search_fields = ("slug", "name", "cost_centre", "namespaces__namespace")
    inlines = (TeamNamespaceInline, MembershipInline, QuotaRuleInline)

    class Media:
        css = {"all": (ADMIN_CSS,)}

    # The admin saves the team, then its inlines, in one transaction (the view's).

    def save_model(self, request: HttpRequest, obj: Team, form: Any, change: bool) -> None:
        services.lock_usage(team_ids=[obj.pk] if obj.pk else [])
        super().save_model(request, obj, form, change)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        services.recount_usage(teams=[form.instance], at=timezone.now())

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """The namespaces through `teams.ownership`, as `apply_policy` writes them: dated, a
        removed one released (its past hours stay the team's), a renamed one released and the
        new name owned, a namespace's first owner taking its hours in the open periods. The
        rules through `quota.rules.save_rule`, as `apply_policy` saves them (the team's usage
        is recounted once, in `save_related`)."""
        if formset.model is QuotaRule:
            self._save_rules(request, formset)
            return
        if formset.model is not TeamNamespace:
            super().save_formset(request, form, formset, change)
            return
        actor, now = request.user.get_username(), timezone.now()
        formset.save(commit=False)
        renamed = [obj for obj, fields in formset.changed_objects if "namespace" in fields]
        for obj in [*formset.deleted_objects, *renamed]:
            release_namespace(ownership=TeamNamespace.dated.get(pk=obj.pk), actor=actor, at=now)
        added = [*formset.new_objects, *renamed]
        since = open_since(lock=True) if added else None
        for obj in added:
            assign_namespace(
                namespace=obj.namespace, team=form.instance, actor=actor, at=now, open_since=since
            )

    def _save_rules(self, request: HttpRequest, formset: Any) -> None:
        actor = request.user.get_username()
        formset.save(commit=False)
        for obj in formset.deleted_objects:
            audit.delete(actor=actor, obj=obj)
        for obj in [*formset.new_objects, *(obj for obj, _ in formset.changed_objects)]:
            save_rule_from_admin(request, obj, recount=False)

    def delete_model(self, request: HttpRequest, obj: Team) -> None:
        with transaction.atomic():
            services.lock_usage(team_ids=[obj.pk])
            super().delete_model(request, obj)


class RecountedAdmin(AuditedAdmin):
    """A team's object that its quota usage depends on (a rule, a gang policy): saved (and
    deleted) with the team's usage locked and recounted in the same transaction, as the policy
    file does, so no admission sees the change half made."""

    recount_after_delete: bool

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        with transaction.atomic():
            services.lock_usage(team_ids=[obj.team_id])
            super().save_model(request, obj, form, change)
            services.recount_usage(teams=[obj.team_id], at=timezone.now())

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        with transaction.atomic():
            services.lock_usage(team_ids=[obj.team_id])
            super().delete_model(request, obj)
            if self.recount_after_delete:
                services.recount_usage(teams=[obj.team_id], at=timezone.now())


@admin.register(QuotaRule)
class QuotaRuleAdmin(RuleRefusalMixin, InUseMixin, RecountedAdmin):
    """A rule, saved through `quota.rules.save_rule` (checked, audited, the team's usage
    recounted), as the policy file saves it."""

    form = QuotaRuleForm
    list_display = ("team", "name", "device_class", "unit", "limit_shown", "in_use_shown", "mode")
    list_filter = ("unit", "mode", "device_class", "team")
    search_fields = ("name", "team__slug", "device_class", "selector")
    list_select_related = ("team",)
    readonly_fields = ("in_use_shown",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # Moving a rule would move its reservation lines to another team.
        return ("team", "in_use_shown") if obj is not None else ("in_use_shown",)

    recount_after_delete = False  # its reservation lines go with it

    def save_model(self, request: HttpRequest, obj: QuotaRule, form: Any, change: bool) -> None:
        save_rule_from_admin(request, obj, recount=True)


class ReservationLineInline(admin.TabularInline):
    model = ReservationLine
    fields = ("rule", "amount")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "namespace",
        "cluster",
        "team",
        "state",
        "username",
        "gang_key",
        "created_at",
    )
    list_filter = ("state", "cluster", "team")
    search_fields = ("name", "namespace", "claim_uid", "username", "owner_name", "gang_key")
    list_select_related = ("team",)
    ordering = ("-created_at",)
    inlines = (ReservationLineInline,)
    show_full_result_count = False
    actions = ("expire_stale",)

    @admin.action(description="Release reservations whose claim never appeared (expired)")
    def expire_stale(self, request: HttpRequest, queryset: QuerySet[Reservation]) -> None:
        released = services.expire_reservations(now=timezone.now())
        self.message_user(request, f"{released} expired reservation(s) released")


class GangReservationLineInline(admin.TabularInline):
    model = GangReservationLine
    fields = ("rule", "amount")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(GangReservation)
class GangReservationAdmin(ReadOnlyAdmin):
    """What gangs admitted whole hold for their members to come (written by the webhook and
    `quota.services` only): their members are the reservations of the same gang key."""

    list_display = (
        "key",
        "namespace",
        "cluster",
        "team",
        "size",
        "state",
        "created_at",
        "expires_at",
        "released_at",
    )
    list_filter = ("state", "source", "cluster", "team")
    search_fields = ("key", "namespace")
    list_select_related = ("team",)
    ordering = ("-created_at",)
    inlines = (GangReservationLineInline,)
    show_full_result_count = False


@admin.register(GangPolicy)
class GangPolicyAdmin(RecountedAdmin):
    """How a team's gangs are admitted; a team without one is enforced (see `GangMode`)."""

    list_display = ("team", "mode")
    list_filter = ("mode",)
    search_fields = ("team__slug", "team__name")
    list_select_related = ("team",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # Moving a policy would change two teams' gangs at once: delete and add instead.
        return ("team",) if obj is not None else ()

    # Turning a team's gangs off releases its gang holds in the same transaction, as the
    # policy file does (`recount_usage`), not at the next periodic recount.
    recount_after_delete = True


@admin.register(NarrowingPolicy)
class NarrowingPolicyAdmin(AuditedAdmin):
    """Whether the mutating webhook narrows a team's claims to the models that fit (the policy
    file's `narrowToFit`); a team without one is never narrowed. Usage does not depend on it:
    nothing is recounted."""

    list_display = ("team", "narrow_to_fit")
    list_filter = ("narrow_to_fit",)
    search_fields = ("team__slug", "team__name")
    list_select_related = ("team",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("team",) if obj is not None else ()


@admin.register(ReservationLine)
class ReservationLineAdmin(ReadOnlyAdmin):
    list_display = ("reservation", "rule", "amount")
    list_filter = ("rule__team",)
    search_fields = ("reservation__name", "reservation__namespace", "rule__name")
    list_select_related = ("reservation", "rule", "rule__team")
    show_full_result_count = False


@admin.register(AdmissionDecision)
class AdmissionDecisionAdmin(ReadOnlyAdmin):
    list_display = ("at", "namespace", "name", "username", "team", "webhook", "allowed", "dry_run")
    list_filter = ("allowed", "webhook", "team", "dry_run")
    search_fields = ("name", "namespace", "username", "uid", "message")
    list_select_related = ("team",)
    ordering = ("-at",)
    date_hierarchy = "at"
    show_full_result_count = False


@admin.register(Budget)
class BudgetAdmin(AuditedAdmin):
    list_display = ("team", "gpu_hours", "unit", "mode")
    list_filter = ("mode", "unit")
    search_fields = ("team__slug", "team__name")
    list_select_related = ("team",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # A budget is its team's: another team's is set on that team.
        return ("team",) if obj is not None else ()

    def save_model(self, request: HttpRequest, obj: Budget, form: Any, change: bool) -> None:
        budget, _ = services.set_budget(
            team=obj.team,
            gpu_hours=obj.gpu_hours,
            mode=obj.mode,
            unit=obj.unit,
            actor=request.user.get_username(),
        )
        obj.pk = budget.pk  # the admin's messages and links name the saved budget
