"""The alert channel: alerts raised and resolved by the evaluations above this app (idle claims,
stranded gangs, undocumented version outliers), each notified once when it fires and once when
it resolves.

An evaluation calls `sync_alerts(kind=..., raised=[...], now=...)` with every condition it finds
live now: each is raised (`raise_alert`: idempotent, one firing row per kind and key, however
many evaluations run at once) and every firing alert of that kind not among them is resolved
(`resolve_missing`). Raising plans the firing notifications (`AlertDelivery`: one email to the
alert's recipients, one Alertmanager webhook per TALLY_ALERT_WEBHOOK_URLS), resolving plans the
resolved ones for what was sent; `teams.alert_delivery` sends them. A snoozed alert's firing
notification waits for the snooze to end (and is dropped if the alert resolves first); the
snooze is kept per key, so a claim that goes idle again within it stays quiet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Max, Q, QuerySet

from db.locks import advisory_xact_lock, text_key
from teams import audit
from teams.models import (
    Alert,
    AlertDelivery,
    AlertKind,
    AlertState,
    DeliveryState,
    Membership,
    Role,
    Team,
)
from teams.selectors import user_role, visible_teams

EMAIL = "email"
WEBHOOK = "webhook"


@dataclass(frozen=True)
class RaisedAlert:
    """A condition an evaluation finds live now, as `raise_alert` takes it."""

    kind: AlertKind
    key: str
    subject: str
    team: Team | None = None
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    recipients: tuple[str, ...] = ()


@dataclass(frozen=True)
class SyncReport:
    """What one `sync_alerts` did: alerts newly firing, still firing, and resolved."""

    raised: list[Alert]
    ongoing: list[Alert]
    resolved: list[Alert]


def sync_alerts(*, kind: AlertKind, raised: Sequence[RaisedAlert], now: datetime) -> SyncReport:
    """Raise each of `raised` (all of `kind`), then resolve the firing alerts of `kind` that are
    not among them. Each raise is its own transaction, so one evaluation never holds many rows."""
    new: list[Alert] = []
    ongoing: list[Alert] = []
    for spec in raised:
        if spec.kind != kind:
            raise ValueError(f"{spec.key}: an alert of kind {spec.kind}, not {kind}")
        alert, created = raise_alert(spec=spec, now=now)
        (new if created else ongoing).append(alert)
    resolved = resolve_missing(kind=kind, live_keys={spec.key for spec in raised}, now=now)
    return SyncReport(raised=new, ongoing=ongoing, resolved=resolved)


def raise_alert(*, spec: RaisedAlert, now: datetime) -> tuple[Alert, bool]:
    """The firing alert of `spec`'s kind and key, created if there is none; whether it was.

    Guarantees: at most one firing row per kind and key under any concurrency (the partial
    unique constraint `alert_one_firing_per_key`; a racing insert finds the other's row and
    updates it instead); its subject, description, labels and recipients are the latest seen,
    `last_seen` is `now`; its firing notifications are planned once (`AlertDelivery` is unique
    per alert, event, channel and target). A new row inherits the snooze of its key's earlier
    alerts while it lasts.
    """
    team_id = spec.team.pk if spec.team is not None else None
    values = {
        "team_id": team_id,
        "subject": spec.subject[:300],
        "description": spec.description,
        "labels": spec.labels,
        "recipients": list(spec.recipients),
        "last_seen": now,
    }
    with transaction.atomic():
        _lock_key(spec.kind, spec.key)
        alert = _firing(spec.kind, spec.key)
        created = False
        if alert is None:
            # The team's own snooze: a key (a claim's namespace) may move to another team,
            # whose lead did not silence it.
            snoozed = Alert.objects.filter(
                _of_team(team_id), kind=spec.kind, key=spec.key, snoozed_until__gt=now
            ).aggregate(until=Max("snoozed_until"))["until"]
            try:
                with transaction.atomic():
                    alert = Alert.objects.create(
                        kind=spec.kind,
                        key=spec.key,
                        first_seen=now,
                        snoozed_until=snoozed,
                        **values,
                    )
                created = True
            except IntegrityError:
                # Another evaluation inserted it since: its row (committed) is the one.
                alert = _firing(spec.kind, spec.key)
                if alert is None:
                    raise
        if not created:
            changed = [name for name, value in values.items() if getattr(alert, name) != value]
            if "team_id" in changed and alert.snoozed_until is not None:
                # Now another team's alert: the snooze the other team set does not carry over.
                values.update(snoozed_until=None, snoozed_by="")
                changed += ["snoozed_until", "snoozed_by"]
            for name in changed:
                setattr(alert, name, values[name])
            alert.save(update_fields=changed)
        _plan(alert, event=AlertState.FIRING, now=now, targets=_all_targets())
    return alert, created


def _of_team(team_id: int | None) -> Q:
    """The alerts of the team numbered `team_id` (None: the fleet's, of no team)."""
    return Q(team__isnull=True) if team_id is None else Q(team_id=team_id)


def _lock_key(kind: str, key: str) -> None:
    """Hold the alert key's lock to the end of the transaction: taken first by whatever writes
    the key's rows (a raise, a snooze, a lift), so a new alert inherits the snooze state the
    last writer committed, and a lift through one row never waits in a cycle with a lift
    through another row of the key."""
    advisory_xact_lock("teams.alert.key", [text_key(kind, key)])


def _firing(kind: str, key: str) -> Alert | None:
    return (
        Alert.objects.select_for_update()
        .filter(kind=kind, key=key, state=AlertState.FIRING)
        .first()
    )


def resolve_missing(*, kind: AlertKind, live_keys: Iterable[str], now: datetime) -> list[Alert]:
    """Resolve the firing alerts of `kind` whose keys are not in `live_keys`; the alerts resolved.

    Guarantees: each alert is resolved once (rows locked, skipped if another run holds them);
    only the alerts to resolve are locked, never the live ones a concurrent raise updates; a
    resolved notification is planned for each channel its firing one went out on, and a
    firing one not sent yet (snoozed, or its receiver down) is dropped.
    """
    live = set(live_keys)
    stale = [
        pk
        for pk, key in Alert.objects.filter(kind=kind, state=AlertState.FIRING).values_list(
            "pk", "key"
        )
        if key not in live
    ]
    return resolve_alerts(pks=stale, now=now)


def resolve_alerts(*, pks: Iterable[int], now: datetime) -> list[Alert]:
    """Resolve the firing alerts numbered `pks`, as `resolve_missing` does; the alerts
    resolved."""
    stale = list(pks)
    resolved = []
    with transaction.atomic():
        # Still firing once locked (the condition is checked again on the locked row).
        candidates = (
            Alert.objects.select_for_update(skip_locked=True)
            .filter(pk__in=stale, state=AlertState.FIRING)
            .order_by("pk")
        )
        for alert in candidates:
            alert.state = AlertState.RESOLVED
            alert.resolved_at = now
            alert.save(update_fields=["state", "resolved_at"])
            firing = alert.deliveries.filter(event=AlertState.FIRING)
            # Waits for a notification being sent now (its row locked), then skips it only if
            # it did not go out.
            firing.filter(state=DeliveryState.PENDING).update(
                state=DeliveryState.SKIPPED, detail="resolved before it was sent"
            )
            sent = firing.filter(state=DeliveryState.SENT).values_list("channel", "target")
            _plan(alert, event=AlertState.RESOLVED, now=now, targets=list(sent))
            resolved.append(alert)
    return resolved


def _all_targets() -> list[tuple[str, str]]:
    return [(EMAIL, ""), *((WEBHOOK, url) for url in settings.TALLY_ALERT_WEBHOOK_URLS)]


def _plan(alert: Alert, *, event: str, now: datetime, targets: list[tuple[str, str]]) -> None:
    """A pending notification of `event` per target, unless one was planned already."""
    planned = set(alert.deliveries.filter(event=event).values_list("channel", "target"))
    AlertDelivery.objects.bulk_create(
        [
            AlertDelivery(
                alert=alert, event=event, channel=channel, target=target, next_attempt_at=now
            )
            for channel, target in targets
            if (channel, target) not in planned
        ],
        ignore_conflicts=True,  # planned meanwhile by a run that did not hold the row
    )


def snooze_alert(*, alert: Alert, until: datetime | None, actor: str) -> Alert:
    """Silence `alert`'s key, for its team, until `until` (None: lift the snooze), audited as
    `actor`.

    A firing notification not sent yet waits until then; resolved ones still go out. The
    key's next alerts of the same team inherit the snooze while it lasts (`raise_alert`); a
    key that moves to another team (a namespace handed over) is not silenced for it.
    """
    with transaction.atomic():
        _lock_key(alert.kind, alert.key)
        locked = Alert.objects.select_for_update().get(pk=alert.pk)
        before = audit.snapshot(locked)
        locked.snoozed_until = until
        locked.snoozed_by = actor if until is not None else ""
        audit.update(actor=actor, obj=locked, before=before)
        if until is None:
            # Lifted for the team's whole key: its earlier rows would otherwise pass theirs on.
            Alert.objects.filter(
                _of_team(locked.team_id), kind=locked.kind, key=locked.key
            ).exclude(pk=locked.pk).filter(snoozed_until__isnull=False).update(
                snoozed_until=None, snoozed_by=""
            )
    return locked


def team_leads(team: Team) -> list[str]:
    """The usernames of `team`'s leads, sorted."""
    return sorted(
        Membership.objects.filter(team=team, role=Role.LEAD).values_list(
            "user__username", flat=True
        )
    )


def operator_recipients() -> list[str]:
    """Who fleet-wide alerts go to: TALLY_OPERATOR_EMAILS, else the active staff users."""
    if settings.TALLY_OPERATOR_EMAILS:
        return list(settings.TALLY_OPERATOR_EMAILS)
    user_model = get_user_model()
    return sorted(
        user.get_username()
        for user in user_model._default_manager.filter(
            Q(is_staff=True) | Q(is_superuser=True), is_active=True
        )
    )


def recipient_addresses(recipients: Iterable[str]) -> list[str]:
    """Email addresses of `recipients`: an entry with an @ is one; a username gives its
    user's address (active users with one); others give none. Sorted, each once."""
    names = [name for name in recipients if "@" not in name]
    addresses = {name for name in recipients if "@" in name}
    user_model = get_user_model()
    for user in user_model._default_manager.filter(
        **{f"{user_model.USERNAME_FIELD}__in": names}, is_active=True
    ).exclude(email=""):
        addresses.add(user.email)
    return sorted(addresses)


def visible_alerts(*, user: Any) -> QuerySet[Alert]:
    """The alerts `user` may read: operators every one, fleet-wide ones too; finance and leads
    those of the teams they see (`visible_teams`)."""
    if user_role(user) == "operator":
        return Alert.objects.all()
    return Alert.objects.filter(team__in=visible_teams(user=user))


def may_snooze(*, user: Any, alert: Alert) -> bool:
    """Operators snooze any alert; a team's leads the alerts of their team."""
    return may_snooze_team(user=user, team_id=alert.team_id)


def may_snooze_team(*, user: Any, team_id: int | None) -> bool:
    """Whether `user` may snooze the alerts of the team `team_id` (None: fleet-wide alerts,
    operators only)."""
    if user_role(user) == "operator":
        return True
    return (
        team_id is not None
        and Membership.objects.filter(team_id=team_id, user=user, role=Role.LEAD).exists()
    )
