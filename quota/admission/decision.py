"""What an admission decides, from what it read: no database, no connection.

`plan_claim` weighs a claim against its team's rules (as `store.admission_state` read them,
usage as of that moment), its budget and the fleet's shapes: what each request can take on
each rule, which `firstAvailable` alternatives fit, and the denial or warnings. The store then
reserves the plan (or does not); everything here is plain Python on plain data.

A claim is counted by what it can really take, all its devices on one node (devices published
without a node reach every node): `ExactCount` the count of matching devices that count most
on one node that has that many (see `_most_of_count_on_a_node`), `All` every matching device
of the node where they count most, each by its own shape (see `_most_on_a_node`), of the nodes
where they can all be given (not too many, not more than their shared counter sets hold, no
pool there the scheduler allocates nothing from), never a device of such a pool (one that
publishes a device name or counter set twice, or whose devices consume a counter set or counter
its slices do not publish: `shapes.InvalidPools`), a MIG
device its share of its GPU, a consumable share (KEP-5075) the largest fraction it
consumes of any of the device's capacities (`inventory.capacity`: its requests under any
capacity name, qualified or not, rounded up by `requestPolicy`, and the policy's default for
what it does not name), `adminAccess` nothing. Amounts are in the unit of
the devices a rule covers (GPUs, TPU chips, Gaudi cards; "accelerators" when they differ), and
messages say which. Rules bind devices, not class names:
a request counts on every rule that covers a device it could be given (the rule's device
class's selectors and its own), whatever class the request names; one whose class matches no
device yet counts whole devices on the rules of its class and of its class's driver, and one
whose class names no driver either is denied under enforce (`demand`). `claim_amounts` is what an
admitted claim holds until it is allocated, as the ledger's recount works it out again.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from kubernetes.utils import parse_quantity

from inventory import capacity, dra
from inventory.checks import InvalidPool
from inventory.gangs import GangRef
from inventory.profiles import hours_label, unit_label
from quota import cel
from quota.admission.shapes import NO_SHORTFALL, FleetShapes, Shape, rule_unit, too_many_steps
from quota.models import GangMode, Mode, QuotaRule, ReservationState, Unit
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


@dataclass(frozen=True, kw_only=True)
class LiveReservation:
    """The live reservation found under an admitted claim's name: its team, and what says
    which claim it was made for (the claim's uid once the sync has seen it, and the digest
    of the spec admitted, `spec_digest`; "" where not known)."""

    team_id: int
    claim_uid: str
    spec_digest: str

    def made_for(
        self, claim: dict[str, Any], *, removed: dict[str, list[str]] | None = None
    ) -> bool:
        """Whether `claim` is the claim this reservation was made for: a create the API server
        (or its client) sent again. The same uid, or the same spec (as sent, or with the
        alternatives `removed` left out, as the mutating webhook's patch stores it);
        a reservation with no digest (made before digests were kept, or adopted by the sync)
        takes any claim as its, but one of another uid than the claim the sync saw.
        Another claim under the same name (one deleted and made again differently, or a
        create of a name in use) is no retry: it is weighed as new."""
        metadata = claim.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        if self.claim_uid and isinstance(uid, str) and uid:
            if uid == self.claim_uid:
                return True
            if not self.spec_digest:
                return False  # another object, and no spec kept to find it the same
        elif not self.spec_digest:
            return True
        return self.spec_digest in {spec_digest(claim), spec_digest(claim, removed=removed)}


def spec_digest(claim: dict[str, Any], *, removed: dict[str, list[str]] | None = None) -> str:
    """A digest of `claim`'s spec, as JSON with sorted keys (so the order a client wrote it
    in does not matter), less the firstAvailable alternatives `removed` (by request)."""
    spec = claim.get("spec")
    if removed and isinstance(spec, dict):
        spec = _without_alternatives(spec, removed)
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _without_alternatives(spec: dict[str, Any], removed: dict[str, list[str]]) -> dict[str, Any]:
    """`spec` with the firstAvailable alternatives `removed` (by request name) taken out, as
    the mutating webhook's patch takes them out."""
    devices = spec.get("devices")
    if not isinstance(devices, dict) or not isinstance(devices.get("requests"), list):
        return spec
    kept = []
    for request in devices["requests"]:
        name = request.get("name") if isinstance(request, dict) else None
        gone = set(removed.get(name, ())) if isinstance(name, str) else set()
        alternatives = request.get("firstAvailable") if gone else None
        if isinstance(alternatives, list):
            request = {
                **request,
                "firstAvailable": [
                    alt
                    for alt in alternatives
                    if not isinstance(alt, dict) or alt.get("name") not in gone
                ],
            }
        kept.append(request)
    return {**spec, "devices": {**devices, "requests": kept}}


@dataclass
class AdmissionState:
    """What one admission reads from the database, in one query: the namespace's team with its
    rules and their current usage, and the live reservation already made under the claim's
    name, if any (a create sent again, or another claim of the same name)."""

    team: Team | None
    rules: list[RuleSnapshot]
    live: LiveReservation | None
    # How the team's gangs are admitted (`GangMode`; a team without a policy: enforce).
    gang_mode: str = GangMode.ENFORCE.value
    # What the claim may draw, by rule, from its gang's live hold (`store.gang_state`): counted
    # in the rules' usage already, so only what it asks beyond that is weighed against limits.
    credit: dict[int, Decimal] = field(default_factory=dict)


@dataclass(frozen=True)
class BudgetUse:
    """A team's budget in hours of one unit, and the hours of that unit it has used in the
    period holding now."""

    hours: Decimal
    unit: str  # what the hours count (inventory.models.Unit): GPU-hours, TPU chip-hours, ...
    mode: str  # "hard" denies new claims past it; "soft" warns
    used: Decimal
    period: str  # the period's name, as the commands print it


@dataclass
class Demand:
    """What one request (or one of its alternatives) can take, per rule that limits it."""

    name: str
    amounts: dict[int, Decimal]
    devices: int
    # Said with a denial it causes: why it counts what it does (a class no device matches yet).
    note: str = ""
    # The ids of the shapes it could be given: which of them a rule that denies it binds.
    shapes: frozenset[int] = frozenset()
    # Why Tally cannot tell which rules it would count on (a class that matches no device and
    # names no driver): denied where an enforce rule binds the team, never counted 0 in silence.
    unbound: str = ""


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
    # What each rule's amounts count over every cluster's fleet ("gpu", "tpu", ...), by rule id.
    units: dict[int, str] = field(default_factory=dict)
    # What the claim may take, by rule, from its gang's hold (`AdmissionState.credit`).
    credit: dict[int, Decimal] = field(default_factory=dict)
    # The claim's gang, and what admitting it reserves for the gang (`weigh_gang`).
    gang: GangPlan | None = None

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
    units: Callable[[Sequence[Rule]], dict[int, str]],
    narrow: bool = False,
) -> Plan:
    """Weigh `claim` against its team's rules and budget as `state` read them.

    A `firstAvailable` request holds what the scheduler could give it. With `narrow` (the
    mutating webhook) it keeps only its first alternative that fits, and holds what that one
    takes. Without (the validating webhook, which sees the claim as the scheduler will) every
    alternative left must fit, and it holds on each rule the most any one alternative takes
    there: whichever the scheduler picks takes no more on any rule, so this never under-counts
    and `reserved + allocated <= limit` holds for every enforce rule. Not every alternative at
    once: a GPU-or-Gaudi request holds one of each, not two of either.

    `fleet` and `budget` give the fleet's shapes and a team's budget use; each is asked only
    when the plan needs it (a claim of no team, or past its budget, needs neither). `units`
    gives what each rule counts over every cluster's fleet (`shapes.rule_units`), as the API
    names it: a rule is not of one cluster, so the local fleet alone may name another unit.
    """
    plan = Plan(
        team=None,
        rules={},
        reserve={},
        chosen={},
        removed={},
        warnings=[],
        credit=dict(state.credit),
    )
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
    if _budget_denies(plan, requests, budget, fleet):
        return plan
    rules = state.rules
    plan.rules = {rule.pk: rule for rule in rules}
    if not rules:
        return plan
    shapes = fleet()
    for quota_rule in rules:
        # A rule of a class whose selectors cannot be evaluated covers no device it can name.
        problem = shapes.unweighable(quota_rule.device_class, ())
        if problem:
            plan.warnings.append(f'quota rule "{quota_rule.name}" counts nothing: {problem}')
    problems = unweighable(requests, shapes)
    if problems:
        # Selectors Tally cannot evaluate (or not within its limits) say nothing of the
        # devices the claim could be given: refused where a rule is enforced, never taken
        # to select nothing in silence.
        if any(rule.mode == Mode.ENFORCE for rule in rules):
            plan.denial = "; ".join(f"{where}: {problem}" for where, problem in problems)
            plan.reason = "Invalid"
            return plan
        # Not weighed at all (that could evaluate what was left unevaluated): counted on
        # no rule until the sync sees what it was given.
        plan.warnings.extend(f"{where} (warn only): {problem}" for where, problem in problems)
        plan.warnings.append("the claim is counted on no quota rule until it is allocated")
        return plan
    plan.units = units(rules)
    # Alternatives are removed by request name: a claim that names two requests alike (the API
    # server refuses it after the mutating webhook) is left whole.
    narrow = narrow and len({request.name for request in requests}) == len(requests)
    for request in requests:
        alternatives = request.first_available or [request]
        demands = [
            demand(alternative, rules, shapes, plan.warnings) for alternative in alternatives
        ]
        unbound = [d.unbound for d in demands if d.unbound]
        if unbound and any(rule.mode == Mode.ENFORCE for rule in rules):
            plan.denial = "; ".join(unbound) + (
                "; it could be given devices an enforce quota rule limits, uncounted"
            )
            plan.reason = "Invalid"
            return plan
        plan.warnings.extend(f"{problem} (warn only); it counts on none" for problem in unbound)
        fitting = [d for d in demands if exceeded(plan, d) is None]
        if not fitting:
            rule, asked = exceeded(plan, demands[0]) or (rules[0], Decimal(0))
            plan.denial = over_limit(plan.team, rule, asked, plan.units.get(rule.pk))
            plan.denial += demands[0].note + _binds(shapes, rule, demands[0])
            plan.rule = rule.name
            if len(demands) > 1:
                plan.denial += (
                    f" (none of the {len(demands)} alternatives of request {request.name!r} fits)"
                )
            plan.reason = "QuotaExceeded"
            return plan
        # The mutating webhook keeps one alternative, the first that fits, so the claim holds
        # only what that one takes. Left to the validating webhook, every alternative stays in
        # the claim and the scheduler may give any of them: each must fit, and the request
        # holds on each rule the most any one of them takes there (`_add_most`).
        kept = fitting[:1] if narrow else demands
        unfit = next((d for d in kept if d not in fitting), None)
        if unfit is not None:
            rule, asked = exceeded(plan, unfit) or (rules[0], Decimal(0))
            plan.denial = (
                over_limit(plan.team, rule, asked, plan.units.get(rule.pk))
                + f" by alternative {unfit.name!r} of request {request.name!r}, which the "
                "scheduler may give the claim (remove it, or let Tally's mutating webhook "
                "remove the alternatives over quota)" + _binds(shapes, rule, unfit)
            )
            plan.rule, plan.reason = rule.name, "QuotaExceeded"
            return plan
        if request.first_available:
            plan.chosen[request.name] = [d.name for d in kept]
            # By name, as the patch removes them (a name given twice, which the API server
            # refuses after this webhook, is kept whole).
            skipped = [d.name for d in demands if d.name not in plan.chosen[request.name]]
            if skipped:
                plan.removed[request.name] = skipped
        _add_most(plan.reserve, kept)
    for rule_id, amount in plan.reserve.items():
        rule = plan.rules[rule_id]
        total = rule.in_use + _fresh(plan, rule_id, amount)
        unit = plan.units.get(rule_id)
        if rule.mode == Mode.WARN and total > rule.limit:
            plan.warnings.append(over_limit(plan.team, rule, amount, unit) + " (warn only)")
        elif rule.limit and total >= NEAR_LIMIT * rule.limit:
            plan.warnings.append(
                f'team "{plan.team.slug}": quota rule "{rule.name}" is at '
                f"{_fmt(total, rule, unit)} of {_fmt(rule.limit, rule, unit)} with this claim"
            )
    return plan


def unweighable(requests: list[dra.ParsedRequest], fleet: FleetShapes) -> list[tuple[str, str]]:
    """Why the selectors of `requests` (every `firstAvailable` alternative) cannot be weighed:
    one that does not compile or is too expensive (`cel.MAX_ESTIMATED_COST`, and
    `cel.MAX_CLAIM_ESTIMATED_COST` for the claim's together), a class's or its own that cannot
    be evaluated on the fleet's shapes (`FleetShapes.weigh`), or all of them together taking
    more than `cel.MAX_CLAIM_STEPS` over those shapes (evaluation stops there, so a claim takes
    a worker for that long at most); each as (what, why). Empty: none. Worked out once per
    fleet snapshot for requests that ask alike."""
    asked = tuple(
        (alternative.name, alternative.device_class_name, tuple(alternative.selectors))
        for request in requests
        for alternative in request.first_available or [request]
        if not alternative.admin_access  # observes devices: never weighed
    )
    return fleet.derived(("unweighable", asked), functools.partial(_unweighable, asked, fleet))


def _unweighable(
    asked: tuple[tuple[str, str, tuple[str, ...]], ...], fleet: FleetShapes
) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    total = 0
    steps_left = cel.MAX_CLAIM_STEPS
    for name, device_class, selectors in asked:
        where = f'request "{name}"'
        compiled = True
        for selector in selectors:
            try:
                total += cel.compile_selector(selector).cost
            except cel.CELError as exc:
                problems.append((where, exc.brief()))
                compiled = False
        if not compiled:
            continue
        weighed = fleet.weigh(device_class, selectors, budget=steps_left)
        if weighed.problem:
            problems.append((where, weighed.problem))
        steps_left -= weighed.steps
        if steps_left < 0:
            problems.append(("the claim", too_many_steps()))
            return problems
    if total > cel.MAX_CLAIM_ESTIMATED_COST:
        problems.append(
            (
                "the claim",
                f"its selectors are too expensive together: their estimated cost is {total:,}, "
                f"over Tally's limit of {cel.MAX_CLAIM_ESTIMATED_COST:,} for one claim",
            )
        )
    return problems


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
    if _budget_denies(plan, None, budget, fleet=None):
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
    fleet: Callable[[], FleetShapes] | None,
) -> bool:
    """Past a hard budget new claims of devices of its unit are denied; past 80% or a soft
    one, warned. A budget counts hours of one unit, so a claim that can be given no device of
    that unit (a GPU claim against a TPU chip-hour budget) is never weighed against it, nor
    one that only observes devices (admin access); one whose requests were not read (None)
    always is. The fleet is asked only when the budget is nearly spent."""
    assert plan.team is not None
    if requests is not None and all(
        alternative.admin_access
        for request in requests
        for alternative in request.first_available or [request]
    ):
        return False  # whichever alternative it is given, it only observes devices
    use = budget(plan.team)
    if use is None or use.used < NEAR_LIMIT * use.hours:
        return False
    if requests is not None and fleet is not None and not _asks_for(requests, use.unit, fleet()):
        return False
    figures = (
        f'team "{plan.team.slug}" has used {use.used.quantize(Decimal("0.1"))} of its '
        f"{use.hours.normalize():f} {hours_label(use.unit).removesuffix('s')} {use.mode} "
        f"budget for {use.period}"
    )
    if use.used >= use.hours and use.mode == "hard":
        plan.denial, plan.reason = figures, "BudgetExceeded"
        return True
    if use.used >= use.hours:
        plan.warnings.append(figures + " (past the soft budget)")
    else:
        plan.warnings.append(figures)
    return False


def _asks_for(requests: list[dra.ParsedRequest], unit: str, fleet: FleetShapes) -> bool:
    """Whether any of `requests` (any `firstAvailable` alternative) could be given an
    accelerator of `unit` in `fleet`. A request no device of the inventory matches could be
    given anything once the inventory knows more, so it counts as asking for every unit, as
    does one whose selectors cannot be weighed (`unweighable`, which bounds their evaluation)."""
    if unweighable(requests, fleet):
        return True
    for request in requests:
        for alternative in request.first_available or [request]:
            if alternative.admin_access:
                continue
            shapes = fleet.candidates(alternative.device_class_name, tuple(alternative.selectors))
            if not shapes or any(s.unit == unit and s.kind != "other" for s in shapes):
                return True
    return False


def exceeded(plan: Plan, demand: Demand) -> tuple[Rule, Decimal] | None:
    """The first enforce rule this demand would take past its limit, with what the claim asks
    of it (this demand and the claim's requests before it, as the reservation would; of a
    gang's member, beyond what it draws from the gang's hold)."""
    for rule_id, amount in demand.amounts.items():
        rule = plan.rules[rule_id]
        if rule.mode != Mode.ENFORCE:
            continue
        asked = _fresh(plan, rule_id, plan.reserve.get(rule_id, Decimal(0)) + amount)
        if rule.in_use + asked > rule.limit and (asked > 0 or rule_id not in plan.credit):
            return rule, asked
    return None


def _binds(fleet: FleetShapes, rule: Rule, demand: Demand) -> str:
    """Why `rule` weighs a request that could be given devices it does not cover ("any two
    NVIDIA GPUs" on a T4 rule): the models it binds, which the request could be given. ""
    when it covers everything the request could be given (the request asks for its models)."""
    covered = demand.shapes & fleet.covered(rule.device_class, rule.selector)
    if not covered or covered == demand.shapes:
        return ""
    models = sorted({fleet.shapes[shape_id].model or "unnamed devices" for shape_id in covered})
    return (
        f"; the rule binds {', '.join(models)}, which request {demand.name!r} could be given "
        f"(a selector that leaves {'them' if len(models) > 1 else 'it'} out of the request "
        "leaves the rule out too)"
    )


def _fresh(plan: Plan, rule_id: int, amount: Decimal) -> Decimal:
    """What `amount` on a rule adds to its usage: what the gang's hold does not cover."""
    return max(amount - plan.credit.get(rule_id, Decimal(0)), Decimal(0))


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
    shapes, less those that cannot provide its capacity requests and those whose every device
    is in a pool the scheduler allocates nothing from), whatever class the request names. A
    request whose every matching device is in such pools can never be allocated: it counts
    nothing, with a warning naming the pool and what is wrong with it. So does an `All`
    request that no node can give everything it matches (`_never_allocated`). An `ExactCount`
    request for more devices than any node can give now counts as the most its devices could,
    with a warning (`_too_few`): a node that can may join."""
    result = Demand(name=request.name, amounts={}, devices=0)
    if request.admin_access or not rules:
        return result  # admin access observes devices; it holds nothing
    selectors = tuple(request.selectors)
    asked = tuple(sorted(request.capacity_requests.items()))

    def eligible(selectors: tuple[str, ...]) -> list[Shape]:
        """The shapes of the request's class that `selectors` select and that can provide
        its capacity requests, once per fleet snapshot."""
        return fleet.derived(
            ("eligible", request.device_class_name, selectors, asked),
            lambda: _eligible(
                fleet.candidates(request.device_class_name, selectors),
                request.capacity_requests,
            ),
        )

    candidates = eligible(selectors)
    if not candidates and selectors:
        # Its own selectors match no shape. Shapes leave out what identifies one device (its
        # uuid, index, PCI address: `dra.IDENTITY_ATTRIBUTES`), so a selector that reads one
        # cannot be weighed here; it counts as what any device of its class could be given
        # (the most it could take), never as nothing.
        unweighed = eligible(())
        if unweighed:
            candidates = unweighed
            selectors = ()
            warnings.append(
                f'request "{request.name}": no device of class "{request.device_class_name}" '
                "matches its selectors before allocation (a uuid or index is not weighed); "
                "until it is allocated, each device it asks for counts as the most one of its "
                "class could"
            )
    placeable = fleet.placeable(candidates)
    if candidates and not placeable:
        # Devices it matches, each in a pool the scheduler allocates none of: never given.
        shape_ids = {shape.id for shape in candidates}
        result.amounts = {
            rule.pk: Decimal(0)
            for rule in rules
            if shape_ids & fleet.covered(rule.device_class, rule.selector)
        }
        warnings.append(
            _never_placed(request, fleet.invalid.holding(shape.id for shape in candidates))
        )
        return result
    matched, candidates = candidates, placeable
    result.shapes = frozenset(shape.id for shape in candidates)
    per_device_on: dict[int, Decimal] = {}
    keys: dict[int, tuple[Any, ...]] = {}
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
        keys[rule.pk] = key
        if rule.selector:  # validated when written; kept safe if stored otherwise
            error = fleet.derived(
                ("selector error", rule.selector), functools.partial(_selector_error, rule.selector)
            )
            if error:
                warnings.append(
                    f'quota rule "{rule.name}" has a bad selector, applied to its whole class: '
                    f"{error}"
                )
    if not candidates and not fleet.class_drivers(request.device_class_name):
        known = request.device_class_name in fleet.class_selectors
        result.unbound = (
            f'request "{request.name}": no device in the inventory matches class '
            f'"{request.device_class_name}", '
            + ("and its selectors name no driver" if known else "which the inventory does not know")
            + ", so Tally cannot tell which quota rules it would count on"
        )
    if not per_device_on:
        return result
    if not candidates:
        # Nothing to weigh it by: it counts as whole devices on every rule of its class and of
        # its driver, the most it could take, until the sync sees what it was given.
        units = {fleet.unit(r.device_class, r.selector) for r in rules if r.pk in per_device_on}
        whole = units.pop() if len(units) == 1 else "accelerator"
        asking = (
            " with capacity " + ", ".join(f"{name}: {value}" for name, value in asked)
            if asked
            else ""
        )
        drivers = ", ".join(sorted(fleet.class_drivers(request.device_class_name)))
        of_driver = f" and of its driver {drivers}" if drivers else ""
        result.note = (
            f' (request "{request.name}": no device of class "{request.device_class_name}"'
            f"{asking} in the inventory matches it; until allocated, each device it asks for "
            f"counts as a whole {unit_label(whole, plural=False)} (no memory) on every quota "
            f"rule of its class{of_driver})"
        )
        warnings.append(result.note.removeprefix(" (").removesuffix(")"))
    if request.allocation_mode != "All":
        if request.count == 1 or not candidates:
            # One device: the most one of them counts, wherever it is. None known: whole ones.
            result.devices = request.count
            result.amounts = {
                rule_id: each * request.count for rule_id, each in per_device_on.items()
            }
            return result
        exact = fleet.derived(
            ("exact on nodes", request.device_class_name, selectors, asked),
            functools.partial(_exact_on_nodes, fleet, candidates, request.capacity_requests),
        )
        result.devices = request.count
        if request.count > min(exact.most, dra.ALLOCATION_RESULTS_MAX_SIZE):
            # No node can give it that many now. One that can may join (an autoscaler's node)
            # and the claim be allocated there: it counts as the most its devices could count,
            # never nothing, with a warning saying why it waits.
            result.amounts = {
                rule_id: each * request.count for rule_id, each in per_device_on.items()
            }
            warnings.append(_too_few(request, exact, fleet, matched))
            return result
        for rule in rules:
            if rule.pk in per_device_on:
                result.amounts[rule.pk] = fleet.derived(
                    ("exact on rule", *keys[rule.pk], request.count),
                    functools.partial(
                        _most_of_count_on_a_node,
                        rule,
                        request.count,
                        exact,
                        candidates,
                        fleet,
                        request.capacity_requests,
                    ),
                )
        return result
    every = fleet.derived(
        ("all on nodes", request.device_class_name, selectors, asked),
        functools.partial(_all_on_nodes, fleet, candidates),
    )
    result.devices = every.devices
    for rule in rules:
        if rule.pk in per_device_on:
            # Keyed by the rule's definition, as `each` is: what it counts depends on that.
            result.amounts[rule.pk] = fleet.derived(
                ("all on rule", *keys[rule.pk]),
                functools.partial(
                    _most_on_a_node, rule, every, candidates, fleet, request.capacity_requests
                ),
            )
    if not every.nodes and (every.too_many or every.refused):
        warnings.append(_never_allocated(request.name, every, candidates))
    return result


def _never_placed(request: dra.ParsedRequest, pools: list[InvalidPool]) -> str:
    """Why a request whose every matching device is in `pools`, which the scheduler allocates
    nothing from, can never be allocated: the first pool and what its devices consume that it
    does not publish. What matters comes first: the API server keeps 256 characters."""
    mode = " (allocationMode All)" if request.allocation_mode == "All" else ""
    return (
        f'request "{request.name}"{mode} can never be allocated, and counts nothing on quota '
        f"rules: it matches only devices of {_invalid_pools(pools)}"
    )


def _invalid_pools(pools: list[InvalidPool]) -> str:
    """ "pool d/p, which the scheduler allocates nothing from: counter set 'x' is published by
    no slice of generation 1 (consumed by y)": the first of `pools`, and how many more."""
    if not pools:
        return "a pool the scheduler allocates nothing from"
    first = pools[0]
    others = len(pools) - 1
    more = f" (and {others} more such pool{'s' if others > 1 else ''})" if others else ""
    return (
        f"pool {first.driver}/{first.pool}{more}, which the scheduler allocates nothing from: "
        f"{first.problem()}"
    )


def _too_few(
    request: dra.ParsedRequest, exact: ExactOnNodes, fleet: FleetShapes, candidates: list[Shape]
) -> str:
    """Why an `ExactCount` request cannot be allocated: it asks for more devices than the
    scheduler gives one claim (never), or no node can give it that many of the devices it
    matches now (its own and those every node reaches; not those of a pool the scheduler
    allocates nothing from, named when `candidates`, the shapes it matches, have devices in
    one). It counts as the most its devices could. What matters comes first: the API server
    keeps 256 characters."""
    limit = dra.ALLOCATION_RESULTS_MAX_SIZE
    if request.count > limit:
        return (
            f'request "{request.name}" can never be allocated: it asks for {request.count} '
            f"devices, more than the {limit} one claim is given"
        )
    why = (
        f"it asks for {request.count} devices, all given on one node, and no node can give "
        f"more than {exact.most} of those it matches"
    )
    if fleet.invalid.pools:
        pools = fleet.invalid.holding(shape.id for shape in candidates)
        if pools:
            why += f", not counting those of {_invalid_pools(pools)}"
    return (
        f'request "{request.name}" cannot be allocated on any node now (a node that can may '
        f"join), and counts as the most its devices could: {why}"
    )


def _never_allocated(request_name: str, every: AllOnNodes, candidates: list[Shape]) -> str:
    """Why an `All` request can be allocated on no node that has devices it matches: too
    many of them for one claim, more than their shared counter sets hold, or a pool there the
    scheduler allocates nothing from. (The API server keeps 256 characters of a warning.)"""
    unit = unit_label(rule_unit(candidates), plural=False)
    limit = dra.ALLOCATION_RESULTS_MAX_SIZE
    if every.invalid:
        pools = _invalid_pools(list(every.invalid_pools))
        if every.invalid == every.refused and not every.too_many:
            return (
                f'request "{request_name}" (allocationMode All) can never be allocated, and '
                f"counts nothing on quota rules: each node with devices it matches has {pools}"
            )
        # Refused for different reasons: the pool comes first, as the API server keeps 256
        # characters and a pool's name may be a long node name.
        return (
            f'request "{request_name}" (allocationMode All) can never be allocated, counting '
            f"nothing: {pools}. It is on each node with devices it matches where they are not "
            "too many for one claim nor overfill a shared counter set."
        )
    if not every.short_of_counters:
        reason = (
            f"would be given all {every.too_many} devices it matches on a node, more than the "
            f"{limit} the scheduler gives one claim, on every node that has any"
        )
    elif not every.too_many:
        reason = (
            "matches, on each node with any, devices that consume more of a shared counter set "
            f"than it has (a whole {unit} and its partitions)"
        )
    else:
        reason = (
            f"matches, on each node with any, more than {limit} devices (a claim's most) or "
            "devices that consume more of a shared counter set than it has"
        )
    return (
        f'request "{request_name}" (allocationMode All) {reason}: it can never be allocated, '
        "and counts nothing on quota rules"
    )


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


@dataclass(frozen=True)
class AllOnNodes:
    """Where an `allocationMode: All` request can be allocated: the scheduler gives it every
    device it matches on the node (each shareable one a share of what it asks), so a node
    where that is more than a claim can hold (`dra.ALLOCATION_RESULTS_MAX_SIZE`) never can,
    nor one where together they consume more of a shared counter set than it holds (a whole
    GPU and its partitions published together, KEP-4815; see `shapes.counter_shortfall`).
    Devices that consume no counters (a GPU beside its static MIG devices) are all given."""

    # The matching devices by shape id, of each node where they can all be given.
    nodes: tuple[Mapping[int, int], ...]
    # The most matching devices on one of those nodes.
    devices: int
    # The most matching devices on a node where they are too many to be given (0: none is).
    too_many: int
    # The nodes where the matching devices consume more of a counter set than it holds.
    short_of_counters: int = 0
    # The nodes with a pool the scheduler allocates nothing from, and those pools.
    invalid: int = 0
    invalid_pools: tuple[InvalidPool, ...] = ()

    @property
    def refused(self) -> int:
        """The nodes with matching devices where the request cannot be allocated (not those
        where they are too many: counted by how many, in `too_many`)."""
        return self.short_of_counters + self.invalid


def _all_on_nodes(fleet: FleetShapes, candidates: list[Shape]) -> AllOnNodes:
    """Devices published without a node (a pool of `allNodes` or a `nodeSelector`) can be
    reached from a node: they are weighed as on every node, and on a node with none of its
    own (the most such a request could be given). A node with devices of a pool the scheduler
    allocates nothing from (`FleetShapes.invalid`; one published without a node: every node)
    is left out, whatever they are: the scheduler fails an All request there. What the devices
    consume of their counter sets is read (`FleetShapes.counter_shortfall`) only when some
    other node has two matching devices or more."""
    ids = {shape.id for shape in candidates}
    off_node = {shape_id: n for shape_id, n in fleet.off_node.items() if shape_id in ids}
    on_nodes: list[tuple[int | None, dict[int, int]]] = []
    too_many = invalid = 0
    invalid_pools: dict[tuple[str, str], InvalidPool] = {}
    for node_id, shapes in [*fleet.per_node.items(), (None, {})]:
        matching = {shape_id: n for shape_id, n in shapes.items() if shape_id in ids}
        for shape_id, n in off_node.items():
            matching[shape_id] = matching.get(shape_id, 0) + n
        devices = sum(matching.values())
        met = fleet.invalid.on(node_id) if devices and fleet.invalid.pools else []
        if devices > dra.ALLOCATION_RESULTS_MAX_SIZE:
            too_many = max(too_many, devices)
        elif met:
            invalid += 1
            invalid_pools.update(((pool.driver, pool.pool), pool) for pool in met)
        elif devices:
            on_nodes.append((node_id, matching))
    shortfall = (
        fleet.counter_shortfall(frozenset(ids))
        if any(sum(matching.values()) > 1 for _, matching in on_nodes)
        else NO_SHORTFALL
    )
    nodes = [matching for node_id, matching in on_nodes if not shortfall.on(node_id)]
    return AllOnNodes(
        nodes=tuple(nodes),
        devices=max((sum(node.values()) for node in nodes), default=0),
        too_many=too_many,
        short_of_counters=len(on_nodes) - len(nodes),
        invalid=invalid,
        invalid_pools=tuple(invalid_pools[key] for key in sorted(invalid_pools)),
    )


@dataclass(frozen=True)
class ExactOnNodes:
    """Where an `ExactCount` request can be given its devices: all on one node (a claim's
    allocation has one node selector), from the devices it matches there and those published
    without a node, which every node reaches (not those of a pool the scheduler allocates
    nothing from). Nodes that hold the same devices are one entry.

    A shareable device (KEP-5075) is weighed as giving the request as many shares as its
    capacity holds (`_shares_of_one`): the allocators before the one that tries combinations of
    a request's devices rather than permutations (kubernetes#133678) give one request several
    shares of one device, the newer ones one; a quota weighs the most it could take."""

    # The matching devices by shape id that one node reaches, each distinct set once, with how
    # many they are.
    nodes: tuple[tuple[int, Mapping[int, int]], ...]
    # The most matching devices one node reaches.
    most: int


def _exact_on_nodes(
    fleet: FleetShapes, candidates: list[Shape], capacity_requests: dict[str, str]
) -> ExactOnNodes:
    """The sets of matching devices the nodes reach (`ExactOnNodes`), from the distinct sets
    of devices the nodes hold (`FleetShapes.placeable_by_node`), never from the nodes one by
    one: a fleet of thousands of nodes holds a few dozen sets."""
    ids = {shape.id for shape in candidates}
    shares = {
        shape.id: _shares_of_one(shape, capacity_requests)
        for shape in candidates
        if shape.shareable
    }
    on_nodes, off_node = fleet.placeable_by_node()
    everywhere = {shape_id: n for shape_id, n in off_node.items() if shape_id in ids}
    distinct: dict[frozenset[tuple[int, int]], Mapping[int, int]] = {}
    for shapes in (*on_nodes, {}):  # {}: a node with none of its own
        matching = dict(everywhere)
        for shape_id, n in shapes.items():
            if shape_id in ids:
                matching[shape_id] = matching.get(shape_id, 0) + n
        for shape_id in shares.keys() & matching.keys():
            matching[shape_id] = min(matching[shape_id] * shares[shape_id], dra.MAX_REQUEST_COUNT)
        if matching:
            distinct.setdefault(frozenset(matching.items()), matching)
    nodes = tuple((sum(matching.values()), matching) for matching in distinct.values())
    return ExactOnNodes(nodes=nodes, most=max((devices for devices, _ in nodes), default=0))


def _shares_of_one(shape: Shape, capacity_requests: dict[str, str]) -> int:
    """How many shares a request asking `capacity_requests` could take of one shareable device
    of `shape`: as many as the largest fraction of a capacity it consumes fits in the device
    (one, when it consumes the whole device, as a request that names no capacity of a device
    without a policy does); any number when that cannot be read, the most it could take."""
    consumed = _consumes(shape, capacity_requests)
    if consumed is None:
        return 1  # it cannot be given one (left out before)
    try:
        fraction = capacity.consumed_fraction(shape.capacity, consumed, shape.driver)
    except capacity.CapacityError:
        return dra.MAX_REQUEST_COUNT
    return min(int(1 / fraction), dra.MAX_REQUEST_COUNT) if fraction > 0 else dra.MAX_REQUEST_COUNT


def _most_of_count_on_a_node(
    rule: Rule,
    count: int,
    exact: ExactOnNodes,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> Decimal:
    """What an `ExactCount` request of `count` devices counts on `rule`: on each node that
    reaches that many matching devices, the sum of the `count` of them that count most on the
    rule (each by its own shape; one the rule does not cover counts nothing, and an
    integrated GPU nothing on a rule of accelerators); the most over those nodes. A node with
    one discrete GPU and one integrated GPU gives two devices that count one GPU, not two."""
    each = _per_shape_on(rule, candidates, fleet, capacity_requests)
    most = Decimal(0)
    for devices, node in exact.nodes:
        if devices < count:
            continue
        left, total = count, Decimal(0)
        for amount, n in sorted(
            ((each[shape_id], n) for shape_id, n in node.items() if shape_id in each),
            reverse=True,
        ):
            taken = min(n, left)
            total += amount * taken
            left -= taken
            if not left:
                break
        most = max(most, total)
    return most


def _most_on_a_node(
    rule: Rule,
    every: AllOnNodes,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> Decimal:
    """What an `All` request counts on `rule`: on each node where it can be allocated, the sum
    of what each matching device there counts on the rule (by its own shape: a 40GB and an
    80GB GPU, a GPU and MIG devices, count each what they are); the most over those nodes,
    which need not be the node with the most devices. A rule that covers some of the shapes
    counts only those. A node where they consume more of a shared counter set than it holds
    is not among them (`AllOnNodes`)."""
    each = _per_shape_on(rule, candidates, fleet, capacity_requests)
    return max(
        (
            sum(
                (each[shape_id] * n for shape_id, n in node.items() if shape_id in each),
                Decimal(0),
            )
            for node in every.nodes
        ),
        default=Decimal(0),
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
    matches is limited, as whole devices, by the rules of the class it names, by those of its
    class's driver (`FleetShapes.class_drivers`): the devices that match it when they appear (a
    MIG profile configured later, GPUs bound to vfio) are that driver's, and by those whose
    class names no driver, which may cover them too."""
    if not candidates:
        # A rule whose class names no driver ("any accelerator") may cover its devices too.
        drivers = fleet.class_drivers(request_class)
        if (
            rule.device_class != request_class
            and fleet.class_drivers(rule.device_class)
            and not drivers & fleet.rule_drivers(rule.device_class, rule.selector)
        ):
            return None
        return Decimal(1) if rule.unit == Unit.GPUS else Decimal(0)
    each = _per_shape_on(rule, candidates, fleet, capacity_requests)
    return max(each.values()) if each else None


def _per_shape_on(
    rule: Rule,
    candidates: list[Shape],
    fleet: FleetShapes,
    capacity_requests: dict[str, str],
) -> dict[int, Decimal]:
    """What one device of each of `candidates` that `rule` covers counts on it, by shape id: a
    share of a shareable device what the request consumes of it."""
    covered = fleet.covered(rule.device_class, rule.selector)
    accelerators = fleet.covers_accelerators(rule.device_class, rule.selector)
    return {
        shape.id: per_device(
            shape,
            rule,
            _consumes(shape, capacity_requests) if shape.shareable else None,
            of_accelerators=accelerators,
        )
        for shape in candidates
        if shape.id in covered
    }


def _selector_error(selector: str) -> str:
    try:
        cel.compile_selector(selector)
    except cel.CELError as exc:
        return str(exc)
    return ""


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
        "gang_key": plan.gang.gang.key if plan.gang is not None else "",
        "spec_digest": spec_digest(claim),
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


# --- Gangs ------------------------------------------------------------------------------------
#
# A gang's pods must run together (`inventory.gangs`). Admitted one claim at a time, half a
# gang can hold devices while the other half waits for room that never comes. Under a team's
# `gangs: enforce` the first member's admission weighs the whole gang: admitted only if all of
# it fits every enforce rule, it reserves the member's own share and holds the rest for the
# members to come (a `GangReservation`), which each draw their share from the hold.


@dataclass(frozen=True)
class GangState:
    """What an admission read of its claim's gang (`store.gang_state`): its live hold (the
    id, and what it holds by rule) and what the gang's members admitted already hold, by
    rule."""

    hold_id: int | None
    held: dict[int, Decimal]
    members: dict[int, Decimal]


@dataclass(frozen=True)
class Adopted:
    """Members of a gang admitted alone, before their gang could be read (not yet readable,
    the reader failing, the team's gangs off then): live reservations of the namespace with no
    gang whose claim's Pod is in the gang. Their ids, and what they hold by rule."""

    ids: tuple[int, ...] = ()
    amounts: dict[int, Decimal] = field(default_factory=dict)


@dataclass
class GangPlan:
    """How a gang member is admitted: drawing from its gang's hold (`hold_id`), changing each
    rule's usage by `counted` (none: it draws its whole share) and the hold by `counted` less
    its own share; or, the first member of a gang admitted whole, adding `counted` to each rule
    (the whole gang's demand) of which `hold` is held for the members to come; or (neither) as
    a claim alone, only recording its gang. `whole`: the rest of the gang was weighed with
    the member (its denial names the gang; a top-up is planned again if the hold's lines
    changed from `held`, as read). `adopted`: members admitted alone that this admission
    records as the gang's (`Adopted`)."""

    gang: GangRef
    hold_id: int | None = None
    counted: dict[int, Decimal] = field(default_factory=dict)
    hold: dict[int, Decimal] = field(default_factory=dict)
    whole: bool = False
    adopted: tuple[int, ...] = ()
    held: dict[int, Decimal] = field(default_factory=dict)


def gang_demand(
    *,
    gang: GangRef,
    own: Mapping[int, Decimal],
    templates: Mapping[str, Mapping[int, Decimal] | None],
) -> dict[int, Decimal]:
    """What the whole gang can take on each rule: for each role whose claim templates are
    known, each template's demand (`templates`, by name; None: it could not be read) times
    the role's pods; when no role's templates are known, or one could not be read, this
    claim's own demand (`own`) times the gang's size."""
    roles = [role for role in gang.roles if role.claim_templates]
    if not roles or any(templates.get(name) is None for r in roles for name in r.claim_templates):
        return {rule_id: amount * gang.size for rule_id, amount in own.items()}
    total: dict[int, Decimal] = {}
    for role in roles:
        for name in role.claim_templates:
            for rule_id, amount in (templates[name] or {}).items():
                total[rule_id] = total.get(rule_id, Decimal(0)) + amount * role.pods
    return total


def weigh_gang(
    plan: Plan,
    *,
    gang: GangRef,
    mode: str,
    state: GangState,
    whole: Callable[[], dict[int, Decimal]],
    adopted: Callable[[], Adopted],
) -> None:
    """Weigh the claim of `plan` as a member of `gang`, under the team's gang `mode`.

    A member whose share the gang's live hold covers draws it (its `credit` was weighed
    already). Otherwise (no hold, or the gang grew past what its hold keeps) the rest of the
    gang is weighed as the first member's admission weighs it: the whole gang's demand
    (`whole()`), less what its members admitted already hold (those admitted alone before the
    gang could be read included: `adopted()`) and what its hold keeps, and at least the
    claim's own share beyond the hold, against every rule. Under `enforce` the claim is
    denied, naming the gang, its size and the rule, when that does not fit an enforce rule;
    otherwise admitting it holds (or tops the hold up to) what the members to come need. Under
    `warn` it is decided alone, with a warning when the gang could not fit whole; `off`
    ignores gangs. A claim denied for another reason than quota (unreadable, past its budget)
    stays so.
    """
    if plan.team is None or mode == GangMode.OFF:
        return
    if plan.denial and plan.reason != "QuotaExceeded":
        return
    held = state.held if state.hold_id is not None else {}
    plan.gang = GangPlan(gang=gang, hold_id=state.hold_id, held=dict(held))
    own = plan.reserve
    if state.hold_id is not None and all(
        amount <= held.get(rule_id, Decimal(0)) for rule_id, amount in own.items()
    ):
        return
    demand = whole()
    found = adopted()
    plan.gang.adopted = found.ids
    rule_ids = sorted((set(demand) | set(own) | set(held)) & set(plan.rules))
    # What the members still to come need once this one is admitted, and what admitting it
    # changes on each rule: its own share and that, less what the hold keeps already.
    rest = {
        rule_id: max(
            demand.get(rule_id, Decimal(0))
            - state.members.get(rule_id, Decimal(0))
            - found.amounts.get(rule_id, Decimal(0))
            - own.get(rule_id, Decimal(0)),
            Decimal(0),
        )
        for rule_id in rule_ids
    }
    counted = {
        rule_id: own.get(rule_id, Decimal(0)) + rest[rule_id] - held.get(rule_id, Decimal(0))
        for rule_id in rule_ids
    }
    over = None
    for rule_id, amount in counted.items():
        rule = plan.rules[rule_id]
        if rule.in_use + amount <= rule.limit or (state.hold_id is not None and amount <= 0):
            continue
        if rule.mode == Mode.ENFORCE:
            over = over or rule
        else:
            plan.warnings.append(gang_over_limit(plan, rule, amount) + " (warn only)")
    if over is not None:
        message = gang_over_limit(plan, over, counted[over.pk])
        if mode == GangMode.ENFORCE:
            plan.denial = message + "; the gang is denied whole, nothing reserved"
            plan.reason, plan.rule = "QuotaExceeded", over.name
            return
        plan.warnings.append(message + " (gangs: warn; the claim is decided alone)")
    if mode == GangMode.WARN:
        if state.hold_id is not None:
            # Decided alone (a hold kept from when the team enforced gangs): it draws what the
            # hold has of its share, and the rest is counted as a claim alone's.
            plan.gang.counted = {
                rule_id: max(amount - held.get(rule_id, Decimal(0)), Decimal(0))
                for rule_id, amount in own.items()
            }
        return
    if plan.denial:
        return
    if state.hold_id is not None:
        plan.gang.counted, plan.gang.whole = counted, True  # the hold made `rest`
    elif any(rest.values()):
        plan.gang.counted, plan.gang.hold, plan.gang.whole = counted, rest, True


def gang_over_limit(plan: Plan, rule: Rule, needs: Decimal) -> str:
    """Why the whole gang of `plan` does not fit `rule`: the gang (key and size), what it
    needs, the rule, and the team's usage and limit on it."""
    assert plan.team is not None and plan.gang is not None
    gang, unit = plan.gang.gang, plan.units.get(rule.pk)
    pods = f"{gang.size} pod{'' if gang.size == 1 else 's'}"
    return (
        f"gang {gang.key} ({pods}) needs {_fmt(needs, rule, unit)} of class "
        f'{rule.device_class}; team "{plan.team.slug}" uses {_fmt(rule.in_use, rule, unit)} '
        f'of {_fmt(rule.limit, rule, unit)} on quota rule "{rule.name}" ({rule.mode})'
    )


def gang_over_quota(plan: Plan, rule: Rule) -> Decision:
    """The denial of the first member of a gang whose whole demand a rule's usage, as the
    reservation found it, no longer allows."""
    assert plan.team is not None and plan.gang is not None
    needs = plan.gang.counted.get(rule.pk, Decimal(0))
    return Decision(
        allowed=False,
        message=gang_over_limit(plan, rule, needs) + "; the gang is denied whole, nothing reserved",
        reason="QuotaExceeded",
        warnings=plan.warnings,
        team=plan.team,
        rule=rule.name,
    )


def gang_changed(plan: Plan) -> Decision:
    """The denial of a gang's member whose gang's hold kept changing during its admission
    (made by another member, released), so that it could not be planned on it."""
    assert plan.team is not None and plan.gang is not None
    message = (
        f'team "{plan.team.slug}": the reservation of gang {plan.gang.gang.key} changed during '
        "this admission; create the claim again"
    )
    return Decision(allowed=False, message=message, reason="Conflict", team=plan.team)
