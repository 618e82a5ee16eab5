"""The admin's bases for audited and read-only models, how it shows numbers, and the audit
trail itself."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db import models
from django.db.models import QuerySet
from django.forms import BaseFormSet
from django.http import HttpRequest
from django.utils import timezone
from knox.models import AuthToken

from teams import audit
from teams.alerts import snooze_alert
from teams.models import Alert, AlertDelivery, AuditEntry, IdleAlertPolicy
from teams.selectors import user_role
from teams.tokens import MAX_DAYS, create_token, default_days, revoke_tokens


def _stored(obj: models.Model) -> dict[str, Any]:
    """The snapshot of `obj` as the database holds it, before the form's changes are saved."""
    return audit.snapshot(type(obj)._default_manager.get(pk=obj.pk))


# The admin's own stylesheet (teams/static/teams/admin.css): wide inlines fit the window.
ADMIN_CSS = "teams/admin.css"

_IEC_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def number_text(value: Decimal | int) -> str:
    """A decimal without its trailing zeros or an exponent: `16`, `2.5`, not `16.000000`."""
    text = f"{Decimal(value):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def bytes_text(value: Decimal | int) -> str:
    """Bytes in the largest binary unit that leaves at least 1, to three decimals at most:
    `2 TiB`, `640 GiB`, `1.5 KiB`; exact figures stay in the exports and the API."""
    amount, exponent = Decimal(value), 0
    while abs(amount) >= 1024 and exponent < len(_IEC_UNITS) - 1:
        amount, exponent = amount / 1024, exponent + 1
    return f"{number_text(round(amount, 3))} {_IEC_UNITS[exponent]}"


class AuditedAdmin(admin.ModelAdmin):
    """Saves, deletes and inline formsets go through `teams.audit`, as the admin user."""

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        actor = request.user.get_username()
        if change:
            audit.update(actor=actor, obj=obj, before=_stored(obj))
        else:
            audit.create(actor=actor, obj=obj)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        audit.delete(actor=request.user.get_username(), obj=obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for obj in queryset:
            self.delete_model(request, obj)

    def save_formset(
        self, request: HttpRequest, form: Any, formset: BaseFormSet, change: bool
    ) -> None:
        actor = request.user.get_username()
        formset.save(commit=False)  # type: ignore[attr-defined]
        for obj in formset.deleted_objects:  # type: ignore[attr-defined]
            audit.delete(actor=actor, obj=obj)
        for obj in formset.new_objects:  # type: ignore[attr-defined]
            audit.create(actor=actor, obj=obj)
        for obj, _ in formset.changed_objects:  # type: ignore[attr-defined]
            audit.update(actor=actor, obj=obj, before=_stored(obj))
        formset.save_m2m()  # type: ignore[attr-defined]


class ReadOnlyAdmin(admin.ModelAdmin):
    """Written by services only: viewable, never added, changed or deleted by hand."""

    class Media:
        css = {"all": (ADMIN_CSS,)}

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("at", "actor", "action", "object_type", "object_repr")
    list_filter = ("action", "object_type")
    search_fields = ("actor", "object_repr")
    ordering = ("-at",)
    date_hierarchy = "at"
    show_full_result_count = False


class TokenCreateForm(forms.ModelForm):
    """A new API token: its user and for how many days it is valid (never without expiry)."""

    days = forms.IntegerField(
        min_value=1,
        max_value=MAX_DAYS,
        initial=default_days,
        help_text="The token stops working this many days from now.",
    )

    class Meta:
        model = AuthToken
        fields = ["user"]

    def clean_user(self) -> Any:
        user = self.cleaned_data["user"]
        if not user.is_active:
            raise forms.ValidationError(f"user {user.get_username()!r} is inactive")
        return user


# knox's own admin lets a token be made with no expiry (valid for ever) or one in the past,
# and makes and deletes tokens without the audit trail; this one goes through teams.tokens.
admin.site.unregister(AuthToken)


@admin.register(AuthToken)
class TokenAdmin(admin.ModelAdmin):
    list_display = ("token_key", "user", "created", "expiry")
    search_fields = ("token_key", "user__username")
    ordering = ("-created",)
    fields = ("token_key", "user", "created", "expiry")
    readonly_fields = fields

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ("user", "days") if obj is None else self.fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return () if obj is None else self.readonly_fields

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        if obj is None:
            kwargs["form"] = TokenCreateForm
            kwargs["fields"] = ["user", "days"]
        return super().get_form(request, obj, change, **kwargs)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a token is revoked (deleted) and made anew, never edited

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        new = create_token(
            user=form.cleaned_data["user"],
            days=form.cleaned_data["days"],
            actor=request.user.get_username(),
        )
        stored = AuthToken.objects.get(token_key=new.key)
        for name in ("digest", "token_key", "created", "expiry"):
            setattr(obj, name, getattr(stored, name))
        self.message_user(
            request,
            f"TOKEN {new.token}",
            messages.INFO,
        )
        self.message_user(
            request,
            f"Token {new.key} for {stored.user} expires {new.expiry:%Y-%m-%d %H:%M} UTC. "
            "Copy it now: only its hash is kept.",
            messages.WARNING,
        )

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        revoke_tokens(user=obj.user, key=obj.token_key, actor=request.user.get_username())

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for token in queryset.select_related("user"):
            self.delete_model(request, token)

    # The audit trail records tokens by key; the admin's own log would name them by digest.
    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None

    def log_deletions(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        return []


class AlertDeliveryInline(admin.TabularInline):
    """What was sent of an alert, and to whom; written by `teams.alert_delivery` only."""

    model = AlertDelivery
    fields = ("event", "channel", "target", "state", "attempts", "sent_at", "detail")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


_SNOOZES = {"4 hours": timedelta(hours=4), "a day": timedelta(days=1), "a week": timedelta(days=7)}


def _snooze_action(label: str, length: timedelta | None) -> Any:
    def action(model_admin: AlertAdmin, request: HttpRequest, queryset: QuerySet[Alert]) -> None:
        until = None if length is None else timezone.now() + length
        for alert in queryset:
            snooze_alert(alert=alert, until=until, actor=request.user.get_username())
        done = (
            "lifted the snooze of" if until is None else f"snoozed until {until:%Y-%m-%d %H:%M} UTC"
        )
        model_admin.message_user(request, f"{done} {queryset.count()} alert(s)", messages.SUCCESS)

    name = "unsnooze" if length is None else f"snooze_{int(length.total_seconds())}"
    action.__name__ = name
    description = "Lift the snooze" if length is None else f"Snooze for {label}"
    return admin.action(description=description, permissions=["snooze"])(action)


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    """Alerts, firing and resolved, with their notifications. Operators snooze a key: nothing
    is sent for it until then (resolved notifications excepted)."""

    list_display = (
        "kind",
        "subject",
        "team",
        "state",
        "first_seen",
        "last_seen",
        "resolved_at",
        "snoozed_until",
    )
    list_filter = ("state", "kind", "team")
    search_fields = ("key", "subject")
    ordering = ("-last_seen",)
    date_hierarchy = "first_seen"
    show_full_result_count = False
    list_select_related = ("team",)
    readonly_fields = (
        "kind",
        "key",
        "team",
        "subject",
        "description",
        "labels",
        "recipients",
        "state",
        "first_seen",
        "last_seen",
        "resolved_at",
        "snoozed_until",
        "snoozed_by",
    )
    inlines = (AlertDeliveryInline,)
    actions = [
        *(_snooze_action(label, length) for label, length in _SNOOZES.items()),
        _snooze_action("", None),
    ]

    def has_snooze_permission(self, request: HttpRequest) -> bool:
        return user_role(request.user) == "operator"


@admin.register(IdleAlertPolicy)
class IdleAlertPolicyAdmin(ReadOnlyAdmin):
    """Set by the policy file's `idleAlert` (quota.policy); shown here. A team with no row has
    the default rule (TALLY_IDLE_ALERT_DEFAULT_*); `enabled` off is `idleAlert: off`."""

    list_display = ("team", "enabled", "below_percent", "for_hours")
    list_select_related = ("team",)
