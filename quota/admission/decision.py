"""What an admission decides, from what it read: no database, no connection.

`plan_claim` weighs a claim against its team's rules (as `store.admission_state` read them,
usage as of that moment), its budget and the fleet's shapes: what each request can take on
each rule, which `firstAvailable` alternatives fit, and the denial or warnings. The store then
reserves the plan (or does not); everything here is plain Python on plain data.

`quota.admission.demand` counts what each request can take; `quota.admission.plans` holds the
data all of them share; `quota.admission.gang_weighing` weighs a gang whole.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings

from inventory import dra
from inventory.profiles import hours_label
from quota import cel
from quota.admission.demand import demand
from quota.admission.plans import (
    CLAIM_API_VERSIONS,
    CLAIM_VERSIONS,
    CONTROLLER_USERS,
    NARROWED_ANNOTATION,
    NEAR_LIMIT,
    AdmissionState,
    BudgetUse,
    Decision,
    Demand,
    Narrowing,
    Plan,
    Rule,
    RuleSnapshot,
    amount_text,
    claim_name,
    spec_digest,
)
from quota.admission.shapes import FleetShapes, fit_selector, too_many_steps
from quota.models import Mode, ReservationState
from teams.models import Team


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
    takes; and, where the team narrows to fit (`AdmissionState.narrow_to_fit`), a request that
    does not fit but could be given devices of several models is narrowed to the models whose
    rules have room (`_narrow_to_fit`), a selector added: a `firstAvailable` request keeps the
    first alternative, in order, that fits as sent or once narrowed. Without (the validating
    webhook, which sees the claim as the scheduler will, and keeps for its reservation what
    its annotation says was narrowed: `narrowed_in`) every alternative left must fit, and it
    holds on each rule the most any one alternative takes there: whichever the scheduler picks
    takes no more on any rule, so this never under-counts and `reserved + allocated <= limit`
    holds for every enforce rule. Not every alternative at once: a GPU-or-Gaudi request holds
    one of each, not two of either.

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
    if not narrow:
        plan.warnings.extend(_narrowed_before(claim))
        if state.narrow_to_fit:
            plan.narrowed_sent = narrowed_in(claim, requests)
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
    plan.fleet = shapes
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
        if narrow and state.narrow_to_fit and (request.first_available or not fitting):
            # The team narrows to fit: the alternatives in order (a plain request is its own
            # one), the first that fits as sent kept as without the option, else the first
            # that fits once narrowed to the models with room, a selector added to it. Those
            # before it fit on no model: removed with the others (`plan.removed`), as the
            # scheduler would pass over them only to be denied devices the quota lacks room for.
            for alternative, weighed in zip(alternatives, demands, strict=True):
                if any(d is weighed for d in fitting):
                    break
                key = f"{request.name}/{alternative.name}" if request.first_available else ""
                narrowed = _narrow_to_fit(
                    plan, alternative, weighed, rules, shapes, key=key or request.name
                )
                if narrowed is not None:
                    demands = [narrowed if d is weighed else d for d in demands]
                    fitting = [narrowed]
                    break
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
            # What a gang's denial by the same rule says of it (`rule_note`).
            plan.demands.append(demands[0])
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
            plan.demands.append(unfit)
            return plan
        if request.first_available:
            plan.chosen[request.name] = [d.name for d in kept]
            # By name, as the patch removes them (a name given twice, which the API server
            # refuses after this webhook, is kept whole).
            skipped = [d.name for d in demands if d.name not in plan.chosen[request.name]]
            if skipped:
                plan.removed[request.name] = skipped
        _add_most(plan.reserve, kept)
        plan.demands.extend(kept)
    for rule_id, amount in plan.reserve.items():
        rule = plan.rules[rule_id]
        total = rule.in_use + _fresh(plan, rule_id, amount)
        unit = plan.units.get(rule_id)
        if rule.mode == Mode.WARN and total > rule.limit:
            plan.warnings.append(over_limit(plan.team, rule, amount, unit) + " (warn only)")
        elif rule.limit and total >= NEAR_LIMIT * rule.limit:
            plan.warnings.append(
                f'team "{plan.team.slug}": quota rule "{rule.name}" is at '
                f"{amount_text(total, rule, unit)} of {amount_text(rule.limit, rule, unit)} "
                "with this claim"
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
    return next(_exceeding(plan, demand), None)


def _exceeding(plan: Plan, demand: Demand) -> Iterator[tuple[Rule, Decimal]]:
    """Each enforce rule this demand would take past its limit (`exceeded`), in its order."""
    for rule_id, amount in demand.amounts.items():
        rule = plan.rules[rule_id]
        if rule.mode != Mode.ENFORCE:
            continue
        asked = _fresh(plan, rule_id, plan.reserve.get(rule_id, Decimal(0)) + amount)
        if rule.in_use + asked > rule.limit and (asked > 0 or rule_id not in plan.credit):
            yield rule, asked


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


def _narrow_to_fit(
    plan: Plan,
    request: dra.ParsedRequest,
    unfit: Demand,
    rules: Sequence[Rule],
    fleet: FleetShapes,
    *,
    key: str,
) -> Demand | None:
    """What `request` (a plain request, or one alternative of a `firstAvailable` request:
    `key` names it, "request" or "request/alternative") takes once narrowed to the models of
    its candidate devices whose rules have room (the team's `narrowToFit`): "any two NVIDIA
    GPUs", which a full T4 rule denies, narrowed to the free H100s. Recorded in
    `plan.narrowed[key]` (the selector the mutating webhook adds, the models it keeps), with a
    warning; None where it cannot be narrowed: its devices are of one model, or some publish
    no model a selector can name (as a string, under one attribute per driver: a selector
    reading an attribute a device lacks fails its allocation), or no model fits. Candidates
    of several drivers, each publishing its model under its own attribute, get a selector with
    one clause per driver (`shapes.fit_selector`). Models are taken in order of name, each kept
    if the request, narrowed to it and those kept before, still fits: the selector keeps every
    model that can be given."""
    candidates = [fleet.shapes[shape_id] for shape_id in unfit.shapes]
    attributes: dict[str, str] = {}
    for shape in candidates:
        if not shape.model or not shape.model_attribute:
            return None
        if attributes.setdefault(shape.driver, shape.model_attribute) != shape.model_attribute:
            return None  # one driver's devices publish their model under different names
    choices = sorted({(shape.model, shape.driver) for shape in candidates})
    if len({model for model, _ in choices}) < 2:
        return None
    by_driver = len(set(attributes.values())) > 1
    full = sorted({rule.name for rule, _ in _exceeding(plan, unfit)})
    kept: list[tuple[str, str]] = []
    best: tuple[Demand, list[str], str] | None = None
    for choice in choices:
        selector = fit_selector([*kept, choice], attributes, by_driver=by_driver)
        warnings: list[str] = []
        narrowed = dataclasses.replace(request, selectors=[*request.selectors, selector])
        candidate = demand(narrowed, rules, fleet, warnings)
        if candidate.shapes and exceeded(plan, candidate) is None:
            kept.append(choice)
            best = candidate, warnings, selector
    if best is None:
        return None
    narrowed_demand, warnings, selector = best
    models = tuple(dict.fromkeys(model for model, _ in kept))
    plan.narrowed[key] = Narrowing(selector=selector, models=models, rules=tuple(full))
    plan.warnings.extend(warnings)
    plan.warnings.append(narrowing_warning(key, plan.narrowed[key]))
    return narrowed_demand


def narrowing_warning(key: str, narrowing: Narrowing) -> str:
    """What the mutating webhook says of a request it narrowed (`key`: "request", or
    "request/alternative"): the models kept and the rules that had no room for it as sent
    (none named: a create sent again, narrowed as its first admission was)."""
    kept = ", ".join(narrowing.models)
    if not narrowing.rules:
        return (
            f"request {key!r} narrowed to {kept} (a selector added; the team narrows to fit), "
            "as when this claim was first admitted: a create sent again"
        )
    full = narrowing.rules
    return (
        f"request {key!r} narrowed to {kept} (a selector added; the team narrows to fit): as "
        f"sent it could be given devices that quota rule{'s' if len(full) > 1 else ''} "
        f"{', '.join(full)} ha{'ve' if len(full) > 1 else 's'} no room for"
    )


def _narrowed_annotation(claim: dict[str, Any]) -> str | None:
    """The claim's `NARROWED_ANNOTATION`, as the mutating webhook's patch wrote it (None: no
    such annotation, or not a string)."""
    metadata = claim.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    value = annotations.get(NARROWED_ANNOTATION) if isinstance(annotations, dict) else None
    return value if isinstance(value, str) else None


def _narrowed_before(claim: dict[str, Any]) -> list[str]:
    """What the mutating webhook narrowed in `claim`, as its annotation says (the validating
    webhook records it with its decision); the annotation is the claim's, its selectors are
    weighed as any others."""
    value = _narrowed_annotation(claim)
    if not value:
        return []
    return [f"the claim was narrowed to the models that fit ({NARROWED_ANNOTATION}: {value})"]


def narrowed_in(claim: dict[str, Any], requests: list[dra.ParsedRequest]) -> dict[str, Any]:
    """What the mutating webhook narrowed in `claim`, as the claim's reservation keeps it
    (`Reservation.narrowed`), so that a create sent again, unpatched, is narrowed alike: by
    request ("request", or "request/alternative"), the models its annotation names and the
    selector its patch added (the request's last: the patch adds it after the others). Only
    a request the annotation names, with models and a selector."""
    value = _narrowed_annotation(claim)
    try:
        named = json.loads(value) if value is not None else None
    except ValueError:
        return {}
    if not isinstance(named, dict):
        return {}
    found: dict[str, Any] = {}
    for request in requests:
        holders = [(request.name, request)] + [
            (f"{request.name}/{alternative.name}", alternative)
            for alternative in request.first_available
        ]
        for key, holder in holders:
            models = named.get(key)
            if (
                holder.selectors
                and isinstance(models, list)
                and models
                and all(isinstance(model, str) for model in models)
            ):
                found[key] = {"selector": holder.selectors[-1], "models": models}
    return found


def narrowed_again(kept: Any) -> dict[str, Narrowing]:
    """The narrowings a reservation kept (`Reservation.narrowed`, as `narrowed_in` stored
    them), to narrow a create sent again alike; what is not as stored is left out."""
    if not isinstance(kept, dict):
        return {}
    again = {}
    for key, entry in kept.items():
        selector = entry.get("selector") if isinstance(entry, dict) else None
        models = entry.get("models") if isinstance(entry, dict) else None
        if isinstance(selector, str) and isinstance(models, list):
            again[key] = Narrowing(
                selector=selector, models=tuple(str(model) for model in models), rules=()
            )
    return again


def _fresh(plan: Plan, rule_id: int, amount: Decimal) -> Decimal:
    """What `amount` on a rule adds to its usage: what the gang's hold does not cover."""
    return max(amount - plan.credit.get(rule_id, Decimal(0)), Decimal(0))


def over_limit(team: Team, rule: Rule, asked: Decimal, unit: str | None = None) -> str:
    """The denial naming the team, the rule, what is in use, what was asked and the limit, in
    `unit` (what the rule's devices count; None: GPUs)."""
    return (
        f'team "{team.slug}": quota rule "{rule.name}" ({rule.mode}) would be exceeded: '
        f"{amount_text(rule.in_use, rule, unit)} in use, "
        f"{amount_text(asked, rule, unit)} requested, "
        f"limit {amount_text(rule.limit, rule, unit)}"
    )


def over_quota(plan: Plan, rule: Rule, asked: Decimal) -> Decision:
    """The denial of a planned claim that a rule's usage, as the reservation found it, no
    longer allows: with the note the first weighing's denial would have carried (why the
    request counts what it does, the models the rule binds that it could be given)."""
    assert plan.team is not None
    return Decision(
        allowed=False,
        message=over_limit(plan.team, rule, asked, plan.units.get(rule.pk)) + rule_note(plan, rule),
        reason="QuotaExceeded",
        warnings=plan.warnings,
        team=plan.team,
        rule=rule.name,
    )


def rule_note(plan: Plan, rule: Rule) -> str:
    """What a denial by `rule` says of the first of the plan's requests that takes something
    on it, as `plan_claim`'s own denial does (why it counts what it does, the models the rule
    binds that it could be given): said too by a denial at reservation and a gang's; "" when
    none does."""
    for weighed in plan.demands:
        if weighed.amounts.get(rule.pk):
            binds = _binds(plan.fleet, rule, weighed) if plan.fleet is not None else ""
            return weighed.note + binds
    return ""


def rules_changed(team: Team) -> Decision:
    """The denial of a claim whose team's rules changed while it was being admitted."""
    message = f'team "{team.slug}": its quota rules changed during this admission'
    return Decision(
        allowed=False, message=message + "; create the claim again", reason="Conflict", team=team
    )


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
        "narrowed": plan.narrowed_sent,
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
