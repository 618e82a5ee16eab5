"""A quota rule is saved through `save_rule` here, whoever saves it: the policy file
(`quota.policy.apply_policy`), the Django admin (`quota.admin`, the rule's page and the team's
table) and any API that comes to write rules. One place checks it, normalises it, writes and
audits it, and keeps the ledger true after it.

A budget has its one service too (`quota.services.set_budget`), which the policy file and the
admin both call.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from quota.cel import CELError, compile_selector
from quota.models import Mode, QuotaRule, Unit
from quota.services import lock_usage, recount_usage
from teams import audit
from teams.models import AuditEntry, Team


class RuleError(ValueError):
    """A rule that cannot be saved as asked: `field` names what is wrong (a field of
    `RuleValues`), `args[0]` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RuleValues:
    """What a rule is: its name, the device class and CEL selector it limits, its unit, its
    limit in that unit (GPU-equivalents or bytes) and whether it denies or warns past it."""

    name: str
    device_class: str
    selector: str
    unit: str
    limit: Decimal
    mode: str

    def normalised(self) -> RuleValues:
        """As stored: the selector without surrounding blanks (an empty one limits every
        device of the class)."""
        return RuleValues(
            name=self.name,
            device_class=self.device_class,
            selector=self.selector.strip(),
            unit=self.unit,
            limit=self.limit,
            mode=self.mode,
        )


def selector_error(selector: str) -> str | None:
    """Why a rule's CEL selector cannot be used (None: it compiles, or is empty)."""
    if not selector.strip():
        return None
    try:
        compile_selector(selector)
    except CELError as exc:
        return f"bad CEL: {exc}"
    return None


def unit_change_error(*, stored: QuotaRule | None, unit: str) -> str | None:
    """Why the stored rule may not take `unit` (None: it may): its usage, counted in its unit
    now, would read as the other's."""
    if stored is None or stored.pk is None or stored.unit == unit or stored.in_use <= 0:
        return None
    return (
        f"cannot change the unit of rule {stored.name!r} from {stored.unit} to {unit} "
        f"while {stored.in_use} is in use"
    )


def rule_errors(*, values: RuleValues, stored: QuotaRule | None) -> list[RuleError]:
    """Every reason `values` cannot be saved over `stored` (None: a new rule)."""
    errors = []
    if (error := selector_error(values.selector)) is not None:
        errors.append(RuleError("selector", error))
    if values.unit not in Unit.values:
        errors.append(RuleError("unit", f"must be one of {', '.join(Unit.values)}"))
    if values.mode not in Mode.values:
        errors.append(RuleError("mode", f"must be one of {', '.join(Mode.values)}"))
    if values.limit < 0:
        errors.append(RuleError("limit", f"must not be negative, got {values.limit}"))
    if (error := unit_change_error(stored=stored, unit=values.unit)) is not None:
        errors.append(RuleError("unit", error))
    return errors


@dataclass(frozen=True)
class SavedRule:
    """A rule as `save_rule` left it, and its audit entry (None: nothing changed)."""

    rule: QuotaRule
    entry: AuditEntry | None

    @property
    def changed(self) -> bool:
        return self.entry is not None


def save_rule(
    *,
    team: Team,
    stored: QuotaRule | None,
    values: RuleValues,
    actor: str,
    recount: bool = True,
) -> SavedRule:
    """Make `team`'s rule `stored` (None: a new rule) `values`, normalised.

    Guarantees, in one transaction: the usage lock and the team's rules are taken first
    (`lock_usage`; free when the caller holds them, as it must when it read `stored`); the
    rule is checked (`rule_errors`; the first raised as `RuleError`, nothing written); only
    what differs is written, never `in_use` (the ledger's, `quota.ledger`), with an audit
    entry naming `actor`; and, with `recount`, the team's usage is recounted from the ledger
    (`recount_usage`: what the rule counts may have changed; a drift found is mended too).
    Without it the caller recounts the team in the same transaction (`apply_policy` recounts
    every team it changed once, after its namespaces moved).
    """
    values = values.normalised()
    with transaction.atomic():
        lock_usage(team_ids=[team.pk])
        errors = rule_errors(values=values, stored=stored)
        if errors:
            raise errors[0]
        fields = {
            "device_class": values.device_class,
            "selector": values.selector,
            "unit": values.unit,
            "limit": values.limit,
            "mode": values.mode,
        }
        if stored is None:
            rule = QuotaRule(team=team, name=values.name, **fields)
            entry: AuditEntry | None = audit.create(actor=actor, obj=rule)
        else:
            rule = stored
            before = audit.snapshot(rule)
            for name, value in {"name": values.name, **fields}.items():
                setattr(rule, name, value)
            entry = audit.update(actor=actor, obj=rule, before=before)
        if recount:
            recount_usage(teams=[team.pk], at=timezone.now())
    return SavedRule(rule=rule, entry=entry)
