"""The policy file as read: what `quota.policy.loading.load_policy` makes of it (`Policy`, a
spec per team, rule, budget, rate card and SSO group line, each with its path in the file) and
what `quota.policy.applying.apply_policy` reports back (`ApplyReport`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal
from typing import Any

from inventory.models import Unit as DeviceUnit
from inventory.version_policy import (
    VersionPolicy,
)
from quota.models import (
    Mode,
    Unit,
)
from teams.models import (
    AuditEntry,
    Role,
    SsoRole,
)

# A rate card's identity: product name, profile, currency, first day.
RateKey = tuple[str, str, str, date]


class PolicyError(Exception):
    """The policy cannot be applied; `errors` says why, each prefixed by its path in the file."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors))


@dataclass(frozen=True)
class RuleSpec:
    """One quota rule as declared; `limit` is in the rule's unit (GPU-equivalents or bytes)."""

    path: str
    name: str
    device_class: str
    selector: str
    unit: Unit
    limit: Decimal
    mode: Mode


@dataclass(frozen=True)
class BudgetSpec:
    """A team's budget per period as declared: `gpu_hours` hours of `unit` (GPU-hours unless
    the file says `unit: tpu`, `gaudi` or `accelerator`)."""

    path: str
    gpu_hours: Decimal
    mode: str
    unit: str = DeviceUnit.GPU


@dataclass(frozen=True)
class IdleAlertSpec:
    """When a team's claims are alerted as idle: utilised below `below_percent` of what they
    hold in each of the last `for_hours` hours (`teams.models.IdleAlertPolicy`)."""

    path: str
    below_percent: Decimal
    for_hours: int
    # False: `idleAlert: off` (the percent and hours are then the defaults, kept for the pages).
    enabled: bool = True


@dataclass(frozen=True)
class RateSpec:
    """One rate card as declared: a price per GPU-hour over `[valid_from, valid_until)`."""

    path: str
    product_name: str
    profile: str
    currency: str
    valid_from: date
    valid_until: date | None
    per_gpu_hour: Decimal
    idle_factor: Decimal

    @property
    def key(self) -> RateKey:
        return (self.product_name, self.profile, self.currency, self.valid_from)

    def validity(self) -> str:
        until = f" until {self.valid_until}" if self.valid_until else " on"
        return f"from {self.valid_from}{until}"


@dataclass(frozen=True)
class TeamSpec:
    """One team as declared."""

    path: str
    slug: str
    name: str
    cost_centre: str
    namespaces: tuple[str, ...]
    leads: tuple[str, ...]
    members: tuple[str, ...]
    rules: tuple[RuleSpec, ...]
    budget: BudgetSpec | None = None
    # How the team's gangs are admitted (`GangMode`); None: not declared.
    gangs: str | None = None
    # Whether the mutating webhook narrows claims to the models that fit (`NarrowingPolicy`);
    # None: not declared.
    narrow_to_fit: bool | None = None
    idle_alert: IdleAlertSpec | None = None

    def roles(self) -> dict[str, Role]:
        return {
            **{username: Role.MEMBER for username in self.members},
            **{username: Role.LEAD for username in self.leads},
        }


@dataclass(frozen=True)
class SsoGroupSpec:
    """One line of `sso.groups`: the identity provider's `group` makes its members `role`
    (in the team `team`, for lead and member)."""

    group: str
    role: SsoRole
    team: str | None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.role, self.team or "")


@dataclass(frozen=True)
class Policy:
    """A checked policy file. `notes` are warnings. `rates` is None when the file has no
    `rates` key: the rate cards are then not the file's to manage."""

    teams: tuple[TeamSpec, ...]
    rates: tuple[RateSpec, ...] | None = None
    notes: tuple[str, ...] = ()
    # Driver name -> checked profile spec; None when the file has no `drivers` key.
    drivers: dict[str, dict[str, Any]] | None = None
    # Version baselines and documented deviations; None when the file has no `versions` key.
    versions: VersionPolicy | None = None
    # The identity provider's groups -> roles; None when the file has no `sso` key.
    sso_groups: tuple[SsoGroupSpec, ...] | None = None


@dataclass
class ApplyReport:
    """What `apply_policy` changed (or, in a dry run, would change)."""

    dry_run: bool
    notes: list[str] = field(default_factory=list)
    # One line per change: "created team vision", "updated quota rule vision/h100: limit ...".
    changes: list[str] = field(default_factory=list)
    # object type -> action ("created", "updated", "deleted") -> count.
    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def add(self, *, action: str, object_type: str, line: str) -> None:
        self.counts[object_type][action] += 1
        self.changes.append(line)

    def add_entry(self, entry: AuditEntry, *, name: str = "") -> None:
        """Report `entry`'s change, the object named `name` when given (a rate card with its
        model's unit: `str()`, which the entry holds, cannot look it up), else as audited."""
        action = f"{entry.action}d"
        line = f"{action} {entry.object_type} {name or entry.object_repr}"
        if entry.action == "update" and entry.before is not None and entry.after is not None:
            line += ": " + ", ".join(
                f"{name} {entry.before.get(name)!r} → {value!r}"
                for name, value in entry.after.items()
                if entry.before.get(name) != value
            )
        self.add(action=action, object_type=entry.object_type, line=line)

    def summary(self) -> str:
        """One line: what changed per object type, or "no changes"."""
        if not self.changed:
            return "no changes"
        return "; ".join(
            f"{object_type}: "
            + ", ".join(f"{count} {action}" for action, count in sorted(actions.items()))
            for object_type, actions in self.counts.items()
        )
