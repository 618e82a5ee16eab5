"""Quota's writes outside the admission hot path (the webhook reserves through
`quota.admission`), and the ledger they keep true.

The ledger: a rule's `in_use` is the sum of the live reservation lines on it, and each live
reservation's lines are what its claim holds now on the rules of the team that owns the claim's
namespace: a claim the scheduler allocated, exactly its allocated devices the rule covers; one
not yet allocated, what its requests can take. `recount_usage` works that out from scratch,
and every change that can change what a rule counts (a rule, a namespace, its team) calls it
in the same transaction, so usage never depends on the order in which claims, syncs and policy
changes arrived. `reconcile_usage` recounts every rule and reports (and fixes) any drift.

A gang admitted whole (`quota.admission.gang_weighing.weigh_gang`) also holds, until its members
have drawn it, what it reserved for them: a live `GangReservation`'s lines count on the rules
beside the reservations' lines, and the recount counts them too.

`sync_reservations` turns a reservation into the exact allocated devices once the scheduler has
allocated, and releases it when the claim goes: a member of a gang still live gives its share
back to the gang's hold, for its replacement; the last member's release ends the gang and frees
its hold. `expire_reservations` frees what was reserved for claims that never appeared, and
what gangs held for members that did not appear in time; `set_budget` gives a team its budget
(in hours of one unit).

The ledger itself (`in_use` and the lines) is written through `quota.ledger`, its only writer.
Every write of usage here takes `lock_usage` first: the usage lock, then the rules it changes
in id order, the order in which the webhook's reserving statement locks a team's rules, so the
two serialize and never wait on each other in a cycle.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from core import metrics
from db.bulk import AnyOf
from db.locks import advisory_xact_lock
from inventory.creators import record_claim_creator
from inventory.models import Allocation, Cluster, Gang, ResourceClaim
from inventory.models import Unit as DeviceUnit
from inventory.owners import is_controller
from quota import ledger
from quota.admission.decision import claim_amounts
from quota.admission.demand import per_device
from quota.admission.shapes import FleetShapes, Shape, covers, load_fleet, shape_of
from quota.models import (
    Budget,
    GangMode,
    GangPolicy,
    GangReservation,
    QuotaRule,
    Reservation,
    ReservationState,
)
from teams import audit
from teams.models import AuditEntry, Team, TeamNamespace

log = logging.getLogger(__name__)


def set_budget(
    *, team: Team, gpu_hours: Decimal, mode: str, actor: str, unit: str = DeviceUnit.GPU
) -> tuple[Budget, AuditEntry | None]:
    """Give `team` a budget of `gpu_hours` hours of `unit` per period (GPU-hours by default;
    `mode`: "hard" denies new claims of devices of that unit past it, "soft" warns), or change
    the one it has.

    Guarantees: the team's row is locked while its budget is written, so concurrent changes
    apply one after the other and none is lost; only what differs is written; each change has
    its audit entry naming `actor`. Returns the budget and that entry (None: nothing changed).
    """
    with transaction.atomic():
        Team.objects.select_for_update().only("pk").get(pk=team.pk)
        budget = Budget.objects.filter(team=team).first()
        if budget is None:
            budget = Budget(team=team, gpu_hours=gpu_hours, mode=mode, unit=unit)
            return budget, audit.create(actor=actor, obj=budget)
        before = audit.snapshot(budget)
        budget.gpu_hours, budget.mode, budget.unit = gpu_hours, mode, unit
        return budget, audit.update(actor=actor, obj=budget, before=before)


# --- Locks --------------------------------------------------------------------------------------


def lock_usage(*, team_ids: Iterable[int]) -> list[QuotaRule]:
    """Take the usage lock, then lock the rules of `team_ids` in id order; returns them.

    Whatever changes usage or what a rule counts outside the webhook (a policy change, the
    admin, the sync's reservations, expiry, the recount) takes it first, before it writes
    anything, in the transaction that writes: one writer at a time, so a claim the sync sees
    while a namespace changes team is counted by one of them, and the webhook, which locks a
    team's rules in id order too, is never waited on in a cycle. Held to the end of the
    transaction; taking it again in the same one is free.
    """
    advisory_xact_lock("quota.usage", [0])
    return _lock_rules(set(team_ids))


def _lock_rules(team_ids: set[int]) -> list[QuotaRule]:
    if not team_ids:
        return []
    return list(QuotaRule.objects.select_for_update().filter(team_id__in=team_ids).order_by("pk"))


# --- What a claim holds -----------------------------------------------------------------------


class _Counting:
    """Counts what claims hold on rules against each cluster's fleet as stored now (its shapes
    and device classes), loaded once per transaction and only when needed."""

    def __init__(self) -> None:
        self._fleets: dict[str, FleetShapes] = {}

    def fleet(self, cluster: str) -> FleetShapes:
        fleet = self._fleets.get(cluster)
        if fleet is None:
            row = Cluster.objects.filter(name=cluster).first()
            fleet = self._fleets[cluster] = (
                load_fleet(cluster=row) if row is not None else FleetShapes()
            )
        return fleet

    def holds(
        self,
        *,
        cluster: str,
        claim: ResourceClaim,
        allocations: list[Allocation],
        chosen: Any,
        rules: list[QuotaRule],
    ) -> dict[int, Decimal]:
        """What `claim` holds on each of `rules`: its allocated devices exactly, or, until it
        is allocated, what its requests can take (the alternatives `chosen` at admission)."""
        if not rules:
            return {}
        fleet = self.fleet(cluster)
        if not allocations:
            return claim_amounts(
                spec=claim.spec,
                api_version=claim.api_version,
                chosen=chosen,
                rules=rules,
                fleet=fleet,
            )
        amounts: dict[int, Decimal] = defaultdict(Decimal)
        for allocation in allocations:
            device = allocation.device
            if device is None or device.shape is None:
                continue  # allocated before its slice was seen: counted once it is
            shape = self._shape(fleet, device.shape)
            # A share of a shareable device (KEP-5075) counts what it consumed, by any name;
            # one that records nothing consumed, the whole device.
            consumed = (allocation.consumed_capacity or None) if shape.shareable else None
            for rule in rules:
                if covers(fleet.class_selectors, rule.device_class, rule.selector, shape):
                    amounts[rule.pk] += per_device(
                        shape,
                        rule,
                        consumed,
                        of_accelerators=fleet.covers_accelerators(rule.device_class, rule.selector),
                    )
        return dict(amounts)

    @staticmethod
    def _shape(fleet: FleetShapes, row: Any) -> Shape:
        shape = fleet.shapes.get(row.pk)
        if shape is None:  # a device no longer present: its shape is not in the fleet's
            shape = fleet.shapes[row.pk] = shape_of(row)
        return shape


def _open_allocations(claim_ids: Iterable[int]) -> dict[int, list[Allocation]]:
    by_claim: dict[int, list[Allocation]] = defaultdict(list)
    for allocation in Allocation.objects.filter(
        AnyOf("claim_id", claim_ids), end__isnull=True
    ).select_related("device__shape"):
        by_claim[allocation.claim_id].append(allocation)
    return by_claim


def _release(reservation: Reservation, at: datetime) -> bool:
    """Release a live reservation: what it holds is freed, or, for a member of a gang still
    live, given back to the gang (`_give_back_to_gang`). The rules are locked already."""
    if (
        Reservation.objects.filter(pk=reservation.pk)
        .exclude(state=ReservationState.RELEASED)
        .update(state=ReservationState.RELEASED, released_at=at)
    ):
        if reservation.gang_key and _give_back_to_gang(reservation, at):
            return True
        ledger.change_lines(reservation, {})
        if reservation.gang_key:
            _end_gang(reservation, at)
        return True
    return False


def _give_back_to_gang(member: Reservation, at: datetime) -> bool:
    """Move what `member` (just released) holds to its gang's hold, when the gang is live: it
    has other live members, its team (still the namespace's owner) enforces gangs, and its
    hold was not released while those members lived (it expired, or the team stopped
    enforcing). The member's replacement (a Pod evicted and made again, a restart) then draws
    it, and nobody else takes the gang's room meanwhile; the hold (made again if the gang had
    none: its members all fit when admitted) keeps it TALLY_GANG_RESERVATION_SECONDS more,
    then expires as a hold does. Usage does not change. Returns whether it was given back.

    The rules are locked already (`lock_usage`); the hold is locked after them, as the
    webhook's reserving statement locks them."""
    where = {"cluster": member.cluster, "namespace": member.namespace}
    others = list(
        Reservation.objects.filter(**where, gang_key=member.gang_key)
        .exclude(state=ReservationState.RELEASED)
        .values_list("created_at", flat=True)
    )
    if not others:
        return False  # the gang has ended
    mode = GangPolicy.objects.filter(team_id=member.team_id).values_list("mode", flat=True).first()
    owner = (
        TeamNamespace.objects.filter(namespace=member.namespace)
        .values_list("team_id", flat=True)
        .first()
    )
    if (mode or GangMode.ENFORCE) != GangMode.ENFORCE or owner != member.team_id:
        return False
    holds = GangReservation.objects.filter(**where, key=member.gang_key)
    hold = holds.exclude(state=ReservationState.RELEASED).select_for_update().first()
    if hold is None:
        latest = holds.order_by("-created_at", "-pk").first()
        if latest is not None and latest.released_at and latest.released_at >= min(others):
            return False  # its hold was released while these members lived: not kept again
        gang = Gang.objects.filter(
            cluster__name=member.cluster, namespace=member.namespace, key=member.gang_key
        ).first()
        described = latest or gang
        hold = GangReservation.objects.create(
            **where,
            key=member.gang_key,
            source=described.source if described is not None else "",
            size=described.size if described is not None else len(others) + 1,
            team_id=member.team_id,
            created_at=at,
            expires_at=None,
        )
    elif hold.team_id != member.team_id:
        return False
    given = {line.rule_id: line.amount for line in member.lines.all()}
    held = {line.rule_id: line.amount for line in hold.lines.all()}
    ledger.write_lines(member, given, {})
    ledger.write_lines(
        hold,
        held,
        {
            rule_id: held.get(rule_id, Decimal(0)) + given.get(rule_id, Decimal(0))
            for rule_id in set(held) | set(given)
        },
    )
    expires_at = at + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS)
    GangReservation.objects.filter(pk=hold.pk).update(
        expires_at=max(expires_at, hold.expires_at or expires_at)
    )
    return True


def _end_gang(member: Reservation, at: datetime) -> None:
    """Release the hold of the gang of `member` (just released) once none of its members
    holds a live reservation: the gang has ended, and its members to come, if any, will be
    weighed as a new gang. Takes the rules of the hold's team before the hold, in the order
    the webhook locks them."""
    if (
        Reservation.objects.filter(
            cluster=member.cluster, namespace=member.namespace, gang_key=member.gang_key
        )
        .exclude(state=ReservationState.RELEASED)
        .exists()
    ):
        return
    live = GangReservation.objects.filter(
        cluster=member.cluster, namespace=member.namespace, key=member.gang_key
    ).exclude(state=ReservationState.RELEASED)
    _lock_rules(set(live.values_list("team_id", flat=True)))
    for hold in live.select_for_update():
        _release_hold(hold, at)


def _release_hold(hold: GangReservation, at: datetime) -> bool:
    """Release a gang's hold, freeing what it still holds. The rules are locked already."""
    if (
        GangReservation.objects.filter(pk=hold.pk)
        .exclude(state=ReservationState.RELEASED)
        .update(state=ReservationState.RELEASED, released_at=at)
    ):
        ledger.change_lines(hold, {})
        return True
    return False


# --- Following the sync -----------------------------------------------------------------------


def sync_reservations(*, cluster: Cluster, claim_ids: list[int], at: datetime) -> None:
    """Bring reservations in line with what the sync saw of these claims.

    A released claim frees its reservation. A claim of a namespace a team owns holds, on that
    team's rules, exactly its allocated devices once allocated (what was reserved for
    alternatives the scheduler did not take is freed), and until then what its requests can
    take (recounted each time the sync sees it, so a rule changed between its admission and
    the sync's first sight of it counts it too). A claim allocated without passing the webhook
    (made before Tally, or while it was off) is adopted so that usage stays true. A
    reservation whose namespace another team owns now becomes that team's; one whose namespace
    no team owns holds nothing. A reservation admitted with no gang (its gang could not be read
    then) whose claim the sync has since found in a gang becomes that gang's member.
    """
    # Where each claim is first: most claims of a large import or watch batch concern no team,
    # and they are skipped without reading (and decoding) their specs and owners.
    named = list(
        ResourceClaim.objects.filter(AnyOf("pk", claim_ids), cluster=cluster).values_list(
            "pk", "namespace", "name"
        )
    )
    if not named:
        return
    with transaction.atomic():
        # Taken before reading who owns what, so a policy change that moves namespaces is
        # wholly before or after this (its recount then sees these claims).
        lock_usage(team_ids=())
        owners = dict(
            TeamNamespace.objects.filter(
                AnyOf("namespace", {namespace for _, namespace, _ in named})
            ).values_list("namespace", "team_id")
        )
        live = {
            (namespace, name): team_id
            for namespace, name, team_id in Reservation.objects.filter(
                AnyOf("name", {name for _, _, name in named}), cluster=cluster.name
            )
            .exclude(state=ReservationState.RELEASED)
            .values_list("namespace", "name", "team_id")
        }
        concerned = [
            pk for pk, namespace, name in named if namespace in owners or (namespace, name) in live
        ]
        if not concerned:
            return
        followed = list(
            ResourceClaim.objects.filter(AnyOf("pk", concerned))
            .only(
                "pk",
                "namespace",
                "name",
                "uid",
                "released_at",
                "spec",
                "api_version",
                "owner_references",
                "created_by",
                "admitted_job",
                "gang__key",
            )
            .select_related("gang")
        )
        teams = {owners.get(c.namespace) for c in followed} | {
            live.get((c.namespace, c.name)) for c in followed
        }
        rules: dict[int, list[QuotaRule]] = {team_id: [] for team_id in teams if team_id}
        for rule in _lock_rules(set(rules)):
            rules[rule.team_id].append(rule)
        allocations = _open_allocations(c.pk for c in followed if c.released_at is None)
        counting = _Counting()
        for claim in followed:
            _follow(
                claim=claim,
                cluster=cluster,
                owner=owners.get(claim.namespace),
                allocations=allocations.get(claim.pk, []),
                rules=rules,
                counting=counting,
                at=at,
            )


def _follow(
    *,
    claim: ResourceClaim,
    cluster: Cluster,
    owner: int | None,
    allocations: list[Allocation],
    rules: dict[int, list[QuotaRule]],
    counting: _Counting,
    at: datetime,
) -> None:
    """Bring the reservation of one claim the sync saw in line with it (see
    `sync_reservations`)."""
    reservation = (
        Reservation.objects.select_for_update()
        .filter(cluster=cluster.name, namespace=claim.namespace, name=claim.name)
        .exclude(state=ReservationState.RELEASED)
        .first()
    )
    same_claim = reservation is not None and reservation.claim_uid in ("", claim.uid)
    if reservation is not None and same_claim:
        _record_creator(claim, reservation)
        if not reservation.gang_key and claim.gang is not None:
            # Admitted before its gang could be read: the sync read it since, and the claim
            # is the gang's member from now on (as the webhook's next weighing finds too).
            reservation.gang_key = claim.gang.key
            Reservation.objects.filter(pk=reservation.pk).update(gang_key=claim.gang.key)
    if claim.released_at is not None:
        if reservation is not None and same_claim:
            _release(reservation, claim.released_at)
        return
    if reservation is None:
        if not allocations or owner is None:
            return
        reservation = _adopt(claim, cluster=cluster.name, team_id=owner, at=at)
    for team_id in {reservation.team_id, owner or reservation.team_id} - set(rules):
        # Admitted for a team whose rules are not locked yet (it read the namespace's owner
        # before a change this sync is after): lock them now.
        rules[team_id] = _lock_rules({team_id})
    fields: dict[str, Any] = {"claim_uid": claim.uid, "expires_at": None}
    if allocations:
        fields["state"] = ReservationState.ALLOCATED
    if owner is not None and owner != reservation.team_id:
        fields["team_id"] = owner
    held = (
        counting.holds(
            cluster=cluster.name,
            claim=claim,
            allocations=allocations,
            chosen=reservation.chosen,
            rules=rules[owner],
        )
        if owner is not None
        else {}
    )
    ledger.change_lines(reservation, held)
    Reservation.objects.filter(pk=reservation.pk).update(**fields)


def _adopt(claim: ResourceClaim, *, cluster: str, team_id: int, at: datetime) -> Reservation:
    """The reservation of an allocated claim that did not pass the webhook (made before Tally,
    while it was off, or before its namespace was a team's), as the ledger counts it."""
    return Reservation.objects.create(
        cluster=cluster,
        namespace=claim.namespace,
        name=claim.name,
        claim_uid=claim.uid,
        team_id=team_id,
        state=ReservationState.ALLOCATED,
        owner_references=claim.owner_references,
        created_at=at,
    )


def _record_creator(claim: ResourceClaim, reservation: Reservation) -> None:
    """The claim keeps who created it and the object it was made for, as the webhook saw
    them, so that billing reads them from the inventory rather than from quota's tables; and
    its allocations that the sync wrote before this record reached the claim take them as who
    is charged (`inventory.creators.record_claim_creator`, which writes the inventory's rows)."""
    job = f"{reservation.owner_kind}/{reservation.owner_name}" if reservation.owner_kind else ""
    controllers = settings.TALLY_WORKLOAD_CONTROLLERS
    username = reservation.username
    if not username or is_controller(username, controllers):
        # Adopted, or a claim a controller made from a template: nobody to charge here; the
        # person the sync found through the claim's owners (inventory.owners) stays.
        username = "" if is_controller(claim.created_by, controllers) else claim.created_by
    record_claim_creator(claim=claim, created_by=username, admitted_job=job)


def expire_reservations(*, now: datetime) -> int:
    """Release reservations whose claim never appeared (a later admission step rejected it),
    and what gangs still hold for members that have not appeared by their hold's expiry
    (TALLY_GANG_RESERVATION_SECONDS after the gang's admission; a hold its members have drawn
    whole stays until the gang ends). Returns how many reservations and holds it released."""
    due = dict(
        Reservation.objects.filter(
            state=ReservationState.RESERVED, claim_uid="", expires_at__lt=now
        ).values_list("pk", "team_id")
    )
    holds_due = dict(
        GangReservation.objects.filter(
            state=ReservationState.RESERVED, expires_at__lt=now, lines__amount__gt=0
        )
        .distinct()
        .values_list("pk", "team_id")
    )
    if not due and not holds_due:
        return 0
    expired = 0
    with transaction.atomic():
        lock_usage(team_ids=set(due.values()) | set(holds_due.values()))
        for reservation in Reservation.objects.select_for_update().filter(
            pk__in=due, state=ReservationState.RESERVED, claim_uid="", expires_at__lt=now
        ):
            expired += _release(reservation, now)
        for hold in GangReservation.objects.select_for_update().filter(
            pk__in=holds_due, state=ReservationState.RESERVED, expires_at__lt=now
        ):
            expired += _release_hold(hold, now)
    return expired


def supersede_reservation(*, cluster: str, namespace: str, name: str, at: datetime) -> bool:
    """Release the live reservation of `namespace/name` in `cluster` for another claim now
    created under its name, which the webhook weighed as new with this reservation counted
    and found to fit (`quota.admission.service.review_claim`): the claim made under the name
    takes the name's place in the ledger, as the sync would give it. Returns whether one was
    released. Locks as the sync does: the usage lock and the team's rules, then the row.

    Only the webhook calls it, inside the admission's transaction with the reservation that
    replaces it, so a denial leaves the reservation as it was.
    """
    live = (
        Reservation.objects.filter(cluster=cluster, namespace=namespace, name=name)
        .exclude(state=ReservationState.RELEASED)
        .values_list("team_id", flat=True)
        .first()
    )
    if live is None:
        return False
    lock_usage(team_ids={live})
    reservation = (
        Reservation.objects.select_for_update()
        .filter(cluster=cluster, namespace=namespace, name=name)
        .exclude(state=ReservationState.RELEASED)
        .first()
    )
    if reservation is None or not _release(reservation, at):
        return False
    log.warning(
        "reservation %s of %s/%s in %s (claim uid %r) released: another claim of that name "
        "was admitted as new",
        reservation.pk,
        namespace,
        name,
        cluster,
        reservation.claim_uid,
    )
    return True


# --- The recount ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleUsage:
    """One rule's usage as stored and as recounted from the ledger."""

    rule: QuotaRule
    stored: Decimal
    recounted: Decimal
    # Live reservations whose line on the rule differs from the recount (missing, extra or
    # another amount), claims to adopt included.
    lines_differing: int

    @property
    def drifted(self) -> bool:
        return self.stored != self.recounted or self.lines_differing > 0

    def describe(self) -> str:
        """One line naming the rule, its usage stored and recounted."""
        lines = (
            f"{self.lines_differing} line{' differs' if self.lines_differing == 1 else 's differ'}"
        )
        return (
            f"quota rule {self.rule.team.slug}/{self.rule.name} (id {self.rule.pk}): stored "
            f"in_use {_amount(self.stored)}, recounted {_amount(self.recounted)} ({lines})"
        )


def _amount(value: Decimal) -> str:
    return f"{value.normalize():f}"


def recount_usage(
    *, teams: Iterable[Team | int], at: datetime, fix: bool = True
) -> list[RuleUsage]:
    """Recount the usage of the rules of `teams` from scratch, from the live reservations and
    allocations, and (with `fix`) make their reservation lines and `in_use` that.

    Called in the transaction of every change that can change what a rule counts (a rule
    added or changed, a namespace added, moved or removed), so usage does not depend on the
    order of events. What each live reservation of a namespace a team owns holds on its rules:
    - its claim allocated: exactly the allocated devices each rule covers;
    - its claim seen by the sync, not yet allocated: what its requests can take, as admitted
      (the `firstAvailable` alternatives its admission kept), on the fleet as it is now;
    - its claim not seen yet (just admitted): the lines it has, on the rules still the team's
      (the sync recounts it when it sees the claim).
    A claim allocated in a namespace a team owns without a live reservation (made before Tally,
    or before the namespace was the team's) is adopted: a reservation in state allocated. A
    reservation whose namespace has moved becomes its new team's; one whose namespace no team
    owns holds nothing. A gang's live hold keeps what it holds, unless its team turned
    `gangs: off` or its namespace is no longer the team's: then it is released. Teams that
    hold reservations of the teams' namespaces, or own the namespaces of the teams'
    reservations, are recounted with them.

    Guarantees: takes `lock_usage` (the rules in id order) before it reads; writes only what
    differs; without `fix` writes nothing. Returns every recounted rule's usage as stored
    and as recounted, in id order.
    """
    with transaction.atomic():
        lock_usage(team_ids=())
        team_ids = _neighbourhood({team if isinstance(team, int) else team.pk for team in teams})
        return _Recount(team_ids=team_ids, at=at).run(fix=fix)


def _neighbourhood(team_ids: set[int]) -> set[int]:
    """`team_ids` with the teams whose reservations (or gang holds) lie in their namespaces
    and the owners of the namespaces of their reservations, and so on: those a recount of
    theirs may move reservations to or from."""
    found = set(team_ids)
    while True:
        namespaces = set(
            TeamNamespace.objects.filter(team_id__in=found).values_list("namespace", flat=True)
        )
        held: set[str] = set()
        more: set[int] = set()
        for model in (Reservation, GangReservation):
            live = model.objects.exclude(state=ReservationState.RELEASED)
            held |= set(live.filter(team_id__in=found).values_list("namespace", flat=True))
            more |= set(live.filter(namespace__in=namespaces).values_list("team_id", flat=True))
        more |= set(
            TeamNamespace.objects.filter(namespace__in=held).values_list("team_id", flat=True)
        )
        if more <= found:
            return found
        found |= more


@dataclass
class _Holding:
    """What one live reservation, gang hold or claim to adopt should hold: its team and its
    lines."""

    subject: Reservation | GangReservation | ResourceClaim
    team_id: int
    lines: dict[int, Decimal]
    # A gang's hold that is to be released (see `_Recount._hold`).
    release: bool = False

    def stored(self) -> dict[int, Decimal]:
        if isinstance(self.subject, ResourceClaim):
            return {}
        return {line.rule_id: line.amount for line in self.subject.lines.all()}


class _Recount:
    """One recount of some teams' rules, under `lock_usage` (see `recount_usage`)."""

    def __init__(self, *, team_ids: set[int], at: datetime) -> None:
        self.at = at
        self.team_ids = team_ids
        self.rules = _lock_rules(team_ids)
        teams = {team.pk: team for team in Team.objects.filter(pk__in=team_ids)}
        self.rules_of: dict[int, list[QuotaRule]] = defaultdict(list)
        for rule in self.rules:
            rule.team = teams[rule.team_id]
            self.rules_of[rule.team_id].append(rule)
        self.counting = _Counting()
        self.gangs_off = set(
            GangPolicy.objects.filter(team_id__in=team_ids, mode=GangMode.OFF).values_list(
                "team_id", flat=True
            )
        )

    def run(self, *, fix: bool) -> list[RuleUsage]:
        owned = set(
            TeamNamespace.objects.filter(team_id__in=self.team_ids).values_list(
                "namespace", flat=True
            )
        )
        reservations = list(
            Reservation.objects.select_for_update()
            .exclude(state=ReservationState.RELEASED)
            .filter(Q(namespace__in=owned) | Q(team_id__in=self.team_ids))
            .prefetch_related("lines")
            .order_by("pk")
        )
        holds = list(
            GangReservation.objects.select_for_update()
            .exclude(state=ReservationState.RELEASED)
            .filter(Q(namespace__in=owned) | Q(team_id__in=self.team_ids))
            .prefetch_related("lines")
            .order_by("pk")
        )
        namespaces = owned | {r.namespace for r in reservations} | {h.namespace for h in holds}
        self.owners = dict(
            TeamNamespace.objects.filter(namespace__in=namespaces).values_list(
                "namespace", "team_id"
            )
        )
        self.claims: dict[tuple[str, str, str], list[ResourceClaim]] = defaultdict(list)
        for claim in ResourceClaim.objects.filter(
            namespace__in=namespaces, released_at__isnull=True
        ).select_related("cluster"):
            self.claims[(claim.cluster.name, claim.namespace, claim.name)].append(claim)
        self.allocations = _open_allocations(
            claim.pk for same in self.claims.values() for claim in same
        )
        holdings = [
            holding
            for reservation in reservations
            if (holding := self._reservation(reservation)) is not None
        ]
        holdings += [holding for hold in holds if (holding := self._hold(hold)) is not None]
        live = {(r.cluster, r.namespace, r.name) for r in reservations}
        holdings += self._adoptions(live)
        return self._settle(holdings, fix=fix)

    def _hold(self, hold: GangReservation) -> _Holding | None:
        """What a gang's live hold should hold: what it holds now on the rules still its
        team's while that team owns its namespace and weighs gangs (the webhook alone knows
        what the gang's members to come take); None for one this recount leaves alone.

        A hold whose team turned `gangs: off`, or whose namespace another team (or none) owns
        now, is released: the team no longer asked for room to be kept for the gang, or the
        room was weighed on rules that no longer count the namespace, and what the members to
        come take on the new owner's rules only the webhook can weigh (it does, as a gang
        without a hold, when the next member comes). Kept, it would block a team for a job
        that is no longer its own, or that it chose not to gang.
        """
        owner = self.owners.get(hold.namespace)
        if hold.team_id not in self.team_ids or (owner is not None and owner not in self.team_ids):
            return None
        if owner != hold.team_id or hold.team_id in self.gangs_off:
            return _Holding(hold, hold.team_id, {}, release=True)
        ours = {rule.pk for rule in self.rules_of[owner]}
        held = {line.rule_id: line.amount for line in hold.lines.all() if line.rule_id in ours}
        return _Holding(hold, owner, held)

    def _reservation(self, reservation: Reservation) -> _Holding | None:
        """What a live reservation should hold; None for one this recount leaves alone."""
        owner = self.owners.get(reservation.namespace)
        if reservation.team_id not in self.team_ids or (
            owner is not None and owner not in self.team_ids
        ):
            return None  # admitted meanwhile for a team outside this recount: the sync's
        if owner is None:
            return _Holding(reservation, reservation.team_id, {})  # no team owns its namespace
        key = (reservation.cluster, reservation.namespace, reservation.name)
        claim = next(
            (c for c in self.claims.get(key, []) if reservation.claim_uid in ("", c.uid)), None
        )
        if claim is None:  # not seen by the sync yet: its requests are not known here
            ours = {rule.pk for rule in self.rules_of[owner]}
            held = {line.rule_id: line.amount for line in reservation.lines.all()}
            return _Holding(reservation, owner, {k: v for k, v in held.items() if k in ours})
        lines = self.counting.holds(
            cluster=reservation.cluster,
            claim=claim,
            allocations=self.allocations.get(claim.pk, []),
            chosen=reservation.chosen,
            rules=self.rules_of[owner],
        )
        return _Holding(reservation, owner, lines)

    def _adoptions(self, live: set[tuple[str, str, str]]) -> list[_Holding]:
        """The allocated claims of the teams' namespaces that no live reservation holds."""
        adoptions = []
        for key, same in sorted(self.claims.items()):
            owner = self.owners.get(key[1])
            if owner is None or owner not in self.team_ids or key in live:
                continue
            claim = max(same, key=lambda c: (c.first_seen, c.pk))
            allocations = self.allocations.get(claim.pk)
            if allocations:
                lines = self.counting.holds(
                    cluster=key[0],
                    claim=claim,
                    allocations=allocations,
                    chosen={},
                    rules=self.rules_of[owner],
                )
                adoptions.append(_Holding(claim, owner, lines))
        return adoptions

    def _settle(self, holdings: list[_Holding], *, fix: bool) -> list[RuleUsage]:
        """Compare what should be held with what is stored; with `fix`, write the difference."""
        recounted: dict[int, Decimal] = defaultdict(Decimal)
        differing: dict[int, int] = defaultdict(int)
        for holding in holdings:
            stored = holding.stored()
            for rule_id, amount in holding.lines.items():
                recounted[rule_id] += amount
            for rule_id in set(stored) | set(holding.lines):
                if stored.get(rule_id) != holding.lines.get(rule_id):
                    differing[rule_id] += 1
            if fix:
                self._write(holding, stored)
        usage = [
            RuleUsage(
                rule=rule,
                stored=rule.in_use,
                recounted=recounted.get(rule.pk, Decimal(0)),
                lines_differing=differing.get(rule.pk, 0),
            )
            for rule in self.rules
        ]
        if fix:
            for entry in usage:
                if entry.stored != entry.recounted:
                    ledger.set_usage(rule_id=entry.rule.pk, in_use=entry.recounted)
        return usage

    def _write(self, holding: _Holding, stored: dict[int, Decimal]) -> None:
        subject, lines = holding.subject, holding.lines
        if isinstance(subject, ResourceClaim):
            subject = _adopt(
                subject, cluster=subject.cluster.name, team_id=holding.team_id, at=self.at
            )
        elif isinstance(subject, Reservation) and holding.team_id != subject.team_id:
            Reservation.objects.filter(pk=subject.pk).update(team_id=holding.team_id)
        elif isinstance(subject, GangReservation) and holding.release:
            GangReservation.objects.filter(pk=subject.pk).exclude(
                state=ReservationState.RELEASED
            ).update(state=ReservationState.RELEASED, released_at=self.at)
        ledger.write_lines(subject, stored, lines)


def reconcile_usage(*, at: datetime, fix: bool) -> list[RuleUsage]:
    """Recount every rule from scratch (`recount_usage`, one team at a time) and report any
    drift: each drifted rule is logged (stored against recounted), `tally_quota_drift_rules`
    says how many drifted and, with `fix`, the drift is repaired and counted in
    `tally_quota_drift_fixed_total`. Never silent. Returns every rule's usage, in id order.
    """
    usage: dict[int, RuleUsage] = {}
    for team_id in Team.objects.order_by("pk").values_list("pk", flat=True):
        for entry in recount_usage(teams=[team_id], at=at, fix=fix):
            usage.setdefault(entry.rule.pk, entry)
    drifted = [entry for entry in usage.values() if entry.drifted]
    for entry in drifted:
        log.warning("usage drift: %s%s", entry.describe(), "; fixed" if fix else "")
    metrics.QUOTA_DRIFT_RULES.set(len(drifted))
    if fix and drifted:
        metrics.QUOTA_DRIFT_FIXED.inc(len(drifted))
    return [usage[pk] for pk in sorted(usage)]
