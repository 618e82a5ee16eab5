"""Reading the policy file: `load_policy` parses the YAML and checks it whole against its
schema (`quota.policy.schema`, pydantic models) and across the file, writing nothing, every
problem reported at once by its path in the file (`teams[0].quotas[1].selector: ...`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import yaml
from pydantic import ValidationError

from billing.rates import (
    overlap,
)
from inventory.models import DeviceClass
from inventory.profiles import ProfileError, is_driver_name, validate_spec
from inventory.version_policy import (
    parse_version_policy,
)
from quota.models import (
    Mode,
)
from quota.policy.schema import (
    DocumentModel,
    RateModel,
    RuleModel,
    SsoGroupModel,
    SsoModel,
    TeamModel,
    kind,
    problems,
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
from teams.models import (
    SsoRole,
)


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


def load_policy(text: str) -> Policy:
    """Parse and check a policy file; raise `PolicyError` listing every problem.

    Checks the shape and every value (slugs, namespace names, usernames, CEL selectors,
    quantities) against the file's schema (`quota.policy.schema`), duplicates within the
    file, and device classes against the inventory's present DeviceClasses (any name is
    accepted, with a note, while the inventory has none). Conflicts with the database (a
    namespace another team owns, what pruning would delete) are `apply_policy`'s to report.
    Reads the database; writes nothing.
    """
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise PolicyError([f"not valid YAML: {exc}"]) from exc
    if document is None:
        raise PolicyError(["the file is empty: declare `teams:` (a list)"])
    errors: list[str] = []
    notes: list[str] = []
    try:
        DocumentModel.model_validate(document)
    except ValidationError as exc:
        errors += problems(exc)
    if not isinstance(document, dict):
        raise PolicyError(errors)
    # Each entry on its own, so that one bad entry hides nothing of the others.
    rates = None
    if isinstance(document.get("rates"), list):
        rates = tuple(
            rate
            for index, value in enumerate(document["rates"])
            if (rate := _rate(errors, value, index)) is not None
        )
        errors += _overlaps(rates)
    drivers = _drivers(errors, document["drivers"]) if "drivers" in document else None
    version_policy = None
    if "versions" in document:
        version_policy, version_errors = parse_version_policy(document["versions"], "versions")
        errors += version_errors
    teams_value = document.get("teams")
    teams_value = teams_value if isinstance(teams_value, list) else []
    device_classes = _present_device_classes()
    if device_classes is None:
        notes.append("deviceClass: the inventory holds no device classes yet; names not checked")
    teams = [
        team
        for index, value in enumerate(teams_value)
        if (team := _team(errors, value, index, device_classes)) is not None
    ]
    errors += _duplicates(teams_value)
    sso_groups = _sso(errors, document["sso"], teams_value) if "sso" in document else None
    if errors:
        raise PolicyError(errors)
    return Policy(
        teams=tuple(teams),
        rates=rates,
        notes=tuple(notes),
        drivers=drivers,
        versions=version_policy,
        sso_groups=sso_groups,
    )


def _team(
    errors: list[str], value: Any, index: int, device_classes: set[str] | None
) -> TeamSpec | None:
    path = f"teams[{index}]"
    try:
        team = TeamModel.model_validate(value, context={"device_classes": device_classes})
    except ValidationError as exc:
        errors += problems(exc, at=("teams", index))
        return None
    budget = team.budget
    idle_alert = team.idle_alert
    return TeamSpec(
        path=path,
        slug=team.slug,
        name=team.name,
        cost_centre=team.cost_centre,
        namespaces=tuple(team.namespaces),
        leads=tuple(team.leads),
        members=tuple(team.members),
        rules=tuple(
            RuleSpec(
                path=f"{path}.quotas[{rule_index}]",
                name=rule.name,
                device_class=rule.device_class,
                selector=rule.selector,
                unit=rule.unit,
                limit=rule.limit,
                mode=Mode(rule.mode),
            )
            for rule_index, rule in enumerate(team.quotas)
        ),
        budget=(
            BudgetSpec(
                path=f"{path}.budget",
                gpu_hours=budget.gpu_hours,
                mode=budget.mode,
                unit=budget.unit,
            )
            if budget is not None
            else None
        ),
        gangs=team.gangs,
        narrow_to_fit=team.narrow_to_fit,
        idle_alert=(
            IdleAlertSpec(
                path=f"{path}.idleAlert",
                below_percent=idle_alert.below_percent,
                for_hours=idle_alert.for_hours,
                enabled=idle_alert.enabled,
            )
            if idle_alert is not None
            else None
        ),
    )


def _rate(errors: list[str], value: Any, index: int) -> RateSpec | None:
    try:
        rate = RateModel.model_validate(value)
    except ValidationError as exc:
        errors += problems(exc, at=("rates", index))
        return None
    return RateSpec(
        path=f"rates[{index}]",
        product_name=rate.product_name,
        profile=rate.profile,
        currency=rate.currency,
        valid_from=rate.valid_from,
        valid_until=rate.valid_until,
        per_gpu_hour=rate.per_gpu_hour,
        idle_factor=rate.idle_factor,
    )


def _sso(errors: list[str], value: Any, teams: list[Any]) -> tuple[SsoGroupSpec, ...]:
    """The `sso:` section: each `groups` line checked, its team one the file declares."""
    try:
        section = SsoModel.model_validate(value)
    except ValidationError as exc:
        errors += problems(exc, at=("sso",))
        return ()
    declared = {slug for slug, _ in _strings(teams, "slug")}
    specs: dict[tuple[str, str, str], str] = {}
    lines = []
    for index, item in enumerate(section.groups):
        path = f"sso.groups[{index}]"
        try:
            line = SsoGroupModel.model_validate(item)
        except ValidationError as exc:
            errors += problems(exc, at=("sso", "groups", index))
            continue
        if line.team is not None and line.team not in declared:
            known = ", ".join(sorted(declared)) or "none"
            errors.append(f"{path}.team: no team {line.team!r} in `teams` (declared: {known})")
            continue
        spec = SsoGroupSpec(group=line.group, role=SsoRole(line.role), team=line.team)
        if spec.key in specs:
            errors.append(f"{path}: the same line as {specs[spec.key]}")
            continue
        specs[spec.key] = path
        lines.append(spec)
    return tuple(lines)


def _drivers(errors: list[str], value: Any) -> dict[str, dict[str, Any]]:
    """The `drivers:` section: driver name -> profile spec, each checked by
    `inventory.profiles.validate_spec` with errors at their path in the file."""
    if not isinstance(value, dict):
        errors.append(f"drivers: must be a mapping of driver name to profile, got {kind(value)}")
        return {}
    drivers = {}
    for name, spec in value.items():
        path = f"drivers.{name}"
        if not is_driver_name(name):
            errors.append(
                f"{path}: not a DRA driver name (lowercase DNS subdomain, at most 63 characters)"
            )
            continue
        try:
            drivers[name] = validate_spec(spec, path)
        except ProfileError as exc:
            errors.append(f"{exc.path}: {exc.problem}")
    return drivers


def _present_device_classes() -> set[str] | None:
    """Names of the present DeviceClasses of every cluster; None if the inventory has none."""
    if not DeviceClass.objects.exists():
        return None
    return set(DeviceClass.objects.filter(gone_at__isnull=True).values_list("name", flat=True))


def _overlaps(rates: tuple[RateSpec, ...]) -> list[str]:
    """One price per product and profile on any day, whatever its currency: a GPU-hour is
    priced by the one card valid that day (two would make the statement's currency a toss)."""
    errors = []
    declared: dict[tuple[str, str], list[RateSpec]] = defaultdict(list)
    for rate in rates:
        same = declared[rate.key[:2]]
        for other in same:
            if overlap(rate.valid_from, rate.valid_until, other.valid_from, other.valid_until):
                errors.append(
                    f"{rate.path}: valid {rate.validity()}, which overlaps {other.path} (valid "
                    f"{other.validity()}) for the same productName and profile (one price a "
                    "day, in any currency)"
                )
        same.append(rate)
    return errors


def _strings(items: list[Any], key: str) -> list[tuple[str, int]]:
    """(value, index) of each mapping among `items` whose `key` is a string."""
    return [
        (item[key], index)
        for index, item in enumerate(items)
        if isinstance(item, dict) and isinstance(item.get(key), str)
    ]


def _string_items(team: dict[str, Any], key: str) -> list[tuple[int, str]]:
    value = team.get(key)
    if not isinstance(value, list):
        return []
    return [(index, item) for index, item in enumerate(value) if isinstance(item, str)]


def _counted(rule: Any) -> bool:
    """Whether a rule entry has its one limit right: only such a rule's name is weighed for
    duplicates (one without a limit is reported for that alone)."""
    if not isinstance(rule, dict) or ("gpus" in rule) == ("memory" in rule):
        return False
    try:
        RuleModel.model_validate(
            {
                "name": "x",
                "deviceClass": "x",
                **{k: rule[k] for k in ("gpus", "memory") if k in rule},
            }
        )
    except ValidationError:
        return False
    return True


def _duplicates(teams: list[Any]) -> list[str]:
    """Slugs and namespaces once in the file; rule names once per team; a user once per team
    (as a lead or a member). Read from the entries as written, whatever else is wrong in them."""
    errors = []
    slugs: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    for index, team in enumerate(teams):
        if not isinstance(team, dict):
            continue
        path = f"teams[{index}]"
        seen: dict[str, str] = {}
        for key in ("leads", "members"):
            for item_index, username in _string_items(team, key):
                item_path = f"{path}.{key}[{item_index}]"
                if username in seen:
                    errors.append(
                        f"{item_path}: {username!r} is already listed at {seen[username]}"
                    )
                seen.setdefault(username, item_path)
        slug = str(team["slug"]) if isinstance(team.get("slug"), str) else ""
        if slug in slugs:
            errors.append(f"{path}.slug: duplicate slug {slug!r} (also {slugs[slug]})")
        slugs.setdefault(slug, path)
        for item_index, namespace in _string_items(team, "namespaces"):
            item_path = f"{path}.namespaces[{item_index}]"
            if namespace in namespaces:
                errors.append(
                    f"{item_path}: namespace {namespace!r} is also claimed by "
                    f"{namespaces[namespace]}"
                )
            namespaces.setdefault(namespace, item_path)
        quotas = team.get("quotas")
        rule_names: dict[str, str] = {}
        for rule_index, rule in enumerate(quotas if isinstance(quotas, list) else []):
            if not _counted(rule):
                continue
            name = str(rule["name"]) if isinstance(rule.get("name"), str) else ""
            rule_path = f"{path}.quotas[{rule_index}]"
            if name in rule_names:
                errors.append(
                    f"{rule_path}.name: duplicate rule name {name!r} (also {rule_names[name]})"
                )
            rule_names.setdefault(name, rule_path)
    return errors
