"""Quota as code: teams, their namespaces, members, quota rules and budgets, and the rate
cards, declared in a YAML file.

`load_policy` reads and checks a file and writes nothing: every problem is reported at once,
named by its path in the file (`teams[0].quotas[1].selector: bad CEL: ...`). `apply_policy`
then makes the database match the file in one transaction, every change audited; applying the
same file again changes nothing. Without `prune` nothing is ever removed.

The format (see docs/policy.example.yaml)::

    teams:
    - slug: vision
      name: Vision Research
      costCentre: CC-1234          # optional
      namespaces: [vision, vision-dev]
      leads: [lead-vision]         # usernames; missing users are created, password unusable
      members: [alice, bob]
      quotas:
      - name: h100
        deviceClass: gpu.nvidia.com
        selector: device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")
        gpus: 8                    # or `memory: 640Gi`: exactly one of the two
        mode: enforce              # enforce (default) | warn
      budget: {gpuHours: 2000, mode: hard}   # optional; per billing period; hard | soft;
                                             # unit: gpu (default) | tpu | gaudi | accelerator
      gangs: enforce               # optional; enforce (default: a gang is admitted whole or
                                   # not at all) | warn (claims decided alone, a gang that
                                   # cannot fit whole warned of) | off (claims decided alone)
      idleAlert: {belowPercent: 5, forHours: 4}   # optional; a claim utilised below 5% of
                                   # what it holds in each of the last 4 rolled-up hours is
                                   # alerted to its user and the leads (billing.alerts);
                                   # `off`: never; absent: TALLY_IDLE_ALERT_DEFAULT_*
    drivers:                       # optional; absent: driver profiles are left as they are
      npu.example.com:             # a DRA driver Tally has no built-in profile for
        unit: accelerator          # gpu | tpu | gaudi | accelerator
        identity_attributes: [serial]
        model_attributes: [model]
      gpu.intel.com:               # keys given here replace the built-in profile's
        exclude: []                # count integrated GPUs too
    sso:                           # optional; absent: the group mapping is left as it is
      groups:                      # the identity provider's `groups` claim, at each SSO login
      - {group: ml-vision-leads, team: vision, role: lead}     # lead | member: in `team`
      - {group: ml-vision, team: vision, role: member}
      - {group: finops, role: finance}                        # finance | operator: no team
    versions:                      # optional; absent: baselines and deviations are left alone
      baselines:                   # the validated driver/CUDA pair, per cluster and model
      - cluster: prod              # optional: TALLY_CLUSTER_NAME
        productName: NVIDIA H100 80GB HBM3   # or architecture: Hopper; neither: cluster-wide
        driver: gpu.nvidia.com     # the DRA driver it judges; required cluster-wide where
                                   # several drivers publish versions (docs/versions.md)
        driverVersion: 580.82.07   # at least one of the two; as nvidia-smi or the driver
        cudaDriverVersion: "13.0"  # spells it (580.82.7, 13.0.0): compared as versions
      deviations:                  # documented: tainted out of general scheduling, not flagged
      - node: dgx-canary           # node, pool, or both
        driver: gpu.nvidia.com     # optional: any driver
        driverVersion: 570.172.08
        reason: canary for the 570 branch
        owner: gpu-platform
        expires: 2027-01-31        # after it, the node is an outlier again
    rates:                         # optional; absent: the rate cards are left as they are
    - productName: NVIDIA H100 80GB HBM3
      profile: 3g.40gb             # optional: the price of an hour of one slice of this
      perGpuHour: "2.50"           # profile (without: a slice pays its share of the GPU's)
      idleFactor: "0.4"            # 0..1, default 1
      currency: USD
      from: 2026-01-01
      until: 2027-01-01            # optional, exclusive

A rate card is identified by productName, profile, currency and `from`. Money already billed
stays as it was: a rate card whose validity reaches into a closed billing period is never
changed or deleted so that the period would be priced differently, and no new one may reach
into it.

A driver profile (the keys are `inventory.profiles`'s) is identified by its driver name; the
file manages the DriverProfile rows it wrote (source "policy"), never those written by hand.
A changed profile takes effect on the next full inventory sync.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from typing import Any, TypeVar

import yaml
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import models, transaction
from django.db.models import ProtectedError, RestrictedError
from django.utils import timezone
from kubernetes.utils import parse_quantity

from billing.models import RateCard
from billing.rates import (
    ClosedPeriod,
    closed_periods,
    open_since,
    overlap,
    rate_card_value_errors,
    rate_change_error,
)
from billing.services import delete_rate_card, save_rate_card
from inventory.models import Device, DeviceClass, DeviceKind, DriverProfile
from inventory.models import Unit as DeviceUnit
from inventory.profiles import UNITS, ProfileError, is_driver_name, validate_spec
from inventory.version_policy import (
    VersionPolicy,
    apply_version_policy,
    parse_version_policy,
    version_policy_effects,
)
from inventory.versions import version_matrix
from quota.cel import CELError, compile_selector
from quota.models import (
    Budget,
    GangMode,
    GangPolicy,
    Mode,
    QuotaRule,
    Reservation,
    ReservationState,
    Unit,
)
from quota.services import lock_usage, recount_usage, set_budget
from teams import audit
from teams.models import (
    SSO_TEAM_ROLES,
    AuditEntry,
    IdleAlertPolicy,
    Membership,
    Role,
    SsoGroupRole,
    SsoRole,
    Team,
    TeamNamespace,
)
from teams.ownership import assign_namespace, release_namespace

_TOP_KEYS = ("teams", "rates", "drivers", "versions", "sso")
_SSO_KEYS = ("groups",)
_SSO_GROUP_KEYS = ("group", "team", "role")
# An identity provider's group names are its own: any string, within SsoGroupRole.group.
_SSO_GROUP_MAX_LENGTH = 255
_TEAM_KEYS = (
    "slug",
    "name",
    "costCentre",
    "namespaces",
    "leads",
    "members",
    "quotas",
    "budget",
    "gangs",
    "idleAlert",
)
_RULE_KEYS = ("name", "deviceClass", "selector", "gpus", "memory", "mode")
_BUDGET_KEYS = ("gpuHours", "mode", "unit")
_BUDGET_REQUIRED = ("gpuHours", "mode")
_BUDGET_MODES = ("hard", "soft")
_IDLE_ALERT_KEYS = ("belowPercent", "forHours")
# The longest idle stretch an alert may wait for: a month of hours (the rollup keeps them all,
# but the evaluation reads this many hours of every claim).
_IDLE_ALERT_MAX_HOURS = 744
_RATE_KEYS = ("productName", "profile", "perGpuHour", "idleFactor", "currency", "from", "until")
# A Kubernetes namespace name: a DNS-1123 label.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
# QuotaRule.limit is NUMERIC(24, 6).
_LIMIT_DIGITS, _LIMIT_PLACES = 24, 6

_Model = TypeVar("_Model", bound=models.Model)
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


# --- Loading ----------------------------------------------------------------------------------


class WrittenFloat(float):
    """A YAML float that keeps its text as written: `cudaDriverVersion: 13.10` is the number
    13.1 to YAML, but the version the operator meant is "13.10" (read through `.written`)."""

    written: str


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that rejects a key given twice in one mapping instead of keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_written_float(self, node: yaml.ScalarNode) -> WrittenFloat:
        number = WrittenFloat(self.construct_yaml_float(node))
        number.written = str(self.construct_scalar(node))
        return number

    def construct_timestamp(self, node: yaml.ScalarNode) -> Any:
        """A date or time, or the text as written when it is none (2026-13-01): reported with
        its path where a date is expected, not as a parse error of the whole file."""
        try:
            return self.construct_yaml_timestamp(node)
        except ValueError:
            return self.construct_scalar(node)


_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:float", _UniqueKeyLoader.construct_written_float
)


_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:timestamp", _UniqueKeyLoader.construct_timestamp
)


class _Checker:
    """Collects every error of a file, each named by its path."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def mapping(
        self, value: Any, path: str, *, keys: tuple[str, ...], required: tuple[str, ...]
    ) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.error(path or "(top level)", f"must be a mapping, got {_kind(value)}")
            return None
        for key in value:
            if key not in keys:
                self.error(path or "(top level)", f"unknown key {key!r}")
        for key in required:
            if key not in value:
                self.error(f"{path}.{key}" if path else key, "required")
        return value

    def string(
        self,
        mapping: dict[str, Any],
        key: str,
        path: str,
        *,
        max_length: int,
        default: str = "",
    ) -> str:
        value = mapping.get(key, default)
        if not isinstance(value, str):
            self.error(f"{path}.{key}", f"must be a string, got {_kind(value)}")
            return default
        if len(value) > max_length:
            self.error(f"{path}.{key}", f"longer than {max_length} characters")
        return value

    def string_list(self, mapping: dict[str, Any], key: str, path: str) -> list[tuple[str, str]]:
        """(path, value) of each string of an optional list."""
        value = mapping.get(key, [])
        if not isinstance(value, list):
            self.error(f"{path}.{key}", f"must be a list, got {_kind(value)}")
            return []
        items = []
        for index, item in enumerate(value):
            if isinstance(item, str):
                items.append((f"{path}.{key}[{index}]", item))
            else:
                self.error(f"{path}.{key}[{index}]", f"must be a string, got {_kind(item)}")
        return items


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def load_policy(text: str) -> Policy:
    """Parse and check a policy file; raise `PolicyError` listing every problem.

    Checks the shape and every value (slugs, namespace names, usernames, CEL selectors,
    quantities), duplicates within the file, and device classes against the inventory's
    present DeviceClasses (any name is accepted, with a note, while the inventory has none).
    Conflicts with the database (a namespace another team owns, what pruning would delete) are
    `apply_policy`'s to report. Reads the database; writes nothing.
    """
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise PolicyError([f"not valid YAML: {exc}"]) from exc
    if document is None:
        raise PolicyError(["the file is empty: declare `teams:` (a list)"])
    checker = _Checker()
    notes: list[str] = []
    top = checker.mapping(document, "", keys=_TOP_KEYS, required=("teams",))
    if top is None:
        raise PolicyError(checker.errors)
    rates = None
    if "rates" in top:
        if isinstance(top["rates"], list):
            rates = tuple(
                rate
                for index, value in enumerate(top["rates"])
                if (rate := _rate(checker, value, f"rates[{index}]")) is not None
            )
            _check_overlaps(checker, rates)
        else:
            checker.error("rates", f"must be a list, got {_kind(top['rates'])}")
    drivers = _drivers(checker, top["drivers"]) if "drivers" in top else None
    version_policy = None
    if "versions" in top:
        version_policy, version_errors = parse_version_policy(top["versions"], "versions")
        checker.errors += version_errors
    teams_value = top.get("teams", [])
    if not isinstance(teams_value, list):
        checker.error("teams", f"must be a list, got {_kind(teams_value)}")
        teams_value = []
    device_classes = _present_device_classes()
    if device_classes is None:
        notes.append("deviceClass: the inventory holds no device classes yet; names not checked")
    teams = [
        team
        for index, value in enumerate(teams_value)
        if (team := _team(checker, value, f"teams[{index}]", device_classes)) is not None
    ]
    _check_unique(checker, teams)
    sso_groups = _sso(checker, top["sso"], teams) if "sso" in top else None
    if checker.errors:
        raise PolicyError(checker.errors)
    return Policy(
        teams=tuple(teams),
        rates=rates,
        notes=tuple(notes),
        drivers=drivers,
        versions=version_policy,
        sso_groups=sso_groups,
    )


def _sso(checker: _Checker, value: Any, teams: list[TeamSpec]) -> tuple[SsoGroupSpec, ...]:
    """The `sso:` section: each `groups` line checked, its team one the file declares."""
    section = checker.mapping(value, "sso", keys=_SSO_KEYS, required=("groups",))
    if section is None or "groups" not in section:
        return ()
    if not isinstance(section["groups"], list):
        checker.error("sso.groups", f"must be a list, got {_kind(section['groups'])}")
        return ()
    declared = {spec.slug for spec in teams}
    specs: dict[tuple[str, str, str], str] = {}
    lines = []
    for index, item in enumerate(section["groups"]):
        path = f"sso.groups[{index}]"
        line = checker.mapping(item, path, keys=_SSO_GROUP_KEYS, required=("group", "role"))
        if line is None or "group" not in line or "role" not in line:
            continue
        group = checker.string(line, "group", path, max_length=_SSO_GROUP_MAX_LENGTH)
        if isinstance(line["group"], str) and not group.strip():
            checker.error(f"{path}.group", "must not be empty")
        role = line["role"]
        if role not in SsoRole.values:
            checker.error(
                f"{path}.role", f"must be one of {', '.join(SsoRole.values)}, got {role!r}"
            )
            continue
        team = line.get("team")
        if team is not None and not isinstance(team, str):
            checker.error(f"{path}.team", f"must be a team's slug, got {_kind(team)}")
            continue
        if role in SSO_TEAM_ROLES:
            if team is None:
                checker.error(f"{path}.team", f"required: a {role} is one of a team")
                continue
            if team not in declared:
                known = ", ".join(sorted(declared)) or "none"
                checker.error(f"{path}.team", f"no team {team!r} in `teams` (declared: {known})")
                continue
        elif team is not None:
            checker.error(f"{path}.team", f"not allowed: {role} is a role across every team")
            continue
        spec = SsoGroupSpec(group=group, role=SsoRole(role), team=team)
        if spec.key in specs:
            checker.error(path, f"the same line as {specs[spec.key]}")
            continue
        specs[spec.key] = path
        lines.append(spec)
    return tuple(lines)


def _drivers(checker: _Checker, value: Any) -> dict[str, dict[str, Any]]:
    """The `drivers:` section: driver name -> profile spec, each checked by
    `inventory.profiles.validate_spec` with errors at their path in the file."""
    if not isinstance(value, dict):
        checker.error("drivers", f"must be a mapping of driver name to profile, got {_kind(value)}")
        return {}
    drivers = {}
    for name, spec in value.items():
        path = f"drivers.{name}"
        if not is_driver_name(name):
            checker.error(
                path, "not a DRA driver name (lowercase DNS subdomain, at most 63 characters)"
            )
            continue
        try:
            drivers[name] = validate_spec(spec, path)
        except ProfileError as exc:
            checker.error(exc.path, exc.problem)
    return drivers


def _present_device_classes() -> set[str] | None:
    """Names of the present DeviceClasses of every cluster; None if the inventory has none."""
    if not DeviceClass.objects.exists():
        return None
    return set(DeviceClass.objects.filter(gone_at__isnull=True).values_list("name", flat=True))


def _team(
    checker: _Checker,
    value: Any,
    path: str,
    device_classes: set[str] | None,
) -> TeamSpec | None:
    mapping = checker.mapping(value, path, keys=_TEAM_KEYS, required=("slug", "name"))
    if mapping is None:
        return None
    slug = checker.string(mapping, "slug", path, max_length=63)
    if slug and not _is_slug(slug):
        checker.error(f"{path}.slug", f"{slug!r} is not a slug (letters, digits, - and _)")
    name = checker.string(mapping, "name", path, max_length=200)
    cost_centre = checker.string(mapping, "costCentre", path, max_length=100)
    namespaces = checker.string_list(mapping, "namespaces", path)
    for item_path, namespace in namespaces:
        if len(namespace) > 63 or not _DNS_LABEL.match(namespace):
            checker.error(item_path, f"{namespace!r} is not a Kubernetes namespace name")
    leads = checker.string_list(mapping, "leads", path)
    members = checker.string_list(mapping, "members", path)
    _check_usernames(checker, [*leads, *members])
    budget = _budget(checker, mapping["budget"], f"{path}.budget") if "budget" in mapping else None
    gangs = mapping.get("gangs")
    if gangs is False:
        gangs = GangMode.OFF.value  # YAML 1.1 reads an unquoted `off` as false
    if gangs is not None and gangs not in GangMode.values:
        checker.error(f"{path}.gangs", f"must be enforce, warn or off, got {gangs!r}")
        gangs = None
    idle_alert = (
        _idle_alert(checker, mapping["idleAlert"], f"{path}.idleAlert")
        if "idleAlert" in mapping
        else None
    )
    quotas = mapping.get("quotas", [])
    if not isinstance(quotas, list):
        checker.error(f"{path}.quotas", f"must be a list, got {_kind(quotas)}")
        quotas = []
    rules = [
        rule
        for index, item in enumerate(quotas)
        if (rule := _rule(checker, item, f"{path}.quotas[{index}]", device_classes)) is not None
    ]
    return TeamSpec(
        path=path,
        slug=slug,
        name=name,
        cost_centre=cost_centre,
        namespaces=tuple(namespace for _, namespace in namespaces),
        leads=tuple(username for _, username in leads),
        members=tuple(username for _, username in members),
        rules=tuple(rules),
        budget=budget,
        gangs=gangs,
        idle_alert=idle_alert,
    )


def _is_slug(value: str) -> bool:
    try:
        validate_slug(value)
    except ValidationError:
        return False
    return True


def _check_usernames(checker: _Checker, usernames: list[tuple[str, str]]) -> None:
    user_model = get_user_model()
    username_field = user_model._meta.get_field(user_model.USERNAME_FIELD)
    assert isinstance(username_field, models.Field)
    seen: dict[str, str] = {}
    for path, username in usernames:
        try:
            username_field.run_validators(username)
        except ValidationError as exc:
            checker.error(path, f"{username!r} is not a valid username: {' '.join(exc.messages)}")
        if username in seen:
            checker.error(path, f"{username!r} is already listed at {seen[username]}")
        seen.setdefault(username, path)


def _rule(
    checker: _Checker, value: Any, path: str, device_classes: set[str] | None
) -> RuleSpec | None:
    mapping = checker.mapping(value, path, keys=_RULE_KEYS, required=("name", "deviceClass"))
    if mapping is None:
        return None
    name = checker.string(mapping, "name", path, max_length=63)
    if name and not _is_slug(name):
        checker.error(f"{path}.name", f"{name!r} is not a slug (letters, digits, - and _)")
    device_class = checker.string(mapping, "deviceClass", path, max_length=253)
    if device_class and device_classes is not None and device_class not in device_classes:
        close = difflib.get_close_matches(device_class, sorted(device_classes), n=1, cutoff=0.9)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        checker.error(f"{path}.deviceClass", f"unknown device class {device_class!r}{hint}")
    selector = checker.string(mapping, "selector", path, max_length=100_000)
    if selector.strip():
        try:
            compile_selector(selector)
        except CELError as exc:
            checker.error(f"{path}.selector", f"bad CEL: {exc}")
    mode_value = mapping.get("mode", Mode.ENFORCE.value)
    if mode_value not in Mode.values:
        checker.error(
            f"{path}.mode", f"must be one of {', '.join(Mode.values)}, got {mode_value!r}"
        )
    if ("gpus" in mapping) == ("memory" in mapping):
        checker.error(path, "set exactly one of gpus or memory")
        return None
    unit = Unit.GPUS if "gpus" in mapping else Unit.MEMORY
    limit = _limit(checker, mapping[unit.value], f"{path}.{unit.value}", unit)
    if limit is None:
        return None
    return RuleSpec(
        path=path,
        name=name,
        device_class=device_class,
        selector=selector.strip(),
        unit=unit,
        limit=limit,
        mode=Mode(mode_value) if mode_value in Mode.values else Mode.ENFORCE,
    )


def _limit(checker: _Checker, value: Any, path: str, unit: Unit) -> Decimal | None:
    """A positive limit in the unit: a number of GPUs, or a Kubernetes quantity of bytes."""
    if unit == Unit.GPUS:
        limit = _decimal(
            checker,
            value,
            path,
            digits=_LIMIT_DIGITS,
            places=_LIMIT_PLACES,
            expected="a positive number",
            strings=False,
        )
    else:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            checker.error(path, f"must be a quantity such as 640Gi, got {value!r}")
            return None
        try:
            quantity = parse_quantity(value)
        except (ValueError, InvalidOperation):
            checker.error(path, f"{value!r} is not a Kubernetes quantity (such as 640Gi)")
            return None
        if quantity.is_finite() and quantity != quantity.to_integral_value():
            checker.error(path, f"{value!r} is not a whole number of bytes")
            return None
        limit = _fitting(checker, quantity, value, path, digits=_LIMIT_DIGITS, places=_LIMIT_PLACES)
    return _positive(checker, limit, value, path)


def _decimal(
    checker: _Checker,
    value: Any,
    path: str,
    *,
    digits: int,
    places: int,
    expected: str = "a number",
    strings: bool = True,
) -> Decimal | None:
    """A YAML number (or, with `strings`, a string such as "2.50") that fits NUMERIC(digits,
    places) exactly; decimals from strings keep every digit a float would round away."""
    if isinstance(value, bool) or not isinstance(
        value, (int, float, str) if strings else int | float
    ):
        checker.error(path, f"must be {expected}, got {value!r}")
        return None
    try:
        number = Decimal(str(value).strip())
    except InvalidOperation:
        checker.error(path, f"{value!r} is not a number")
        return None
    return _fitting(checker, number, value, path, digits=digits, places=places)


def _fitting(
    checker: _Checker, number: Decimal, value: Any, path: str, *, digits: int, places: int
) -> Decimal | None:
    """`number` if it is finite and fits NUMERIC(digits, places) without rounding."""
    if not number.is_finite():
        checker.error(path, f"must be a finite number, got {value!r}")
        return None
    if abs(number) >= Decimal(10) ** (digits - places):
        checker.error(path, f"{value!r} is too large")
        return None
    if number != number.quantize(Decimal(1).scaleb(-places), rounding=ROUND_DOWN):
        checker.error(path, f"{value!r} has more than {places} decimal places")
        return None
    return number


def _positive(checker: _Checker, number: Decimal | None, value: Any, path: str) -> Decimal | None:
    if number is not None and number <= 0:
        checker.error(path, f"must be positive, got {value!r}")
        return None
    return number


def _budget(checker: _Checker, value: Any, path: str) -> BudgetSpec | None:
    mapping = checker.mapping(value, path, keys=_BUDGET_KEYS, required=_BUDGET_REQUIRED)
    if mapping is None:
        return None
    mode = mapping.get("mode")
    if "mode" in mapping and mode not in _BUDGET_MODES:
        checker.error(f"{path}.mode", f"must be hard or soft, got {mode!r}")
    unit = mapping.get("unit", DeviceUnit.GPU)
    if unit not in UNITS:
        checker.error(f"{path}.unit", f"must be one of {', '.join(UNITS)}, got {unit!r}")
    gpu_hours = None
    if "gpuHours" in mapping:
        value = mapping["gpuHours"]
        # Budget.gpu_hours is NUMERIC(14, 3).
        number = _decimal(checker, value, f"{path}.gpuHours", digits=14, places=3)
        gpu_hours = _positive(checker, number, value, f"{path}.gpuHours")
    if gpu_hours is None or mode not in _BUDGET_MODES or unit not in UNITS:
        return None
    return BudgetSpec(path=path, gpu_hours=gpu_hours, mode=mode, unit=unit)


def _idle_alert(checker: _Checker, value: Any, path: str) -> IdleAlertSpec | None:
    # YAML reads an unquoted `off` as false.
    if value is False or value == "off":
        return IdleAlertSpec(
            path=path,
            below_percent=Decimal(settings.TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT),
            for_hours=max(settings.TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS, 1),
            enabled=False,
        )
    if not isinstance(value, dict):
        checker.error(path, f"must be a mapping or off, got {_kind(value)}")
        return None
    mapping = checker.mapping(value, path, keys=_IDLE_ALERT_KEYS, required=_IDLE_ALERT_KEYS)
    if mapping is None or any(key not in mapping for key in _IDLE_ALERT_KEYS):
        return None
    raw_percent = mapping["belowPercent"]
    # IdleAlertPolicy.below_percent is NUMERIC(5, 2): 100 at most.
    percent = _positive(
        checker,
        _decimal(checker, raw_percent, f"{path}.belowPercent", digits=5, places=2),
        raw_percent,
        f"{path}.belowPercent",
    )
    if percent is not None and percent > 100:
        checker.error(f"{path}.belowPercent", f"must be at most 100, got {raw_percent!r}")
        percent = None
    hours = mapping["forHours"]
    if isinstance(hours, bool) or not isinstance(hours, int):
        checker.error(f"{path}.forHours", f"must be a whole number of hours, got {hours!r}")
        return None
    if not 1 <= hours <= _IDLE_ALERT_MAX_HOURS:
        checker.error(
            f"{path}.forHours", f"must be from 1 to {_IDLE_ALERT_MAX_HOURS} hours, got {hours}"
        )
        return None
    if percent is None:
        return None
    return IdleAlertSpec(path=path, below_percent=percent, for_hours=hours)


def _rate(checker: _Checker, value: Any, path: str) -> RateSpec | None:
    errors = len(checker.errors)
    mapping = checker.mapping(
        value, path, keys=_RATE_KEYS, required=("productName", "perGpuHour", "currency", "from")
    )
    if mapping is None:
        return None
    # Each value, once parsed, is checked by the rate cards' own rules (`rate_card_value_errors`).
    product_name = checker.string(mapping, "productName", path, max_length=253)
    if isinstance(mapping.get("productName"), str):
        _rate_values(checker, path, product_name=product_name)
    profile = checker.string(mapping, "profile", path, max_length=64)
    _rate_values(checker, path, profile=profile)
    currency = checker.string(mapping, "currency", path, max_length=64)
    if isinstance(mapping.get("currency"), str):
        _rate_values(checker, path, currency=currency)
    per_gpu_hour = None
    if "perGpuHour" in mapping:
        # RateCard.per_gpu_hour is NUMERIC(12, 4).
        value = mapping["perGpuHour"]
        per_gpu_hour = _decimal(checker, value, f"{path}.perGpuHour", digits=12, places=4)
        _rate_values(checker, path, per_gpu_hour=per_gpu_hour)
    idle_factor = _decimal(
        checker, mapping.get("idleFactor", 1), f"{path}.idleFactor", digits=6, places=4
    )
    _rate_values(checker, path, idle_factor=idle_factor)
    valid_from = _date(checker, mapping, "from", path) if "from" in mapping else None
    valid_until = _date(checker, mapping, "until", path) if "until" in mapping else None
    _rate_values(checker, path, valid_from=valid_from, valid_until=valid_until)
    if len(checker.errors) > errors:
        return None
    assert per_gpu_hour is not None and idle_factor is not None and valid_from is not None
    return RateSpec(
        path=path,
        product_name=product_name,
        profile=profile,
        currency=currency,
        valid_from=valid_from,
        valid_until=valid_until,
        per_gpu_hour=per_gpu_hour,
        idle_factor=idle_factor,
    )


# A rate entry's key for each of RateCard's fields.
_RATE_KEY_OF = {
    "product_name": "productName",
    "profile": "profile",
    "currency": "currency",
    "per_gpu_hour": "perGpuHour",
    "idle_factor": "idleFactor",
    "valid_from": "from",
    "valid_until": "until",
}


def _rate_values(checker: _Checker, path: str, **values: Any) -> None:
    for name, message in rate_card_value_errors(values).items():
        checker.error(f"{path}.{_RATE_KEY_OF[name]}", message)


def _date(checker: _Checker, mapping: dict[str, Any], key: str, path: str) -> date | None:
    """A YAML date (2026-01-01) or an ISO 8601 date string; not a timestamp."""
    value = mapping[key]
    if isinstance(value, str):
        try:
            return date.fromisoformat(value)
        except ValueError:
            checker.error(f"{path}.{key}", f"{value!r} is not a date (YYYY-MM-DD)")
            return None
    if isinstance(value, date) and not isinstance(value, datetime):
        return value
    checker.error(f"{path}.{key}", f"must be a date (YYYY-MM-DD), got {value!r}")
    return None


def _check_overlaps(checker: _Checker, rates: tuple[RateSpec, ...]) -> None:
    """One price per product and profile on any day, whatever its currency: a GPU-hour is
    priced by the one card valid that day (two would make the statement's currency a toss)."""
    declared: dict[tuple[str, str], list[RateSpec]] = defaultdict(list)
    for rate in rates:
        same = declared[rate.key[:2]]
        for other in same:
            if overlap(rate.valid_from, rate.valid_until, other.valid_from, other.valid_until):
                checker.error(
                    rate.path,
                    f"valid {rate.validity()}, which overlaps {other.path} (valid "
                    f"{other.validity()}) for the same productName and profile (one price a "
                    "day, in any currency)",
                )
        same.append(rate)


def _check_unique(checker: _Checker, teams: list[TeamSpec]) -> None:
    """Slugs and namespaces once in the file; rule names once per team."""
    slugs: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    for team in teams:
        if team.slug in slugs:
            checker.error(
                f"{team.path}.slug", f"duplicate slug {team.slug!r} (also {slugs[team.slug]})"
            )
        slugs.setdefault(team.slug, team.path)
        for index, namespace in enumerate(team.namespaces):
            path = f"{team.path}.namespaces[{index}]"
            if namespace in namespaces:
                checker.error(
                    path, f"namespace {namespace!r} is also claimed by {namespaces[namespace]}"
                )
            namespaces.setdefault(namespace, path)
        rule_names: dict[str, str] = {}
        for rule in team.rules:
            if rule.name in rule_names:
                checker.error(
                    f"{rule.path}.name",
                    f"duplicate rule name {rule.name!r} (also {rule_names[rule.name]})",
                )
            rule_names.setdefault(rule.name, rule.path)


# --- Applying ---------------------------------------------------------------------------------


@dataclass
class _State:
    """The teams, namespaces, memberships, rules, budgets and rate cards as stored; rules and
    rate cards locked for this transaction, and the billing periods while rates are applied."""

    teams: dict[str, Team]
    namespaces: dict[str, TeamNamespace]
    memberships: dict[int, dict[str, Membership]]
    rules: dict[int, dict[str, QuotaRule]]
    budgets: dict[int, Budget]
    rate_cards: dict[RateKey, RateCard]
    closed_periods: list[ClosedPeriod]
    driver_profiles: dict[str, DriverProfile] = field(default_factory=dict)
    gang_policies: dict[int, GangPolicy] = field(default_factory=dict)
    idle_alert_policies: dict[int, IdleAlertPolicy] = field(default_factory=dict)

    @classmethod
    def load(cls, *, lock_periods: bool) -> _State:
        lock_usage(team_ids=())  # first: no other change of usage or ownership meanwhile
        teams = {team.slug: team for team in Team.objects.all()}
        by_id = {team.pk: team for team in teams.values()}
        namespaces = {}
        for namespace in TeamNamespace.objects.all():
            namespace.team = by_id[namespace.team_id]
            namespaces[namespace.namespace] = namespace
        memberships: dict[int, dict[str, Membership]] = defaultdict(dict)
        for membership in Membership.objects.select_related("user"):
            membership.team = by_id[membership.team_id]
            memberships[membership.team_id][membership.user.get_username()] = membership
        rules: dict[int, dict[str, QuotaRule]] = defaultdict(dict)
        # Locked (with the usage lock, before anything is written) so that the checks on
        # `in_use` hold until the deletes and unit changes commit, and the recount after them
        # sees no other change of usage.
        for rule in lock_usage(team_ids=by_id):
            rule.team = by_id[rule.team_id]
            rules[rule.team_id][rule.name] = rule
        budgets = {}
        for budget in Budget.objects.all():
            budget.team = by_id[budget.team_id]
            budgets[budget.team_id] = budget
        gang_policies = {}
        for gang_policy in GangPolicy.objects.all():
            gang_policy.team = by_id[gang_policy.team_id]
            gang_policies[gang_policy.team_id] = gang_policy
        idle_alert_policies = {}
        for idle_alert_policy in IdleAlertPolicy.objects.all():
            idle_alert_policy.team = by_id[idle_alert_policy.team_id]
            idle_alert_policies[idle_alert_policy.team_id] = idle_alert_policy
        # Periods (and the rate cards' writers' lock) before the cards, in the order
        # `billing.services` takes them.
        closed = closed_periods(lock=lock_periods)
        rate_cards = {_rate_key(card): card for card in RateCard.objects.select_for_update()}
        driver_profiles = {row.driver: row for row in DriverProfile.objects.select_for_update()}
        return cls(
            teams=teams,
            namespaces=namespaces,
            memberships=memberships,
            rules=rules,
            budgets=budgets,
            rate_cards=rate_cards,
            closed_periods=closed,
            driver_profiles=driver_profiles,
            gang_policies=gang_policies,
            idle_alert_policies=idle_alert_policies,
        )

    def undeclared_teams(self, policy: Policy) -> list[Team]:
        declared = {spec.slug for spec in policy.teams}
        return [team for slug, team in sorted(self.teams.items()) if slug not in declared]


def apply_policy(
    *,
    policy: Policy,
    prune: bool,
    actor: str,
    dry_run: bool = False,
    force: bool = False,
    at: datetime | None = None,
) -> ApplyReport:
    """Make the teams, namespaces, memberships, rules, budgets and (when the file has `rates`,
    `drivers`, `versions` or `sso`) rate cards, driver profiles, version baselines and single
    sign-on group roles in the database match `policy`. Memberships a sign-in gave
    (`teams.sso`) are never pruned: the next sign-in is theirs to take.

    Guarantees: all or nothing, in one transaction; every create, update and delete is audited
    as `actor`; applying the same policy again changes nothing; without `prune` nothing is
    deleted, with it whatever the file does not declare is, except a team with reservations
    or a rule with capacity in use, which are reported as errors (`PolicyError`, nothing
    applied). The usage of every team whose rules or namespaces changed is recounted from the
    ledger in the same transaction (`quota.services.recount_usage`, the only writer of
    `QuotaRule.in_use` here: claims already allocated in a namespace a team now owns are
    adopted), each change of a rule's usage noted in the report. No closed billing period
    would be priced differently afterwards: a rate card that reaches into one keeps its
    price, idle factor and days there, and is not deleted; a new one may not reach into one
    (errors again). A `versions` section is reported by what it does (the nodes each baseline
    judges, its outliers, what matches nothing: `inventory.version_policy.version_policy_effects`);
    one that would make more than half of a model's nodes in a cluster outliers is an error
    unless `force`. A dry run reports the same changes and rolls them back.

    `at` (default now) is the moment the changes are made as of: a namespace changes owner
    from its hour, usage is recounted as of it, and the audit entries are dated it. For
    history laid down after the fact, in time order (the demo, `manage.py load_demo`).
    """
    report = ApplyReport(dry_run=dry_run, notes=list(policy.notes))
    moment = timezone.now() if at is None else at
    with transaction.atomic(), audit.dated(moment):
        state = _State.load(lock_periods=policy.rates is not None)
        errors = _conflicts(policy=policy, state=state, prune=prune)
        if errors:
            raise PolicyError(errors)
        applier = _Applier(state=state, actor=actor, report=report, force=force, at=moment)
        try:
            applier.apply(policy=policy, prune=prune)
        except (ProtectedError, RestrictedError) as exc:
            # Held further down a cascade than `_undeletable_teams` looks.
            raise PolicyError([f"not deleted: {exc.args[0]}"]) from exc
        for usage in recount_usage(teams=applier.recount, at=moment):
            if usage.stored != usage.recounted:
                report.notes.append(
                    f"usage of quota rule {usage.rule} recounted: "
                    f"{usage.stored.normalize():f} → {usage.recounted.normalize():f}"
                )
        if dry_run:
            transaction.set_rollback(True)
    return report


def _conflicts(*, policy: Policy, state: _State, prune: bool) -> list[str]:
    """What in the database stops the policy from being applied as asked."""
    errors = []
    declared = {spec.slug for spec in policy.teams}
    for spec in policy.teams:
        for index, namespace in enumerate(spec.namespaces):
            owner = state.namespaces.get(namespace)
            if owner is not None and owner.team.slug not in declared and not prune:
                errors.append(
                    f"{spec.path}.namespaces[{index}]: namespace {namespace!r} is owned by team "
                    f"{owner.team.slug!r}, which the file does not declare "
                    "(declare that team, or remove it with --prune)"
                )
        team = state.teams.get(spec.slug)
        rules = state.rules.get(team.pk, {}) if team is not None else {}
        for rule_spec in spec.rules:
            rule = rules.get(rule_spec.name)
            if rule is not None and rule.unit != rule_spec.unit and rule.in_use > 0:
                errors.append(
                    f"{rule_spec.path}: cannot change the unit of rule {rule_spec.name!r} "
                    f"from {rule.unit} to {rule_spec.unit} while {rule.in_use} is in use"
                )
        if prune:
            declared_rules = {rule_spec.name for rule_spec in spec.rules}
            for name, rule in sorted(rules.items()):
                if name not in declared_rules and rule.in_use > 0:
                    errors.append(
                        f"{spec.path}.quotas: rule {name!r} is not declared but has "
                        f"{rule.in_use} in use; a rule in use is never deleted"
                    )
    if prune:
        errors.extend(_undeletable_teams(state.undeclared_teams(policy)))
    return errors + _closed_period_conflicts(policy=policy, state=state, prune=prune)


def _closed_period_conflicts(*, policy: Policy, state: _State, prune: bool) -> list[str]:
    """Rate cards whose change, creation or deletion would price a closed period differently."""
    if policy.rates is None or not state.closed_periods:
        return []
    errors = []
    for spec in policy.rates:
        error = rate_change_error(
            before=state.rate_cards.get(spec.key), after=spec, periods=state.closed_periods
        )
        if error:
            errors.append(f"{spec.path}: {error}")
    if prune:
        declared = {spec.key for spec in policy.rates}
        for key, card in sorted(state.rate_cards.items()):
            if key not in declared:
                error = rate_change_error(before=card, after=None, periods=state.closed_periods)
                if error:
                    errors.append(f"rates: not declared, but {error}")
    return errors


def _rate_key(card: RateCard) -> RateKey:
    return (card.product_name, card.profile, card.currency, card.valid_from)


def _undeletable_teams(teams: list[Team]) -> list[str]:
    """Teams that rows elsewhere keep (PROTECT or RESTRICT): reservations, statements, usage."""
    errors = []
    for team in teams:
        held = []
        for relation in Team._meta.related_objects:
            if relation.on_delete not in (models.PROTECT, models.RESTRICT):
                continue
            model = relation.related_model
            assert not isinstance(model, str)  # resolved once apps are loaded
            rows = model._default_manager.filter(**{relation.field.name: team})
            count = rows.count()
            if not count:
                continue
            meta = model._meta
            label = f"{count} {meta.verbose_name if count == 1 else meta.verbose_name_plural}"
            if model is Reservation:
                label += f" ({rows.exclude(state=ReservationState.RELEASED).count()} live)"
            held.append(label)
        if held:
            errors.append(
                f"teams: team {team.slug!r} is not declared but has {', '.join(held)}, "
                "which keep their team; it is not deleted"
            )
    return errors


class _Applier:
    """The writes of one `apply_policy`, each audited and reported."""

    def __init__(
        self, *, state: _State, actor: str, report: ApplyReport, force: bool, at: datetime
    ) -> None:
        self.force = force
        self.at = at
        self.state = state
        self.actor = actor
        self.report = report
        # Teams whose rules or namespaces changed: their usage is recounted.
        self.recount: set[int] = set()
        # Where the open billing periods begin (`billing.rates.open_since`), read once, with
        # the periods locked, when a namespace gets its first owner; None: not read yet.
        self._open_since: tuple[datetime | None] | None = None
        # Model -> the unit its rate cards price an hour of (`_rate_name`); None: not read yet.
        self._product_units: dict[str, str] | None = None

    def apply(self, *, policy: Policy, prune: bool) -> None:
        users = self._users(policy.teams)
        teams = [(spec, self._team(spec)) for spec in policy.teams]
        for spec, team in teams:
            for namespace in spec.namespaces:
                self._namespace(team, namespace)
            self._memberships(spec, team, users)
            self._rules(spec, team)
            if spec.budget is not None:
                self._budget(spec.budget, team)
            if spec.gangs is not None:
                _, changed = self._put(
                    self.state.gang_policies.get(team.pk),
                    GangPolicy,
                    identity={"team": team},
                    values={"mode": spec.gangs},
                )
                if changed:
                    self.recount.add(team.pk)  # gangs: off releases the team's gang holds
            if spec.idle_alert is not None:
                self._put(
                    self.state.idle_alert_policies.get(team.pk),
                    IdleAlertPolicy,
                    identity={"team": team},
                    values={
                        "below_percent": spec.idle_alert.below_percent,
                        "for_hours": spec.idle_alert.for_hours,
                        "enabled": spec.idle_alert.enabled,
                    },
                )
        for rate_spec in policy.rates or ():
            self._rate(rate_spec)
        for driver, profile_spec in (policy.drivers or {}).items():
            self._put(
                self.state.driver_profiles.get(driver),
                DriverProfile,
                identity={"driver": driver},
                values={"spec": profile_spec, "source": "policy"},
            )
        if policy.drivers is None and prune and self._policy_profiles():
            self.report.notes.append(
                "drivers: not declared, so the driver profiles are not this file's: "
                "--prune keeps them"
            )
        if policy.versions is not None:
            self._versions(policy.versions, prune=prune)
        if policy.sso_groups is not None:
            self._sso_groups(policy.sso_groups, {spec.slug: team for spec, team in teams}, prune)
        if policy.rates is None and prune and self.state.rate_cards:
            self.report.notes.append(
                "rates: not declared, so the rate cards are not this file's: --prune keeps them"
            )
        for obj in self._undeclared(policy, teams):
            if prune:
                self._delete(obj)
            else:
                self.report.notes.append(
                    f"kept {obj._meta.verbose_name} {obj}: not declared (--prune "
                    f"{'releases' if isinstance(obj, TeamNamespace) else 'deletes'} it)"
                )

    def _versions(self, specs: VersionPolicy, *, prune: bool) -> None:
        before = version_matrix()
        changes = apply_version_policy(specs=specs, actor=self.actor, prune=prune)
        for entry in changes.entries:
            self.report.add_entry(entry)
        self.report.notes.extend(changes.notes)
        effects = version_policy_effects(
            specs=specs, rows=changes.rows, before=before, after=version_matrix()
        )
        errors = effects.errors + ([] if self.force else effects.refusals)
        if errors:
            raise PolicyError(errors)
        self.report.notes += effects.lines + effects.warnings
        self.report.notes += [f"forced: {refusal}" for refusal in effects.refusals]

    def _undeclared(self, policy: Policy, teams: list[tuple[TeamSpec, Team]]) -> list[models.Model]:
        """What the database holds and the file does not declare; teams last."""
        undeclared: list[models.Model] = []
        for spec, team in teams:
            roles = spec.roles()
            rule_names = {rule_spec.name for rule_spec in spec.rules}
            memberships = self.state.memberships.get(team.pk, {})
            undeclared += [
                membership
                for name, membership in memberships.items()
                if name not in roles and not membership.granted_by_sso  # the sign-ins' to take
            ]
            rules = self.state.rules.get(team.pk, {})
            undeclared += [rule for name, rule in rules.items() if name not in rule_names]
            budget = self.state.budgets.get(team.pk)
            if spec.budget is None and budget is not None:
                undeclared.append(budget)
            gang_policy = self.state.gang_policies.get(team.pk)
            if spec.gangs is None and gang_policy is not None:
                undeclared.append(gang_policy)  # deleted: the team's gangs are enforced
            idle_alert_policy = self.state.idle_alert_policies.get(team.pk)
            if spec.idle_alert is None and idle_alert_policy is not None:
                undeclared.append(idle_alert_policy)  # deleted: the default rule applies
        declared_slugs = {spec.slug for spec in policy.teams}
        declared_namespaces = {name for spec in policy.teams for name in spec.namespaces}
        undeclared += [
            namespace
            for name, namespace in sorted(self.state.namespaces.items())
            if name not in declared_namespaces and namespace.team.slug in declared_slugs
        ]
        if policy.rates is not None:
            declared_rates = {rate_spec.key for rate_spec in policy.rates}
            undeclared += [
                card
                for key, card in sorted(self.state.rate_cards.items())
                if key not in declared_rates
            ]
        if policy.drivers is not None:
            undeclared += [
                row for row in self._policy_profiles() if row.driver not in policy.drivers
            ]
        return undeclared + list(self.state.undeclared_teams(policy))

    def _sso_groups(
        self, specs: tuple[SsoGroupSpec, ...], teams: dict[str, Team], prune: bool
    ) -> None:
        """Make the stored `sso.groups` lines match the file's; lines it no longer has are
        deleted with `prune` (the role is then taken at each user's next sign-in), else noted."""
        stored = {
            (row.group, row.role, row.team.slug if row.team else ""): row
            for row in SsoGroupRole.objects.select_related("team").select_for_update(of=("self",))
        }
        for spec in specs:
            if spec.key not in stored:
                team = teams[spec.team] if spec.team is not None else None
                row = SsoGroupRole(group=spec.group, role=spec.role, team=team)
                self.report.add_entry(audit.create(actor=self.actor, obj=row))
        declared = {spec.key for spec in specs}
        for key, row in sorted(stored.items()):
            if key in declared:
                continue
            if prune:
                self._delete(row)
            else:
                self.report.notes.append(
                    f"kept SSO group role {row}: not declared (--prune deletes it)"
                )

    def _policy_profiles(self) -> list[DriverProfile]:
        """The stored driver profiles a policy file wrote; those written by hand are not its."""
        return [
            row for _, row in sorted(self.state.driver_profiles.items()) if row.source == "policy"
        ]

    def _users(self, teams: Iterable[TeamSpec]) -> dict[str, Any]:
        """The users the teams name, by username; missing ones created, password unusable."""
        user_model = get_user_model()
        usernames = sorted({username for spec in teams for username in spec.roles()})
        users = {
            user.get_username(): user
            for user in user_model._default_manager.filter(
                **{f"{user_model.USERNAME_FIELD}__in": usernames}
            )
        }
        for username in usernames:
            if username not in users:
                user = user_model(**{user_model.USERNAME_FIELD: username})
                user.set_unusable_password()
                user.save()
                users[username] = user
                self.report.add(
                    action="created", object_type="user", line=f"created user {username}"
                )
        return users

    def _team(self, spec: TeamSpec) -> Team:
        team, _ = self._put(
            self.state.teams.get(spec.slug),
            Team,
            identity={"slug": spec.slug},
            values={"name": spec.name, "cost_centre": spec.cost_centre},
        )
        self.state.teams[spec.slug] = team
        return team

    def _namespace(self, team: Team, name: str) -> None:
        """`team` owns the namespace from this hour (`teams.ownership`: dated, so the hours
        before stay charged to whoever owned them; a first owner takes its hours in the open
        periods). Moved from another team, the namespace is never unowned in between."""
        current = self.state.namespaces.get(name)
        if current is not None and current.team_id == team.pk:
            return
        self.recount |= {team.pk} if current is None else {current.team_id, team.pk}
        if self._open_since is None:
            self._open_since = (open_since(lock=True),)
        ownership, entries = assign_namespace(
            namespace=name,
            team=team,
            actor=self.actor,
            at=self.at,
            open_since=self._open_since[0],
        )
        for entry in entries:
            self.report.add_entry(entry)
        ownership.team = team
        self.state.namespaces[name] = ownership

    def _memberships(self, spec: TeamSpec, team: Team, users: dict[str, Any]) -> None:
        current = self.state.memberships.get(team.pk, {})
        for username, role in spec.roles().items():
            self._put(
                current.get(username),
                Membership,
                identity={"team": team, "user": users[username]},
                values={"role": role, "granted_by_sso": False},
            )

    def _rules(self, spec: TeamSpec, team: Team) -> None:
        current = self.state.rules.get(team.pk, {})
        for rule_spec in spec.rules:
            _, changed = self._put(
                current.get(rule_spec.name),
                QuotaRule,
                identity={"team": team, "name": rule_spec.name},
                values={
                    "device_class": rule_spec.device_class,
                    "selector": rule_spec.selector,
                    "unit": rule_spec.unit,
                    "limit": rule_spec.limit,
                    "mode": rule_spec.mode,
                },
            )
            if changed:
                self.recount.add(team.pk)

    def _budget(self, spec: BudgetSpec, team: Team) -> None:
        _, entry = set_budget(
            team=team, gpu_hours=spec.gpu_hours, mode=spec.mode, unit=spec.unit, actor=self.actor
        )
        if entry is not None:
            self.report.add_entry(entry)

    def _rate(self, spec: RateSpec) -> None:
        product_name, profile, currency, valid_from = spec.key
        saved = save_rate_card(
            card=self.state.rate_cards.get(spec.key),
            values={
                "product_name": product_name,
                "profile": profile,
                "currency": currency,
                "valid_from": valid_from,
                "valid_until": spec.valid_until,
                "per_gpu_hour": spec.per_gpu_hour,
                "idle_factor": spec.idle_factor,
            },
            actor=self.actor,
            closed=self.state.closed_periods,
            # `_check_overlaps` checked the declared cards whole, the stored ones are replaced.
            check_overlap=False,
        )
        if saved.entry is not None:
            self.report.add_entry(saved.entry, name=self._rate_name(saved.card))
        self.state.rate_cards[spec.key] = saved.card

    def _rate_name(self, card: RateCard) -> str:
        """The card priced per hour of its model's unit (`USD/TPU chip-hour`): the unit of the
        model's accelerators in the inventory, "accelerator" when they differ, GPU when none
        is known yet. Read in one query, when the first rate card changes."""
        if self._product_units is None:
            found: dict[str, set[str]] = defaultdict(set)
            for product_name, unit in (
                Device.objects.exclude(kind=DeviceKind.OTHER)
                .exclude(product_name="")
                .values_list("product_name", "unit")
                .distinct()
            ):
                found[product_name].add(unit)
            self._product_units = {
                product: units.pop() if len(units) == 1 else DeviceUnit.ACCELERATOR
                for product, units in found.items()
            }
        return card.describe(self._product_units.get(card.product_name, DeviceUnit.GPU))

    def _put(
        self,
        obj: _Model | None,
        model: type[_Model],
        *,
        identity: dict[str, Any],
        values: dict[str, Any],
    ) -> tuple[_Model, bool]:
        """Create `model(**identity, **values)` when `obj` (the stored one) is None, else set
        `values` on it and save what changed; audited either way. Returns the object and
        whether anything was written."""
        if obj is None:
            obj = model(**identity, **values)
            self.report.add_entry(audit.create(actor=self.actor, obj=obj))
            return obj, True
        before = audit.snapshot(obj)
        for name, value in values.items():
            setattr(obj, name, value)
        return obj, self._update(obj, before)

    def _update(self, obj: models.Model, before: dict[str, Any]) -> bool:
        entry = audit.update(actor=self.actor, obj=obj, before=before)
        if entry is not None:
            self.report.add_entry(entry)
        return entry is not None

    def _delete(self, obj: models.Model) -> None:
        if isinstance(obj, TeamNamespace):
            self.recount.add(obj.team_id)  # its claims count for no team now
            # Released, not deleted: the hours it owned stay its own.
            for entry in release_namespace(ownership=obj, actor=self.actor, at=self.at):
                self.report.add_entry(entry)
            return
        entries = []
        # The cascade would delete a team's budget unaudited.
        if isinstance(obj, Team) and (budget := self.state.budgets.get(obj.pk)) is not None:
            entries += audit.delete(actor=self.actor, obj=budget)
        if isinstance(obj, RateCard):
            entry = delete_rate_card(card=obj, actor=self.actor, closed=self.state.closed_periods)
            self.report.add_entry(entry, name=self._rate_name(obj))
        else:
            entries += audit.delete(actor=self.actor, obj=obj)
        for entry in entries:
            self.report.add_entry(entry)
