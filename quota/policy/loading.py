"""Reading the policy file: `load_policy` parses the YAML and checks it whole, writing nothing,
every problem reported at once by its path in the file (`teams[0].quotas[1].selector: ...`).
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from datetime import date, datetime
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from typing import Any

import yaml
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import models
from kubernetes.utils import parse_quantity

from billing.rates import (
    overlap,
    rate_card_value_errors,
)
from inventory.models import DeviceClass
from inventory.models import Unit as DeviceUnit
from inventory.profiles import UNITS, ProfileError, is_driver_name, validate_spec
from inventory.version_policy import (
    parse_version_policy,
)
from quota.models import (
    GangMode,
    Mode,
    Unit,
)
from quota.policy.specs import (
    BudgetSpec,
    IdleAlertSpec,
    Policy,
    PolicyError,
    RateSpec,
    RuleSpec,
    SsoGroupSpec,
    TeamSpec,
)
from quota.rules import selector_error
from teams.models import (
    SSO_TEAM_ROLES,
    SsoRole,
)

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
    selector_problem = selector_error(selector)
    if selector_problem is not None:
        checker.error(f"{path}.selector", selector_problem)
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
