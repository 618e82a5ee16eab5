"""Quota's writes outside the admission hot path (the webhook reserves through
`quota.admission`).

`sync_reservations` turns a reservation into the exact allocated devices once the scheduler has
allocated, and releases it when the claim goes; `expire_reservations` frees what was reserved
for claims that never appeared; `set_budget` gives a team its GPU-hour budget.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import F

from inventory import dra
from inventory.models import Allocation, Cluster, ResourceClaim
from quota import cel
from quota.admission.decision import per_device
from quota.admission.shapes import Shape
from quota.models import Budget, QuotaRule, Reservation, ReservationLine, ReservationState
from quota.selectors import team_rules
from teams import audit
from teams.models import AuditEntry, Team, TeamNamespace
from teams.selectors import team_for_namespace


def set_budget(
    *, team: Team, gpu_hours: Decimal, mode: str, actor: str
) -> tuple[Budget, AuditEntry | None]:
    """Give `team` a GPU-hour budget of `gpu_hours` per period (`mode`: "hard" denies new
    claims past it, "soft" warns), or change the one it has.

    Guarantees: the team's row is locked while its budget is written, so concurrent changes
    apply one after the other and none is lost; only what differs is written; each change has
    its audit entry naming `actor`. Returns the budget and that entry (None: nothing changed).
    """
    with transaction.atomic():
        Team.objects.select_for_update().only("pk").get(pk=team.pk)
        budget = Budget.objects.filter(team=team).first()
        if budget is None:
            budget = Budget(team=team, gpu_hours=gpu_hours, mode=mode)
            return budget, audit.create(actor=actor, obj=budget)
        before = audit.snapshot(budget)
        budget.gpu_hours, budget.mode = gpu_hours, mode
        return budget, audit.update(actor=actor, obj=budget, before=before)


def _change_lines(reservation: Reservation, amounts: dict[int, Decimal]) -> None:
    """Make the reservation's lines `amounts`, moving each rule's `in_use` by the difference."""
    current = {line.rule_id: line for line in reservation.lines.all()}
    deltas: dict[int, Decimal] = defaultdict(Decimal)
    for rule_id, line in current.items():
        if rule_id not in amounts:
            deltas[rule_id] -= line.amount
            line.delete()
    for rule_id, amount in amounts.items():
        held = current.get(rule_id)
        if held is None:
            ReservationLine.objects.create(reservation=reservation, rule_id=rule_id, amount=amount)
            deltas[rule_id] += amount
        elif held.amount != amount:
            deltas[rule_id] += amount - held.amount
            ReservationLine.objects.filter(pk=held.pk).update(amount=amount)
    for rule_id in sorted(deltas):
        if deltas[rule_id]:
            QuotaRule.objects.filter(pk=rule_id).update(in_use=F("in_use") + deltas[rule_id])


def _release(reservation: Reservation, at: datetime) -> None:
    if (
        Reservation.objects.filter(pk=reservation.pk)
        .exclude(state=ReservationState.RELEASED)
        .update(state=ReservationState.RELEASED, released_at=at)
    ):
        _change_lines(reservation, {})


def sync_reservations(*, cluster: Cluster, claim_ids: list[int], at: datetime) -> None:
    """Bring reservations in line with what the sync saw of these claims.

    A released claim frees its reservation. An allocated claim holds exactly its allocated
    devices: its lines are recomputed from them (what was reserved for alternatives the
    scheduler did not take is freed), and a claim allocated without passing the webhook (made
    before Tally, or while it was off) is adopted so that usage stays true.
    """
    claims = list(
        ResourceClaim.objects.filter(pk__in=claim_ids, cluster=cluster).only(
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
        )
    )
    owned = set(
        TeamNamespace.objects.filter(namespace__in={c.namespace for c in claims}).values_list(
            "namespace", flat=True
        )
    )
    reserved = set(
        Reservation.objects.filter(cluster=cluster.name, name__in={c.name for c in claims})
        .exclude(state=ReservationState.RELEASED)
        .values_list("namespace", "name")
    )
    # Most claims of a large import concern no team: skip them without a query each.
    for claim in claims:
        if claim.namespace not in owned and (claim.namespace, claim.name) not in reserved:
            continue
        with transaction.atomic():
            reservation = (
                Reservation.objects.select_for_update()
                .filter(cluster=cluster.name, namespace=claim.namespace, name=claim.name)
                .exclude(state=ReservationState.RELEASED)
                .first()
            )
            if reservation is not None and reservation.claim_uid in ("", claim.uid):
                _record_creator(claim, reservation)
            if claim.released_at is not None:
                if reservation is not None and reservation.claim_uid in ("", claim.uid):
                    _release(reservation, claim.released_at)
                continue
            allocations = list(
                Allocation.objects.filter(claim=claim, end__isnull=True).select_related(
                    "device", "device__shape"
                )
            )
            if reservation is None:
                if not allocations:
                    continue
                team = team_for_namespace(namespace=claim.namespace)
                if team is None:
                    continue
                reservation = Reservation.objects.create(
                    cluster=cluster.name,
                    namespace=claim.namespace,
                    name=claim.name,
                    claim_uid=claim.uid,
                    team=team,
                    state=ReservationState.ALLOCATED,
                    owner_references=claim.owner_references,
                    created_at=at,
                )
            fields: dict[str, Any] = {"claim_uid": claim.uid, "expires_at": None}
            if allocations:
                fields["state"] = ReservationState.ALLOCATED
                _change_lines(reservation, _allocated_amounts(claim, allocations, reservation.team))
            Reservation.objects.filter(pk=reservation.pk).update(**fields)


def _record_creator(claim: ResourceClaim, reservation: Reservation) -> None:
    """The claim keeps who created it and the object it was made for, as the webhook saw
    them, so that billing reads them from the inventory rather than from quota's tables."""
    job = f"{reservation.owner_kind}/{reservation.owner_name}" if reservation.owner_kind else ""
    if (claim.created_by, claim.admitted_job) != (reservation.username, job):
        ResourceClaim.objects.filter(pk=claim.pk).update(
            created_by=reservation.username, admitted_job=job
        )


def _allocated_amounts(
    claim: ResourceClaim, allocations: list[Allocation], team: Team
) -> dict[int, Decimal]:
    try:
        requests = dra.parse_claim_requests(claim.spec, claim.api_version)
    except dra.DRAObjectError:
        requests = []
    classes: dict[str, dra.ParsedRequest] = {}
    for request in requests:
        classes[request.name] = request
        for alternative in request.first_available:
            classes[f"{request.name}/{alternative.name}"] = alternative
    rules = team_rules(team=team)
    amounts: dict[int, Decimal] = defaultdict(Decimal)
    for allocation in allocations:
        allocated_for = classes.get(allocation.request)
        device = allocation.device
        if allocated_for is None or device is None or device.shape is None:
            continue
        shape = Shape.from_row(device.shape, memory_bytes=device.memory_bytes)
        consumed = allocation.consumed_capacity.get("memory") if allocation.share_id else None
        for rule in rules:
            if rule.device_class != allocated_for.device_class_name:
                continue
            try:
                if rule.selector and not cel.compile_selector(rule.selector).matches(shape.view):
                    continue
            except cel.CELError:
                pass
            amounts[rule.pk] += per_device(shape, rule, consumed)
    return dict(amounts)


def expire_reservations(*, now: datetime) -> int:
    """Release reservations whose claim never appeared (a later admission step rejected it)."""
    expired = 0
    for reservation in Reservation.objects.filter(
        state=ReservationState.RESERVED, claim_uid="", expires_at__lt=now
    ):
        with transaction.atomic():
            _release(reservation, now)
        expired += 1
    return expired
