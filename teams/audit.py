"""The audit trail of teams, memberships, namespaces and quota rules.

Every create, update and delete of those made by `apply_policy` or the admin goes through
`create`, `update` or `delete` here, which write the change and its `AuditEntry` in one
transaction. A field an app keeps itself under concurrency (a quota rule's `in_use`, which
`quota.ledger` writes) is registered as unaudited (`register_unaudited`): it is not in a
snapshot, and `update` saves only the fields whose snapshot changed, so it never overwrites it.

The apps above teams register what of theirs a team's deletion takes with it
(`register_children`, from their `AppConfig.ready`): teams imports none of them.
"""

from __future__ import annotations

import datetime
import enum
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from decimal import Decimal
from typing import Any

from django.db import models, transaction
from django.utils import timezone

from teams.models import AuditEntry, Team

ACTIONS = ("create", "update", "delete")
# Model -> fields kept by their app under concurrency; never part of a snapshot, never saved
# from here (`register_unaudited`).
_UNAUDITED: dict[type[models.Model], frozenset[str]] = {}
# Deleted with their parent: audited one by one before it, not left to the cascade; teams'
# own here, the apps' above it registered (`register_children`), in that order.
_AUDITED_CHILDREN: dict[type[models.Model], tuple[str, ...]] = {
    Team: ("namespaces", "memberships", "idle_alert_policy", "sso_group_roles"),
}


def register_children(parent: type[models.Model], *relations: str) -> None:
    """Audit the objects of `relations` (reverse relations' names on `parent`) one by one
    when a `parent` is deleted, before it, rather than leaving them to the cascade. Called by
    an app above teams for its models that hang off a team (quota's rules, budget, gang
    policy); registering one twice keeps it once."""
    known = _AUDITED_CHILDREN.get(parent, ())
    _AUDITED_CHILDREN[parent] = known + tuple(name for name in relations if name not in known)


def register_unaudited(model: type[models.Model], *fields: str) -> None:
    """Leave `fields` of `model` out of its snapshots, and so never save them from here: its
    app keeps them itself (quota's `QuotaRule.in_use`)."""
    _UNAUDITED[model] = _UNAUDITED.get(model, frozenset()) | frozenset(fields)


def audited_children(parent: type[models.Model]) -> tuple[str, ...]:
    """The relations of `parent` whose objects a deletion audits one by one, in order."""
    return _AUDITED_CHILDREN.get(parent, ())


def _children(obj: models.Model, relation: str) -> list[models.Model]:
    """The objects of a reverse relation: a manager's rows, or a one-to-one's one (or none)."""
    try:
        related = getattr(obj, relation)
    except models.ObjectDoesNotExist:
        return []
    children = list(related.all()) if hasattr(related, "all") else [related]
    return [child for child in children if child.pk is not None]  # not one deleted already


def snapshot(obj: models.Model) -> dict[str, Any]:
    """The object's audited field values, JSON-safe.

    Foreign keys are shown by the related object's name (a team's slug, a user's username),
    decimals as strings with the field's decimal places, dates in ISO 8601.
    """
    values: dict[str, Any] = {}
    unaudited = _UNAUDITED.get(type(obj), frozenset())
    for field in obj._meta.concrete_fields:
        if field.name in unaudited:
            continue
        if field.is_relation:
            related = getattr(obj, field.name)
            values[field.name] = None if related is None else str(related)
            continue
        values[field.name] = _json_safe(field, getattr(obj, field.attname))
    return values


def _json_safe(field: models.Field, value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Decimal):
        places = getattr(field, "decimal_places", None)
        if places is not None:
            value = value.quantize(Decimal(1).scaleb(-places))
        return format(value, "f")
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


# The moment entries are dated while `dated` is in force; None: when they are written.
_DATED: ContextVar[datetime.datetime | None] = ContextVar("audit_dated", default=None)


@contextmanager
def dated(at: datetime.datetime) -> Iterator[None]:
    """Date the entries written inside at `at` rather than when they are written: for changes
    made as of another moment (`quota.policy.apply_policy(at=...)`, with which the demo lays
    down its history)."""
    token = _DATED.set(at)
    try:
        yield
    finally:
        _DATED.reset(token)


def record(
    *,
    actor: str,
    action: str,
    obj: models.Model,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    name: str | None = None,
) -> AuditEntry:
    """Write one audit entry for a change already made (or about to be, in this transaction);
    `name`: how the entry names `obj`, when not `str(obj)`."""
    if action not in ACTIONS:
        raise ValueError(f"unknown audit action {action!r}; expected one of {ACTIONS}")
    return AuditEntry.objects.create(
        at=_DATED.get() or timezone.now(),
        actor=actor,
        action=action,
        object_type=str(obj._meta.verbose_name),
        object_repr=(str(obj) if name is None else name)[:253],
        before=before,
        after=after,
    )


def create(*, actor: str, obj: models.Model) -> AuditEntry:
    """Insert `obj` and audit it."""
    with transaction.atomic(savepoint=False):
        obj.save()
        return record(actor=actor, action="create", obj=obj, before=None, after=snapshot(obj))


def update(*, actor: str, obj: models.Model, before: dict[str, Any]) -> AuditEntry | None:
    """Save the fields of `obj` that differ from `before` (its snapshot as stored) and audit it.

    Only those fields are written, never a full row. Nothing is written, and None returned,
    when nothing differs.
    """
    after = snapshot(obj)
    changed = [name for name, value in after.items() if before.get(name) != value]
    if not changed:
        return None
    with transaction.atomic(savepoint=False):
        obj.save(update_fields=changed)
        return record(actor=actor, action="update", obj=obj, before=before, after=after)


def delete(*, actor: str, obj: models.Model) -> list[AuditEntry]:
    """Delete `obj`, and first its audited children (a team's namespaces, members, rules).

    Returns the entries written, children first.
    """
    entries: list[AuditEntry] = []
    with transaction.atomic(savepoint=False):
        for relation in audited_children(type(obj)):
            for child in _children(obj, relation):
                entries.extend(delete(actor=actor, obj=child))
        before = snapshot(obj)
        entry = record(actor=actor, action="delete", obj=obj, before=before, after=None)
        obj.delete()
        entries.append(entry)
    return entries
