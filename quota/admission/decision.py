"""What an admission decides, from what it read: no database, no connection.

`plan_claim` weighs a claim against its team's rules (as `store.admission_state` read them,
usage as of that moment), its budget and the fleet's shapes: what each request can take on
each rule, which `firstAvailable` alternatives fit, and the denial or warnings. The store then
reserves the plan (or does not); everything here is plain Python on plain data.

A claim is counted by what it can really take: `ExactCount` its count, `All` the most
matching devices on one node, a MIG device its share of its GPU, a consumable share (KEP-5075)
the largest fraction it consumes of any of the device's capacities (`inventory.capacity`: its
requests under any capacity name, qualified or not, rounded up by `requestPolicy`, and the
policy's default for what it does not name), `adminAccess` nothing. Amounts are in the unit of
the devices a rule covers (GPUs, TPU chips, Gaudi cards; "accelerators" when they differ), and
messages say which. Rules bind devices, not class names:
a request counts on every rule that covers a device it could be given (the rule's device
class's selectors and its own), whatever class the request names. `claim_amounts` is what an
admitted claim holds until it is allocated, as the ledger's recount works it out again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from kubernetes.utils import parse_quantity

from inventory import capacity, dra
from inventory.profiles import unit_label
from quota import cel
from quota.admission.shapes import FleetShapes, Shape
from quota.models import Mode, QuotaRule, ReservationState, Unit
from teams.models import Team

NEAR_LIMIT = Decimal("0.8")
# The resource.k8s.io versions whose ResourceClaim layout Tally reads (`dra.parse_claim_requests`):
# requests wrapped in `exactly` in v1 and v1beta2, flat in v1beta1 and v1alpha3. Any other
# (v1alpha2, classic DRA, has no `spec.devices`) is not counted: see `unread_version`.
CLAIM_VERSIONS = ("v1", "v1beta2", "v1beta1", "v1alpha3")
CLAIM_API_VERSIONS = frozenset(f"{dra.GROUP}/{version}" for version in CLAIM_VERSIONS)
# The capacities a memory rule counts, as drivers name them.
MEMORY_CAPACITIES = ("memory", "addressableMemory")
# The resource-claim controller creates claims from ResourceClaimTemplates for Pods.
CONTROLLER_USERS = ("system:serviceaccount:kube-system:", "system:kube-controller-manager")


@dataclass(slots=True)
class RuleSnapshot:
    """A quota rule as one admission reads it: its definition and its usage at that moment.

    A plain record rather than a `QuotaRule` instance: the webhook builds a few for every
    request, and a model instance costs several times more to make.
    """

    pk: int
    name: str
    device_class: str
    selector: str
    unit: str
    limit: Decimal
    mode: str
    in_use: Decimal


# A rule as an admission read it, or as stored (the sync's exact allocations).
Rule = RuleSnapshot | QuotaRule


@dataclass
class AdmissionState:
    """What one admission reads from the database, in one query: the namespace's team with its
    rules and their current usage, and the team of a live reservation already made for the
    same claim (a create the API server sent again)."""

    team: Team | None
    rules: list[RuleSnapshot]
    replayed_team_id: int | None


@dataclass(frozen=True)
class BudgetUse:
    """A team's GPU-hour budget, and the hours it has used in the period holding now."""

    gpu_hours: Decimal
    mode: str  # "hard" denies new claims past it; "soft" warns
    used: Decimal
    period: str  # the period's name, as the commands print it


@dataclass
class Demand:
    """What one request (or one of its alternatives) can take, per rule that limits it."""

    name: str
    amounts: dict[int, Decimal]
    devices: int


@dataclass
class Decision:
    """The webhook's answer to one claim."""

    allowed: bool
    message: str = ""
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    team: Team | None = None
    # firstAvailable requests: alternatives that do not fit, by request name.
    removed: dict[str, list[str]] = field(default_factory=dict)
    # The quota rule that denied, for metrics.
    rule: str = ""


@dataclass
class Plan:
    """A claim weighed against its team's quota: what to reserve on each rule, or why not."""

    team: Team | None
    rules: dict[int, Rule]
    reserve: dict[int, Decimal]
    chosen: dict[str, list[str]]
    removed: dict[str, list[str]]
    warnings: list[str]
    denial: str = ""
    reason: str = ""
    rule: str = ""
    # What each rule's amounts count in this cluster's fleet ("gpu", "tpu", ...), by rule id.
    units: dict[int, str] = field(default_factory=dict)

    def decision(self) -> Decision:
        """The answer this plan gives before anything is reserved."""
        if self.denial:
            return Decision(
                allowed=False,
                message=self.denial,
                reason=self.reason,
                warnings=self.warnings,
                team=self.team,
                rule=self.rule,
            )
        return Decision(allowed=True, warnings=self.warnings, team=self.team, removed=self.removed)


def claim_name(claim: dict[str, Any]) -> tuple[str, str]:
    """The claim's namespace and name (its generateName when it has no name yet)."""
    metadata = claim.get("metadata") if isinstance(claim.get("metadata"), dict) else {}
    assert isinstance(metadata, dict)
    return str(metadata.get("namespace") or "default"), str(
        metadata.get("name") or metadata.get("generateName") or ""
    )


def plan_claim(
    *,
    claim: dict[str, Any],
    state: AdmissionState,
    fleet: Callable[[], FleetShapes],
    budget: Callable[[Team], BudgetUse | None],
) -> Plan:
    """Weigh `claim` against its team's rules and budget as `state` read them.

    `fleet` and `budget` give the fleet's shapes and a team's budget use; each is asked only
    when the plan needs it (a claim of no team, or past its budget, needs neither).
    """
    plan = Plan(team=None, rules={}, reserve={}, chosen={}, removed={}, warnings=[])
    unread = unread_version(claim.get("apiVersion"))
    requests: list[dra.ParsedRequest] | None = None
    if not unread:
        try:
            spec = claim.get("spec")
            if not isinstance(spec, dict):
                raise dra.DRAObjectError(dra.object_ref(claim), "spec", "is required")
            requests = dra.parse_claim_requests(spec, claim["apiVersion"])
        except dra.DRAObjectError as exc:
            plan.denial, plan.reason = (
                f"cannot read the claim: {exc.field_path}: {exc.problem}",
                "Invalid",
            )
            return plan
    namespace, _ = claim_name(claim)
    plan.team = state.team
    if plan.team is None:
        if settings.TALLY_UNOWNED_NAMESPACES == "deny":
            plan.denial = f"namespace {namespace!r} is not owned by any team"
            plan.reason = "Forbidden"
        else:
            plan.warnings.append(
                f"namespace {namespace!r} is not owned by any team; no quota applies"
            )
            if unread:
                plan.warnings.append(unread)
        return plan
    if requests is None:
        _weigh_unread(plan, state.rules, unread, budget)
        return plan
    if _budget_denies(plan, requests, budget):
        return plan
    rules = state.rules
    plan.rules = {rule.pk: rule for rule in rules}
    if not rules:
        return plan
    shapes = fleet()
    plan.units = {rule.pk: shapes.unit(rule.device_class, rule.selector) for rule in rules}
    for request in requests:
        alternatives = request.first_available or [request]
        demands = [
            demand(alternative, rules, shapes, plan.warnings) for alternative in alternatives
        ]
        fitting = [d for d in demands if exceeded(plan, d) is None]
        if not fitting:
            rule, asked = exceeded(plan, demands[0]) or (rules[0], Decimal(0))
            plan.denial = over_limit(plan.team, rule, asked, plan.units.get(rule.pk))
            plan.rule = rule.name
            if len(demands) > 1:
                plan.denial += (
                    f" (none of the {len(demands)} alternatives of request {request.name!r} fits)"
                )
            plan.reason = "QuotaExceeded"
            return plan
        if request.first_available:
            plan.chosen[request.name] = [d.name for d in fitting]
            skipped = [d.name for d in demands if d not in fitting]
            if skipped:
                plan.removed[request.name] = skipped
        _add_most(plan.reserve, fitting)
    for rule_id, amount in plan.reserve.items():
        rule = plan.rules[rule_id]
        total = rule.in_use + amount
        unit = plan.units.get(rule_id)
        if rule.mode == Mode.WARN and total > rule.limit:
            plan.warnings.append(over_limit(plan.team, rule, amount, unit) + " (warn only)")
        elif rule.limit and total >= NEAR_LIMIT * rule.limit:
            plan.warnings.append(
                f'team "{plan.team.slug}": quota rule "{rule.name}" is at '
                f"{_fmt(total, rule, unit)} of {_fmt(rule.limit, rule, unit)} with this claim"
            )
    return plan


def unread_version(api_version: Any) -> str:
    """Why a claim of `api_version` cannot be counted; "" for a version Tally reads."""
    if api_version in CLAIM_API_VERSIONS:
        return ""
    supported = ", ".join(f"{dra.GROUP}/{version}" for version in CLAIM_VERSIONS)
    sent = f"apiVersion {api_version!r}" if api_version else "no apiVersion"
    return f"Tally cannot count a ResourceClaim of {sent}: it reads {supported}"


def _weigh_unread(
    plan: Plan,
    rules: Sequence[RuleSnapshot],
    unread: str,
    budget: Callable[[Team], BudgetUse | None],
) -> None:
    """A claim of a version Tally does not read, in a team's namespace: denied when an enforce
    rule or a hard budget binds the team (it could take anything past them), else admitted
    with a warning, counted on nothing."""
    assert plan.team is not None
    enforced = sorted(rule.name for rule in rules if rule.mode == Mode.ENFORCE)
    if enforced:
        plan.denial = (
            f'team "{plan.team.slug}": {unread}; it would not be counted on the enforce quota '
            f"rule(s) {', '.join(enforced)}"
        )
        plan.reason = "UnsupportedVersion"
        return
    if _budget_denies(plan, None, budget):
        return
    plan.warnings.append(f"{unread}; it is counted on no quota rule")


def _add_most(reserve: dict[int, Decimal], kept: list[Demand]) -> None:
    """Add to `reserve` the most any of a request's kept alternatives can take on each rule:
    until the scheduler picks one, the request holds what the largest could take."""
    for rule_id in sorted({rule_id for d in kept for rule_id in d.amounts}):
        reserve[rule_id] = reserve.get(rule_id, Decimal(0)) + max(
            d.amounts.get(rule_id, Decimal(0)) for d in kept
        )


def claim_amounts(
    *,
    spec: dict[str, Any],
    api_version: str,
    chosen: Any,
    rules: Sequence[Rule],
    fleet: FleetShapes,
) -> dict[int, Decimal]:
    """What an admitted claim not yet allocated holds on each of `rules`: what its requests
    can take on the fleet, each `firstAvailable` request the most of the alternatives its
    admission kept (`chosen`, as the reservation stores it), as `plan_claim` reserved it. An
    unreadable claim holds nothing (it could not have been admitted)."""
    try:
        requests = dra.parse_claim_requests(spec, api_version)
    except dra.DRAObjectError:
        return {}
    kept_by_request = chosen if isinstance(chosen, dict) else {}
    amounts: dict[int, Decimal] = {}
    for request in requests:
        alternatives = request.first_available or [request]
        kept = kept_by_request.get(request.name) if request.first_available else None
        if isinstance(kept, list) and kept:
            alternatives = [a for a in alternatives if a.name in kept] or alternatives
        _add_most(amounts, [demand(a, rules, fleet, warnings=[]) for a in alternatives])
    return amounts


def _budget_denies(
    plan: Plan,
    requests: list[dra.ParsedRequest] | None,
    budget: Callable[[Team], BudgetUse | None],
) -> bool:
    """Past a hard GPU-hour budget new claims are denied; past 80% or a soft one, warned. A
    claim that only observes devices (admin access) is never weighed against it; one whose
    requests were not read (None) always is."""
    assert plan.team is not None
    if requests is not None and all(r.admin_access for r in requests if not r.first_available):
        return False
    use = budget(plan.team)
    if use is None:
        return False
    figures = (
        f'team "{plan.team.slug}" has used {use.used.quantize(Decimal("0.1"))} of its '
        f"{use.gpu_hours.normalize():f} GPU-hour {use.mode} budget for {use.period}"
    )
    if use.used >= use.gpu_hours and use.mode == "hard":
        plan.denial, plan.reason = figures, "BudgetExceeded"
        return True
    if use.used >= use.gpu_hours:
        plan.warnings.append(figures + " (past the soft budget)")
    elif use.used >= NEAR_LIMIT * use.gpu_hours:
        plan.warnings.append(figures)
    return False


def exceeded(plan: Plan, demand: Demand) -> tuple[Rule, Decimal] | None:
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


def over_limit(team: Team, rule: Rule, asked: Decimal, unit: str | None = None) -> str:
    """The denial naming the team, the rule, what is in use, what was asked and the limit, in
    `unit` (what the rule's devices count; None: GPUs)."""
    return (
        f'team "{team.slug}": quota rule "{rule.name}" ({rule.mode}) would be exceeded: '
        f"{_fmt(rule.in_use, rule, unit)} in use, {_fmt(asked, rule, unit)} requested, "
        f"limit {_fmt(rule.limit, rule, unit)}"
    )


def over_quota(plan: Plan, rule: Rule, asked: Decimal) -> Decision:
    """The denial of a planned claim that a rule's usage, as the reservation found it, no
    longer allows."""
    assert plan.team is not None
    return Decision(
        allowed=False,
        message=over_limit(plan.team, rule, asked, plan.units.get(rule.pk)),
        reason="QuotaExceeded",
        warnings=plan.warnings,
        team=plan.team,
        rule=rule.name,
    )


def rules_changed(team: Team) -> Decision:
    """The denial of a claim whose team's rules changed while it was being admitted."""
    message = f'team "{team.slug}": its quota rules changed during this admission'
    return Decision(
        allowed=False, message=message + "; create the claim again", reason="Conflict", team=team
    )


def _fmt(value: Decimal, rule: Rule, unit: str | None) -> str:
    if rule.unit == Unit.MEMORY:
        return f"{(value / 2**30).quantize(Decimal('0.01')).normalize():f}Gi"
    rounded = value.quantize(Decimal("0.001")).normalize()
    return f"{rounded:f} {unit_label(unit or 'gpu', plural=rounded != 1)}"


def demand(
    request: dra.ParsedRequest,
    rules: Sequence[Rule],
    fleet: FleetShapes,
    warnings: list[str],
) -> Demand:
    """What `request` can take on each of `rules` that limits it: each rule that covers a
    device the request could be given (its class's selectors and its own, over the fleet's
    shapes, less those that cannot provide its capacity requests), whatever class the request
    names."""
    result = Demand(name=request.name, amounts={}, devices=0)
    if request.admin_access or not rules:
        return result  # admin access observes devices; it holds nothing
    selectors = tuple(request.selectors)
    asked = tuple(sorted(request.capacity_requests.items()))
    candidates = fleet.derived(
        ("eligible", request.device_class_name, selectors, asked),
        functools.partial(
            _eligible,
            fleet.candidates(request.device_class_name, selectors),
            request.capacity_requests,
        ),
    )
    per_device_on: dict[int, Decimal] = {}
    for rule in rules:
        # What one device counts on this rule: the same for every request that asks alike, so
        # worked out once per fleet snapshot (None: the rule covers none of the candidates).
        key = (
            request.device_class_name,
            selectors,
            asked,
            rule.device_class,
            rule.selector,
            rule.unit,
        )
        each = fleet.derived(
            key,
            functools.partial(
                _per_device_on,
                rule,
                request.device_class_name,
                candidates,
                fleet,
                request.capacity_requests,
            ),
        )
        if each is None:
            continue
        per_device_on[rule.pk] = each
        if rule.selector:  # validated when written; kept safe if stored otherwise
            error = fleet.derived(
                ("selector error", rule.selector), functools.partial(_selector_error, rule.selector)
            )
            if error:
                warnings.append(
                    f'quota rule "{rule.name}" has a bad selector, applied to its whole class: '
                    f"{error}"
                )
    if not per_device_on:
        return result
    if not candidates:
        # Nothing to weigh it by: it counts as whole devices on every rule of its class, the
        # most it could take, until the sync sees what it was given.
        units = {fleet.unit(r.device_class, r.selector) for r in rules if r.pk in per_device_on}
        whole = units.pop() if len(units) == 1 else "accelerator"
        asking = (
            " with capacity " + ", ".join(f"{name}: {value}" for name, value in asked)
            if asked
            else ""
        )
        warnings.append(
            f'request "{request.name}": no device of class "{request.device_class_name}"'
            f"{asking} in the inventory matches it; until it is allocated, each device it asks "
            f"for counts as one whole {unit_label(whole, plural=False)} (and no memory) on "
            "every quota rule of its class"
        )
    if request.allocation_mode == "All":
        devices = fleet.derived(
            ("all", request.device_class_name, selectors, asked),
            lambda: _most_on_a_node(fleet, candidates),
        )
    else:
        devices = request.count
    result.devices = devices
    result.amounts = {rule_id: each * devices for rule_id, each in per_device_on.items()}
    return result


def _eligible(candidates: list[Shape], capacity_requests: dict[str, str]) -> list[Shape]:
    """The candidate shapes that can provide `capacity_requests`: the scheduler gives a
    request only devices that publish every capacity it asks for, with enough of it, in
    amounts their `requestPolicy` allows."""
    if not capacity_requests:
        return candidates
    return [shape for shape in candidates if _consumes(shape, capacity_requests) is not None]


def _consumes(shape: Shape, capacity_requests: dict[str, str]) -> dict[str, Decimal] | None:
    """What a request asking `capacity_requests` consumes of a device of `shape`, by capacity;
    None when it cannot be given one."""
    try:
        return capacity.requested_amounts(shape.capacity, capacity_requests, shape.driver)
    except capacity.CapacityError:
        return None


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
    rule: Rule,
    request_class: str,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> Decimal | None:
    """The most one device of `candidates` that `rule` covers counts on it; None when it
    covers none of them (it does not limit the request). A request that no known device
    matches is limited by the rules of the class it names, as whole devices."""
    if not candidates:
        return (
            _most_per_device(rule, [], capacity_requests)
            if rule.device_class == request_class
            else None
        )
    covered = fleet.covered(rule.device_class, rule.selector)
    shapes = [shape for shape in candidates if shape.id in covered]
    if not shapes:
        return None
    accelerators = fleet.covers_accelerators(rule.device_class, rule.selector)
    return _most_per_device(rule, shapes, capacity_requests, of_accelerators=accelerators)


def _selector_error(selector: str) -> str:
    try:
        cel.compile_selector(selector)
    except cel.CELError as exc:
        return str(exc)
    return ""


def _most_per_device(
    rule: Rule,
    shapes: list[Shape],
    capacity_requests: dict[str, str],
    *,
    of_accelerators: bool = False,
) -> Decimal:
    return max(
        (
            per_device(
                shape,
                rule,
                _consumes(shape, capacity_requests) if shape.shareable else None,
                of_accelerators=of_accelerators,
            )
            for shape in shapes
        ),
        default=Decimal(1) if rule.unit == Unit.GPUS else Decimal(0),
    )


def per_device(
    shape: Shape,
    rule: Rule,
    consumed: Mapping[str, Any] | None,
    *,
    of_accelerators: bool = False,
) -> Decimal:
    """What one device of `shape` counts on `rule`. `consumed`: what a share of a shareable
    device takes of its capacities (`inventory.capacity.requested_amounts`, or an allocation's
    `consumedCapacity`); None for the whole device. A share counts its fraction of the device
    (the largest of any capacity) and, on a memory rule, the memory it consumes.

    A device that is not an accelerator (kind "other": Intel's integrated GPU, a NIC) counts
    nothing on a rule that covers accelerators (`of_accelerators`), and one device on a rule
    that covers only such devices, which then limits how many are held."""
    if rule.unit == Unit.MEMORY:
        if consumed is not None:
            for name in MEMORY_CAPACITIES:
                key = capacity.capacity_name(consumed, name, shape.driver)
                if key is not None:
                    return Decimal(parse_quantity(consumed[key]))
            return Decimal(0)
        return Decimal(shape.memory_bytes or 0)
    if shape.kind == "other":
        share = Decimal(0) if of_accelerators else Decimal(1)
    else:
        share = shape.gpu_share
    if consumed is None:
        return share
    try:
        fraction = capacity.consumed_fraction(shape.capacity, consumed, shape.driver)
    except capacity.CapacityError:
        return share  # a quantity that cannot be read: the whole device, the most it takes
    return (share * fraction).quantize(Decimal("0.000001"))


def reservation_fields(
    *,
    cluster: str,
    claim: dict[str, Any],
    plan: Plan,
    username: str,
    admission_uid: str,
    at: datetime,
) -> dict[str, Any]:
    """The reservation that admitting `claim` by `plan` makes, as its columns' values."""
    assert plan.team is not None
    namespace, name = claim_name(claim)
    metadata = claim.get("metadata") or {}
    owners = metadata.get("ownerReferences") if isinstance(metadata, dict) else None
    owners = owners if isinstance(owners, list) else []
    controller = next((o for o in owners if isinstance(o, dict) and o.get("controller")), None)
    made_by_controller = username.startswith(CONTROLLER_USERS) and controller is not None
    return {
        "cluster": cluster,
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


def not_chosen(claim: dict[str, Any], chosen: Any) -> dict[str, list[str]]:
    """The alternatives of `claim` that its live reservation did not choose (`chosen`, as
    stored: the kept alternatives by request), by request."""
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
