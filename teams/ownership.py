"""Who owned a namespace when: the one writer of dated namespace ownership (`TeamNamespace`)
and the read billing charges hours by.

An hour of usage is charged to the team that owned its namespace in that hour. Ownership
changes take effect from the start of the hour they are made in, so every row's bounds are hour
starts and "the owner of an hour" and "the owner over a span" are one rule: the rows' intervals
intersected with the usage's. A namespace's first owner also takes the hours before it that no
closed billing period holds (`open_since`, given by the caller, who knows the periods): the
claims that ran between install and policy are billed to it, and a closed period's hours stay
unowned (they were billed so). Past hours never change owner afterwards: a move or release
ends the current row at the hour it is made in, never earlier.

Each change sends `ownership_changed` inside its transaction, so billing rolls up again the
hours whose owner it changed, without this app knowing billing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import NamedTuple

from django.db import transaction
from django.db.models import Q
from django.dispatch import Signal

from teams import audit
from teams.models import AuditEntry, Team, TeamNamespace

# Sent inside the writer's transaction, with `namespace`, `since` (the first hour whose owner
# changed; None: every hour before `at` too) and `at` (when it changed).
ownership_changed = Signal()


def hour_floor(moment: datetime) -> datetime:
    """The start of the UTC hour holding `moment`: where an ownership change takes effect."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def assign_namespace(
    *, namespace: str, team: Team, actor: str, at: datetime, open_since: datetime | None
) -> tuple[TeamNamespace, list[AuditEntry]]:
    """Make `team` the owner of `namespace` from the hour of `at`; returns its current row and
    the audit entries written (none when it owns it already).

    A current owner's row ends at that hour (the namespace is never unowned in between). A
    namespace that never had an owner is owned from `open_since` instead (the start of the
    first hour no closed billing period holds; None when none is closed: since always), when
    that is earlier. The caller holds the usage lock (`quota.services.lock_usage`) and the
    periods (so none closes meanwhile); one current row per namespace is also a constraint."""
    since: datetime | None = hour_floor(at)
    with transaction.atomic():
        rows = list(TeamNamespace.dated.select_for_update().filter(namespace=namespace))
        current = next((row for row in rows if row.valid_until is None), None)
        if current is not None and current.team_id == team.pk:
            return current, []
        entries = []
        if current is not None:
            entries += _end(current, until=hour_floor(at), actor=actor)
        elif not rows:
            # The first owner: it takes the namespace's hours in the open periods too.
            since = None if open_since is None else min(hour_floor(at), hour_floor(open_since))
        created = TeamNamespace(team=team, namespace=namespace, valid_from=since)
        entries.append(audit.create(actor=actor, obj=created))
        ownership_changed.send(sender=TeamNamespace, namespace=namespace, since=since, at=at)
    return created, entries


def release_namespace(*, ownership: TeamNamespace, actor: str, at: datetime) -> list[AuditEntry]:
    """End the current `ownership` at the hour of `at`: the namespace's hours from then on are
    no team's (shown as unowned usage) until a team owns it again."""
    with transaction.atomic():
        entries = _end(ownership, until=hour_floor(at), actor=actor)
        ownership_changed.send(
            sender=TeamNamespace, namespace=ownership.namespace, since=hour_floor(at), at=at
        )
    return entries


def _end(ownership: TeamNamespace, *, until: datetime, actor: str) -> list[AuditEntry]:
    before = audit.snapshot(ownership)
    # Never before it began: a row made and ended within one hour owns no hour.
    start = ownership.valid_from
    ownership.valid_until = until if start is None or until >= start else start
    entry = audit.update(actor=actor, obj=ownership, before=before)
    return [entry] if entry is not None else []


class OwnedSpan(NamedTuple):
    """`[start, end)` of a namespace owned by `team_id` (hour starts; None: open-ended)."""

    start: datetime | None
    end: datetime | None
    team_id: int


def owned_spans(
    *, namespaces: Iterable[str], start: datetime, end: datetime
) -> dict[str, list[OwnedSpan]]:
    """Per namespace, the spans its owners held within `[start, end)`, in time order (those
    of no length left out). Where a namespace has no span, no team owned it."""
    rows = (
        TeamNamespace.dated.filter(namespace__in=set(namespaces))
        .filter(Q(valid_from__isnull=True) | Q(valid_from__lt=end))
        .filter(Q(valid_until__isnull=True) | Q(valid_until__gt=start))
        .values_list("namespace", "valid_from", "valid_until", "team_id")
    )
    spans: dict[str, list[OwnedSpan]] = defaultdict(list)
    for namespace, valid_from, valid_until, team_id in rows:
        if valid_from is not None and valid_until is not None and valid_until <= valid_from:
            continue
        spans[namespace].append(OwnedSpan(valid_from, valid_until, team_id))
    for namespace_spans in spans.values():
        namespace_spans.sort(key=lambda span: span.start or datetime.min.replace(tzinfo=UTC))
    return dict(spans)
