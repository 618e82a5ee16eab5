"""The admin's bases for audited and read-only models, how it shows numbers, and the audit
trail itself."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.contrib import admin
from django.db import models
from django.db.models import QuerySet
from django.forms import BaseFormSet
from django.http import HttpRequest

from teams import audit
from teams.models import AuditEntry


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
