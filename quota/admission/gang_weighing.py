"""Gangs at admission.

A gang's pods must run together (`inventory.gangs`). Admitted one claim at a time, half a
gang can hold devices while the other half waits for room that never comes. Under a team's
`gangs: enforce` the first member's admission weighs the whole gang: admitted only if all of
it fits every enforce rule, it reserves the member's own share and holds the rest for the
members to come (a `GangReservation`), which each draw their share from the hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal

from inventory.gangs import GangRef
from quota.admission.decision import rule_note
from quota.admission.plans import (
    Adopted,
    Decision,
    GangPlan,
    GangState,
    Plan,
    Rule,
    amount_text,
)
from quota.models import GangMode, Mode


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
            plan.warnings.append(
                gang_over_limit(plan, rule, amount) + rule_note(plan, rule) + " (warn only)"
            )
    if over is not None:
        message = gang_over_limit(plan, over, counted[over.pk])
        if mode == GangMode.ENFORCE:
            plan.denial = (
                message + rule_note(plan, over) + "; the gang is denied whole, nothing reserved"
            )
            plan.reason, plan.rule = "QuotaExceeded", over.name
            return
        plan.warnings.append(
            message + rule_note(plan, over) + " (gangs: warn; the claim is decided alone)"
        )
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
        f"gang {gang.key} ({pods}) needs {amount_text(needs, rule, unit)} of class "
        f'{rule.device_class}; team "{plan.team.slug}" uses {amount_text(rule.in_use, rule, unit)} '
        f'of {amount_text(rule.limit, rule, unit)} on quota rule "{rule.name}" ({rule.mode})'
    )


def gang_over_quota(plan: Plan, rule: Rule) -> Decision:
    """The denial of the first member of a gang whose whole demand a rule's usage, as the
    reservation found it, no longer allows."""
    assert plan.team is not None and plan.gang is not None
    needs = plan.gang.counted.get(rule.pk, Decimal(0))
    return Decision(
        allowed=False,
        message=gang_over_limit(plan, rule, needs)
        + rule_note(plan, rule)
        + "; the gang is denied whole, nothing reserved",
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
