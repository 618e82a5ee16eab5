"""Quota decisions and reservations.

`review_claim` decides an admission and reserves what the claim can take, atomically;
`fit_alternatives` says which `firstAvailable` alternatives fit (the mutating webhook drops
the others); `sync_reservations` turns a reservation into the exact allocated devices once the
scheduler has allocated, and releases it when the claim goes; `expire_reservations` frees what
was reserved for claims that never appeared.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone
from kubernetes.utils import parse_quantity

from inventory import dra
from inventory.models import Allocation, Cluster, ResourceClaim
from quota import cel
from quota.models import (
    AdmissionDecision,
    Mode,
    QuotaRule,
    Reservation,
    ReservationLine,
    ReservationState,
    Team,
    TeamNamespace,
    Unit,
)
from quota.selectors import (
    AdmissionState,
    FleetShapes,
    RuleUsage,
    Shape,
    admission_state,
    durability_column,
    fetch_prepared,
    fleet_shapes,
    on_postgresql,
    restore_columns,
    restored,
    statement_ending,
    team_for_namespace,
    team_rules,
)

log = logging.getLogger(__name__)
# A rule as the admission read it, or as stored (reports, the sync's exact allocations).
Rule = RuleUsage | QuotaRule
NEAR_LIMIT = Decimal("0.8")
# The resource-claim controller creates claims from ResourceClaimTemplates for Pods.
CONTROLLER_USERS = ("system:serviceaccount:kube-system:", "system:kube-controller-manager")


@dataclass
class Demand:
    """What one request (or one of its alternatives) can take, per rule that limits it."""

    name: str
    amounts: dict[int, Decimal]
    devices: int


@dataclass
class Decision:
    allowed: bool
    message: str = ""
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    team: Team | None = None
    # firstAvailable requests: alternatives that do not fit, by request name.
    removed: dict[str, list[str]] = field(default_factory=dict)
    # The quota rule that denied, for metrics.
    rule: str = ""


class _RulesChanged(Exception):
    pass


class _Exceeded(Exception):
    def __init__(self, rule_id: int, asked: Decimal) -> None:
        self.rule_id = rule_id
        self.asked = asked


@dataclass
class _Plan:
    team: Team | None
    rules: dict[int, Rule]
    reserve: dict[int, Decimal]
    chosen: dict[str, list[str]]
    removed: dict[str, list[str]]
    warnings: list[str]
    denial: str = ""
    reason: str = ""
    rule: str = ""


def review_claim(
    *,
    cluster: Cluster,
    claim: dict[str, Any],
    username: str = "",
    dry_run: bool = False,
    admission_uid: str = "",
    at: datetime,
) -> Decision:
    """Decide the CREATE of `claim` and, unless `dry_run`, reserve what it can take.

    Guarantees: for every enforce rule, reservations plus allocations never exceed the limit,
    under any concurrency (one conditional UPDATE per rule in one transaction); the same claim
    (cluster, namespace, name) admitted twice reserves once; a dry run writes nothing.
    """
    namespace, name = _claim_name(claim)
    state = admission_state(cluster=cluster.name, namespace=namespace, name=name)
    if state.replayed_team_id is not None:
        # The API server may call again for the same claim (with a new uid): same answer,
        # nothing reserved twice.
        team = state.team
        if team is None or team.pk != state.replayed_team_id:
            team = Team.objects.filter(pk=state.replayed_team_id).first()
        return Decision(True, "", "", [], team)
    plan = _plan(cluster=cluster, claim=claim, state=state)
    recorded = False
    if plan.denial:
        decision = Decision(
            False, plan.denial, plan.reason, plan.warnings, plan.team, rule=plan.rule
        )
    elif dry_run or plan.team is None:
        decision = Decision(True, "", "", plan.warnings, plan.team, plan.removed)
    else:
        decision, recorded = _reserve(
            cluster=cluster,
            claim=claim,
            plan=plan,
            username=username,
            admission_uid=admission_uid,
            at=at,
        )
    if dry_run or recorded:
        return decision  # a dry run leaves nothing behind, not even its decision
    _record(decision, namespace=namespace, name=name, username=username, uid=admission_uid, at=at)
    return decision


# The columns of `AdmissionDecision` both of the webhook's inserts write, in this order.
_DECISION_COLUMNS = (
    "at, uid, namespace, name, username, team_id, allowed, dry_run, message, warnings"
)


def _record(
    decision: Decision, *, namespace: str, name: str, username: str, uid: str, at: datetime
) -> None:
    """Keep the webhook's answer for operators (a prepared INSERT on PostgreSQL).

    On PostgreSQL it records only decisions whose claim holds no quota (one that does is
    recorded by the statement that reserves it): a denial, a namespace no team owns, a claim
    no rule limits. Its commit does not wait for the disk: a database crash may lose the last
    such rows, never state that quota depends on.
    """
    team_id = decision.team.pk if decision.team is not None else None
    if on_postgresql():
        # The admission's last statement: it sets the session's own settings back.
        ending = statement_ending(wait_for_disk=False)
        fetch_prepared(
            _record_sql(restore=ending.restore, durability=ending.durable),
            [at, uid, namespace, name, username, team_id, decision.allowed, decision.message,
             json.dumps(decision.warnings), *ending.params],
        )  # fmt: skip
        if ending.restore:
            restored()
        return
    AdmissionDecision.objects.create(
        at=at,
        uid=uid,
        namespace=namespace,
        name=name,
        username=username,
        team_id=team_id,
        allowed=decision.allowed,
        dry_run=False,
        message=decision.message,
        warnings=decision.warnings,
    )


@functools.cache
def _record_sql(*, restore: bool, durability: bool) -> str:
    """The decision's insert on PostgreSQL (made once per kind), setting the session's own
    settings back after it (`restore`, from two more parameters) and the durability of its
    commit (`durability`, one more)."""
    table = connection.ops.quote_name(AdmissionDecision._meta.db_table)
    returning = [
        "id",
        *([restore_columns()] if restore else []),
        *([durability_column()] if durability else []),
    ]
    return (
        f"INSERT INTO {table} ({_DECISION_COLUMNS}) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, false, %s, %s::jsonb) "
        f"RETURNING {', '.join(returning)}"
    )


def fit_alternatives(*, cluster: Cluster, claim: dict[str, Any]) -> Decision:
    """Which firstAvailable alternatives fit the team's quota now; nothing is written.

    A claim already admitted (the API server sends a retried create to this webhook first)
    keeps the alternatives its reservation chose: planned again, it would be counted beside
    its own reservation and not fit.
    """
    namespace, name = _claim_name(claim)
    state = admission_state(cluster=cluster.name, namespace=namespace, name=name)
    if state.replayed_team_id is not None:
        removed = _not_chosen(cluster=cluster, claim=claim, namespace=namespace, name=name)
        return Decision(True, "", "", [], state.team, removed)
    plan = _plan(cluster=cluster, claim=claim, state=state)
    if plan.denial:
        return Decision(False, plan.denial, plan.reason, plan.warnings, plan.team, rule=plan.rule)
    return Decision(True, "", "", plan.warnings, plan.team, plan.removed)


def _not_chosen(
    *, cluster: Cluster, claim: dict[str, Any], namespace: str, name: str
) -> dict[str, list[str]]:
    """The alternatives of `claim` that its live reservation did not choose, by request."""
    chosen = (
        Reservation.objects.filter(cluster=cluster.name, namespace=namespace, name=name)
        .exclude(state=ReservationState.RELEASED)
        .values_list("chosen", flat=True)
        .first()
    )
    spec = claim.get("spec")
    if not isinstance(chosen, dict) or not isinstance(spec, dict):
        return {}
    try:
        requests = dra.parse_claim_requests(spec, str(claim.get("apiVersion") or ""))
    except dra.DRAObjectError:
        return {}  # it was readable when admitted; a body sent differently keeps them all
    removed = {}
    for request in requests:
        kept = chosen.get(request.name)
        skipped = [alt.name for alt in request.first_available if kept and alt.name not in kept]
        if skipped:
            removed[request.name] = skipped
    return removed


def _claim_name(claim: dict[str, Any]) -> tuple[str, str]:
    metadata = claim.get("metadata") if isinstance(claim.get("metadata"), dict) else {}
    assert isinstance(metadata, dict)
    return str(metadata.get("namespace") or "default"), str(
        metadata.get("name") or metadata.get("generateName") or ""
    )


def _plan(*, cluster: Cluster, claim: dict[str, Any], state: AdmissionState) -> _Plan:
    plan = _Plan(team=None, rules={}, reserve={}, chosen={}, removed={}, warnings=[])
    try:
        spec = claim.get("spec")
        if not isinstance(spec, dict):
            raise dra.DRAObjectError(dra.object_ref(claim), "spec", "is required")
        requests = dra.parse_claim_requests(spec, str(claim.get("apiVersion") or ""))
    except dra.DRAObjectError as exc:
        plan.denial, plan.reason = (
            f"cannot read the claim: {exc.field_path}: {exc.problem}",
            "Invalid",
        )
        return plan
    namespace, _ = _claim_name(claim)
    plan.team = state.team
    if plan.team is None:
        if settings.TALLY_UNOWNED_NAMESPACES == "deny":
            plan.denial = f"namespace {namespace!r} is not owned by any team"
            plan.reason = "Forbidden"
        else:
            plan.warnings.append(
                f"namespace {namespace!r} is not owned by any team; no quota applies"
            )
        return plan
    if _budget_denies(plan, requests):
        return plan
    rules = state.rules
    plan.rules = {rule.pk: rule for rule in rules}
    if not rules:
        return plan
    fleet = fleet_shapes(cluster=cluster)
    for request in requests:
        alternatives = request.first_available or [request]
        demands = [
            _demand(alternative, rules, fleet, plan.warnings) for alternative in alternatives
        ]
        fitting = [demand for demand in demands if _exceeded(plan, demand) is None]
        if not fitting:
            rule, asked = _exceeded(plan, demands[0]) or (rules[0], Decimal(0))
            plan.denial, plan.rule = _over_limit(plan.team, rule, asked), rule.name
            if len(demands) > 1:
                plan.denial += (
                    f" (none of the {len(demands)} alternatives of request {request.name!r} fits)"
                )
            plan.reason = "QuotaExceeded"
            return plan
        if request.first_available:
            plan.chosen[request.name] = [demand.name for demand in fitting]
            skipped = [d.name for d in demands if d not in fitting]
            if skipped:
                plan.removed[request.name] = skipped
        # Reserve the most any kept alternative can take on each rule.
        for rule_id in sorted({rule_id for demand in fitting for rule_id in demand.amounts}):
            plan.reserve[rule_id] = plan.reserve.get(rule_id, Decimal(0)) + max(
                demand.amounts.get(rule_id, Decimal(0)) for demand in fitting
            )
    for rule_id, amount in plan.reserve.items():
        rule = plan.rules[rule_id]
        total = rule.in_use + amount
        if rule.mode == Mode.WARN and total > rule.limit:
            plan.warnings.append(_over_limit(plan.team, rule, amount) + " (warn only)")
        elif rule.limit and total >= NEAR_LIMIT * rule.limit:
            plan.warnings.append(
                f'team "{plan.team.slug}": quota rule "{rule.name}" is at '
                f"{_fmt(total, rule)} of {_fmt(rule.limit, rule)} with this claim"
            )
    return plan


@dataclass
class _Budgets:
    """Every team's budget, read in one query, and the GPU-hours of those asked about."""

    expires: float
    budgets: dict[int, Any]
    used: dict[int, tuple[str, Decimal]] = field(default_factory=dict)  # period's name, hours


_budgets: list[_Budgets] = []


def forget_caches() -> None:
    """Drop what this process remembers of budgets (tests; a changed budget)."""
    _budgets.clear()


def _budget_denies(plan: _Plan, requests: list[dra.ParsedRequest]) -> bool:
    """Past a hard GPU-hour budget new claims are denied; past 80% or a soft one, warned.

    GPU-hours move slowly: a worker reads the budgets (one query for all teams) and a team's
    hours at most every TALLY_BUDGET_CACHE_SECONDS; a team without a budget costs nothing.
    The period is the stored one holding now, else the configured one (`period_holding`):
    stored periods of another length, after TALLY_BILLING_PERIOD changed, never make
    admission fail, and admission never creates a period.
    """
    from billing.models import Budget
    from billing.pricing import period_holding
    from billing.selectors import team_gpu_hours

    assert plan.team is not None
    if all(r.admin_access for r in requests if not r.first_available):
        return False
    if not _budgets or _budgets[0].expires < time.monotonic():
        budgets = {budget.team_id: budget for budget in Budget.objects.all()}
        expires = time.monotonic() + settings.TALLY_BUDGET_CACHE_SECONDS
        _budgets[:] = [_Budgets(expires=expires, budgets=budgets)]
    cache = _budgets[0]
    budget = cache.budgets.get(plan.team.pk)
    if budget is None:
        return False
    if plan.team.pk not in cache.used:
        now = timezone.now()
        period = period_holding(now)
        cache.used[plan.team.pk] = (
            period.label,
            team_gpu_hours(team=plan.team, period=period, now=now),
        )
    label, used = cache.used[plan.team.pk]
    figures = (
        f'team "{plan.team.slug}" has used {used.quantize(Decimal("0.1"))} of its '
        f"{budget.gpu_hours.normalize():f} GPU-hour {budget.mode} budget for {label}"
    )
    if used >= budget.gpu_hours and budget.mode == "hard":
        plan.denial, plan.reason = figures, "BudgetExceeded"
        return True
    if used >= budget.gpu_hours:
        plan.warnings.append(figures + " (past the soft budget)")
    elif used >= NEAR_LIMIT * budget.gpu_hours:
        plan.warnings.append(figures)
    return False


def _exceeded(plan: _Plan, demand: Demand) -> tuple[Rule, Decimal] | None:
    """The first enforce rule this demand would take past its limit, with what the claim asks
    of it (this demand and the claim's requests before it, as the reservation would)."""
    for rule_id, amount in demand.amounts.items():
        rule = plan.rules[rule_id]
        if rule.mode != Mode.ENFORCE:
            continue
        asked = plan.reserve.get(rule_id, Decimal(0)) + amount
        if rule.in_use + asked > rule.limit:
            return rule, asked
    return None


def _over_limit(team: Team, rule: Rule, asked: Decimal) -> str:
    return (
        f'team "{team.slug}": quota rule "{rule.name}" ({rule.mode}) would be exceeded: '
        f"{_fmt(rule.in_use, rule)} in use, {_fmt(asked, rule)} requested, "
        f"limit {_fmt(rule.limit, rule)}"
    )


def _fmt(value: Decimal, rule: Rule) -> str:
    if rule.unit == Unit.MEMORY:
        return f"{(value / 2**30).quantize(Decimal('0.01')).normalize():f}Gi"
    rounded = value.quantize(Decimal("0.001")).normalize()
    return f"{rounded:f} GPU" + ("" if rounded == 1 else "s")


def _demand(
    request: dra.ParsedRequest, rules: list[RuleUsage], fleet: FleetShapes, warnings: list[str]
) -> Demand:
    demand = Demand(name=request.name, amounts={}, devices=0)
    if request.admin_access:
        return demand  # admin access observes devices; it holds nothing
    limiting = [rule for rule in rules if rule.device_class == request.device_class_name]
    if not limiting:
        return demand
    selectors = tuple(request.selectors)
    candidates = fleet.candidates(request.device_class_name, selectors)
    if not candidates:
        # Nothing to weigh it by: it counts as whole GPUs on every rule of its class, the
        # most it could take, until the sync sees what it was given.
        warnings.append(
            f'request "{request.name}": no device of class "{request.device_class_name}" in '
            "the inventory matches it; until it is allocated, each device it asks for counts "
            "as one whole GPU (and no memory) on every quota rule of its class"
        )
    if request.allocation_mode == "All":
        devices = fleet.derived(
            ("all", request.device_class_name, selectors),
            lambda: _most_on_a_node(fleet, candidates),
        )
    else:
        devices = request.count
    demand.devices = devices
    requested_memory = request.capacity_requests.get("memory")
    for rule in limiting:
        # What one device counts on this rule: the same for every request that asks alike, so
        # worked out once per fleet snapshot (None: the rule's selector matches none of them).
        key = (request.device_class_name, selectors, rule.selector, rule.unit, requested_memory)
        try:
            per_device = fleet.derived(
                key, functools.partial(_per_device_on, rule, candidates, fleet, requested_memory)
            )
        except cel.CELError as exc:  # validated on apply; kept safe if stored otherwise
            warnings.append(f'quota rule "{rule.name}" has a bad selector, applied to all: {exc}')
            per_device = _most_per_device(rule, candidates, requested_memory)
        if per_device is not None:
            demand.amounts[rule.pk] = per_device * devices
    return demand


def _most_on_a_node(fleet: FleetShapes, candidates: list[Shape]) -> int:
    """`allocationMode: All`: the most devices of these shapes on any one node."""
    ids = {shape.id for shape in candidates}
    return max(
        (
            sum(n for shape_id, n in shapes.items() if shape_id in ids)
            for shapes in fleet.per_node.values()
        ),
        default=0,
    )


def _per_device_on(
    rule: Rule, candidates: list[Shape], fleet: FleetShapes, requested_memory: str | None
) -> Decimal | None:
    """The most one device of `candidates` that `rule` selects counts on it; None when the
    rule's selector selects none of them (it does not limit the request)."""
    shapes = candidates
    if rule.selector:
        cel.compile_selector(rule.selector)  # raises CELError for a bad one
        shapes = [shape for shape in candidates if fleet.match(rule.selector, shape)]
        if not shapes and candidates:
            return None
    return _most_per_device(rule, shapes, requested_memory)


def _most_per_device(rule: Rule, shapes: list[Shape], requested_memory: str | None) -> Decimal:
    return max(
        (_per_device(shape, rule, requested_memory) for shape in shapes),
        default=Decimal(1) if rule.unit == Unit.GPUS else Decimal(0),
    )


def _per_device(shape: Shape, rule: Rule, requested_memory: str | None) -> Decimal:
    """What one device of `shape` counts on `rule`; a consumable share counts its fraction."""
    memory = Decimal(shape.memory_bytes) if shape.memory_bytes else None
    shared = requested_memory is not None and shape.shareable
    if rule.unit == Unit.MEMORY:
        if shared:
            return Decimal(parse_quantity(requested_memory))
        return memory or Decimal(0)
    share = shape.gpu_share if shape.kind != "other" else Decimal(1)
    if shared and memory:
        return (share * Decimal(parse_quantity(requested_memory)) / memory).quantize(
            Decimal("0.000001")
        )
    return share


def _reserve(
    *,
    cluster: Cluster,
    claim: dict[str, Any],
    plan: _Plan,
    username: str,
    admission_uid: str,
    at: datetime,
) -> tuple[Decision, bool]:
    """Reserve `plan.reserve` for the claim, or deny if a rule's limit no longer allows it.

    Returns the decision and whether it was recorded already (an `AdmissionDecision`).
    """
    assert plan.team is not None
    namespace, name = _claim_name(claim)
    metadata = claim.get("metadata") or {}
    owners = metadata.get("ownerReferences") if isinstance(metadata, dict) else None
    owners = owners if isinstance(owners, list) else []
    controller = next((o for o in owners if isinstance(o, dict) and o.get("controller")), None)
    made_by_controller = username.startswith(CONTROLLER_USERS) and controller is not None
    # The reservation's fields (a dict: the one-statement path needs no model instance).
    reservation: dict[str, Any] = {
        "cluster": cluster.name,
        "namespace": namespace,
        "name": name,
        "team_id": plan.team.pk,
        "state": ReservationState.RESERVED.value,
        # A claim made from a template is the Pod's: attribute it to the Pod's controller,
        # not to the resource-claim controller's service account.
        "username": "" if made_by_controller else username,
        "owner_kind": str(controller.get("kind", "")) if controller else "",
        "owner_name": str(controller.get("name", "")) if controller else "",
        "owner_references": owners,
        "chosen": plan.chosen,
        "admission_uid": admission_uid,
        "created_at": at,
        "expires_at": at + timedelta(seconds=settings.TALLY_RESERVATION_TTL_SECONDS),
    }
    admitted = Decision(True, "", "", plan.warnings, plan.team, plan.removed)
    if on_postgresql() and plan.reserve:
        try:
            exceeded = _reserve_in_one_statement(reservation, plan, username=username)
        except _RulesChanged:
            message = f'team "{plan.team.slug}": its quota rules changed during this admission'
            return Decision(
                False, message + "; create the claim again", "Conflict", team=plan.team
            ), False
        if exceeded is None:
            return admitted, True
    else:
        exceeded = _reserve_step_by_step(reservation, plan)
        if exceeded is None:
            return admitted, False
    rule, asked = exceeded
    message = _over_limit(plan.team, rule, asked)
    return Decision(
        False, message, "QuotaExceeded", plan.warnings, plan.team, rule=rule.name
    ), False


def _reserve_step_by_step(fields: dict[str, Any], plan: _Plan) -> tuple[Rule, Decimal] | None:
    """The portable way (SQLite): one conditional UPDATE per rule in one transaction."""
    try:
        with transaction.atomic():
            reservation = Reservation.objects.create(**fields)
            for rule_id in sorted(plan.reserve):  # one order everywhere: no deadlocks
                amount = plan.reserve[rule_id]
                rows = QuotaRule.objects.filter(pk=rule_id)
                if plan.rules[rule_id].mode == Mode.ENFORCE:
                    rows = rows.filter(in_use__lte=F("limit") - amount)
                if rows.update(in_use=F("in_use") + amount) != 1:
                    raise _Exceeded(rule_id, amount)
            ReservationLine.objects.bulk_create(
                ReservationLine(reservation=reservation, rule_id=rule_id, amount=amount)
                for rule_id, amount in plan.reserve.items()
            )
    except IntegrityError:
        # The same claim is already admitted (a retried create): it reserves once.
        return None
    except _Exceeded as exceeded:
        return QuotaRule.objects.get(pk=exceeded.rule_id), exceeded.asked
    return None


_RESERVATION_COLUMNS = (
    "cluster",
    "namespace",
    "name",
    "team_id",
    "state",
    "username",
    "owner_kind",
    "owner_name",
    "owner_references",
    "chosen",
    "admission_uid",
    "created_at",
    "expires_at",
)


@functools.cache
def _reserve_sql(rules: int, *, restore: bool, durability: bool) -> str:
    """The reserving statement on PostgreSQL for `rules` rules (made once per shape); with
    `restore`, it sets the session's own settings back (two more parameters) when it admits,
    as the last thing it evaluates, after every lock it takes; with `durability`, it sets the
    durability of its commit (one more)."""
    quote = connection.ops.quote_name
    rule, reservation, line, decision = (
        quote(model._meta.db_table)
        for model in (QuotaRule, Reservation, ReservationLine, AdmissionDecision)
    )
    limit = quote("limit")
    values = ", ".join(["(%s::bigint, %s::numeric, %s::boolean)"] * rules)
    # A denied claim's decision is recorded by the next statement, which sets them back then.
    restores = (
        ",\n       CASE WHEN verdict.fits THEN ARRAY[" + restore_columns() + "] END"
        if restore
        else ""
    ) + (f",\n       {durability_column()}" if durability else "")
    return f"""
WITH asked(rule_id, amount, enforce) AS (VALUES {values}),
locked AS (
    SELECT r.id, r.name, r.in_use, r.{limit} FROM {rule} r
    WHERE r.id IN (SELECT rule_id FROM asked) ORDER BY r.id FOR UPDATE
),
over AS (
    SELECT l.id, l.name, l.in_use, l.{limit}, a.amount
    FROM asked a JOIN locked l ON l.id = a.rule_id
    WHERE a.enforce AND l.in_use + a.amount > l.{limit} ORDER BY l.id LIMIT 1
),
verdict AS (
    SELECT NOT EXISTS (SELECT 1 FROM over)
           AND (SELECT count(*) FROM locked) = (SELECT count(*) FROM asked) AS fits
),
kept AS (
    INSERT INTO {reservation} ({", ".join(_RESERVATION_COLUMNS)}, claim_uid, released_at)
    SELECT %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s, '', NULL
    FROM verdict WHERE verdict.fits
    ON CONFLICT (cluster, namespace, name) WHERE NOT (state = 'released') DO NOTHING
    RETURNING id
),
counted AS (
    UPDATE {rule} r SET in_use = r.in_use + a.amount FROM asked a, kept
    WHERE r.id = a.rule_id RETURNING r.id
),
lines AS (
    INSERT INTO {line} (reservation_id, rule_id, amount)
    SELECT kept.id, a.rule_id, a.amount FROM kept, asked a RETURNING id
),
recorded AS (
    INSERT INTO {decision} ({_DECISION_COLUMNS})
    SELECT %s, %s, %s, %s, %s, %s, true, false, '', %s::jsonb FROM verdict WHERE verdict.fits
    RETURNING id
)
SELECT verdict.fits, over.id, over.in_use, over.amount,
       (SELECT count(*) FROM counted), (SELECT count(*) FROM lines),
       (SELECT count(*) FROM recorded){restores}
FROM verdict LEFT JOIN over ON true
"""


def _reserve_in_one_statement(
    reservation: dict[str, Any], plan: _Plan, *, username: str
) -> tuple[Rule, Decimal] | None:
    """PostgreSQL: lock the rules (in id order), check every enforce limit against their
    current usage, insert the reservation (once per claim), add its amounts to the rules,
    insert its lines and record the decision, all in one statement: one round trip.

    A claim admitted meanwhile by another call (the same create sent again) makes the insert
    do nothing, and with it the rest: it reserves once and the answer is the same.
    """
    params: list[Any] = []
    for rule_id in sorted(plan.reserve):
        params += [rule_id, plan.reserve[rule_id], plan.rules[rule_id].mode == Mode.ENFORCE]
    params += [
        *(reservation[column] for column in _RESERVATION_COLUMNS[:8]),
        json.dumps(reservation["owner_references"]),
        json.dumps(reservation["chosen"]),
        *(reservation[column] for column in _RESERVATION_COLUMNS[10:]),
        reservation["created_at"],
        reservation["admission_uid"],
        reservation["namespace"],
        reservation["name"],
        username,
        reservation["team_id"],
        json.dumps(plan.warnings),
    ]
    ending = statement_ending()  # set back when it admits: then it is the admission's last
    [(fits, over_id, in_use, amount, *_)] = fetch_prepared(
        _reserve_sql(len(plan.reserve), restore=ending.restore, durability=ending.durable),
        [*params, *ending.params],
    )
    if fits:
        if ending.restore:
            restored()
        return None
    if over_id is None:
        raise _RulesChanged  # a rule was deleted while this claim was being admitted
    rule = plan.rules[over_id]
    rule.in_use = in_use
    return rule, amount


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
        fleet_shape = Shape.from_row(device.shape, memory_bytes=device.memory_bytes)
        view = fleet_shape.view
        consumed = allocation.consumed_capacity.get("memory") if allocation.share_id else None
        for rule in rules:
            if rule.device_class != allocated_for.device_class_name:
                continue
            try:
                if rule.selector and not cel.compile_selector(rule.selector).matches(view):
                    continue
            except cel.CELError:
                pass
            amounts[rule.pk] += _per_device(fleet_shape, rule, consumed)
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
