"""The policy file's `versions:` section: version baselines and documented deviations as
code (`quota.policy` reads the file and calls these inside its transaction).

`parse_version_policy` checks the section and names every error by its path;
`apply_version_policy` makes the stored rows match it, audited; `version_policy_effects`
says what it does to the fleet (the nodes each baseline judges, the outliers it makes, what
matches nothing) and what is refused: a cluster-wide baseline naming no driver among several,
and (unless forced) one that makes most of a model's nodes outliers. Judging itself is
`inventory.versions`'s.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from typing import Annotated, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
)
from pydantic import ValidationError as PydanticValidationError

from inventory.models import Cluster, VersionBaseline, VersionDeviation
from inventory.profiles import is_driver_name
from inventory.schemas import PROBLEM, problem, problems
from inventory.version_numbers import version_error
from inventory.versions import POLICY_SOURCE, ModelVersions, VersionMatrix
from teams import audit
from teams.models import AuditEntry

_SECTION_KEYS = ("baselines", "deviations")
_BASELINE_KEYS = (
    "cluster",
    "driver",
    "productName",
    "architecture",
    "driverVersion",
    "cudaDriverVersion",
    "note",
)
_DEVIATION_KEYS = (
    "cluster",
    "driver",
    "node",
    "pool",
    "driverVersion",
    "cudaDriverVersion",
    "reason",
    "owner",
    "expires",
)


@dataclass(frozen=True)
class BaselineSpec:
    path: str
    cluster: str
    driver: str
    product_name: str
    architecture: str
    driver_version: str
    cuda_driver_version: str
    note: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.cluster, self.driver, self.product_name, self.architecture)


@dataclass(frozen=True)
class DeviationSpec:
    path: str
    cluster: str
    driver: str
    node_name: str
    pool: str
    driver_version: str
    cuda_driver_version: str
    reason: str
    owner: str
    expires_at: datetime

    @property
    def key(self) -> tuple[str, str, str, str, str, str]:
        return (
            self.cluster,
            self.driver,
            self.node_name,
            self.pool,
            self.driver_version,
            self.cuda_driver_version,
        )


@dataclass(frozen=True)
class VersionPolicy:
    """The `versions:` section as declared."""

    baselines: tuple[BaselineSpec, ...] = ()
    deviations: tuple[DeviationSpec, ...] = ()


@dataclass
class VersionPolicyChanges:
    """What `apply_version_policy` wrote (its audit entries) and what it left, with why."""

    entries: list[AuditEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The stored row (pk) of each declared baseline and deviation, by its spec's path.
    rows: dict[str, int] = field(default_factory=dict)


def _as_written(value: Any) -> Any:
    """`cudaDriverVersion: 12.8` reads as a number: the text as written is meant (the policy
    file's loader keeps it, `13.10` the number 13.1 is "13.10")."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return getattr(value, "written", str(value))
    return value


def _text(max_length: int, *, required: bool = False) -> Callable[[str], str]:
    """The check of a string: stripped, at most `max_length` characters; `required`: not
    empty."""

    def check(value: str) -> str:
        value = value.strip()
        if required and not value:
            raise problem("required")
        if len(value) > max_length:
            raise problem(f"longer than {max_length} characters")
        return value

    return check


def _version(value: str) -> str:
    """A version as written (kept for display), refused when it is no version."""
    if error := version_error(value):
        raise problem(error)
    return value


def _driver(name: str) -> str:
    if name and not is_driver_name(name):
        raise problem(f"{name!r} is not a DRA driver name (a DNS name)")
    return name


def _cluster(name: str) -> str:
    name = name or settings.TALLY_CLUSTER_NAME
    try:
        validate_slug(name)
    except ValidationError:
        raise problem(f"{name!r} is not a cluster name (a slug)") from None
    return name


def _expires(value: Any) -> datetime:
    expires = _expiry(value)
    if expires is None:
        raise problem("required, a date (2027-01-31: expires at its start, UTC) or a date and time")
    return expires


_Text63 = Annotated[str, Strict(), AfterValidator(_text(63))]
_Text64 = Annotated[str, Strict(), AfterValidator(_text(64))]
_Text253 = Annotated[str, Strict(), AfterValidator(_text(253))]
_Note = Annotated[str, Strict(), AfterValidator(_text(10_000))]
_Reason = Annotated[str, Strict(), AfterValidator(_text(10_000, required=True))]
_Owner = Annotated[str, Strict(), AfterValidator(_text(253, required=True))]
_Version = Annotated[_Text64, BeforeValidator(_as_written), AfterValidator(_version)]
_Driver = Annotated[_Text253, AfterValidator(_driver)]
_Cluster = Annotated[_Text63, AfterValidator(_cluster)]
_GIVEN = Field(default="", validate_default=True)


class _Baseline(BaseModel):
    """One of `versions.baselines`: the pair a cluster's GPUs (of a driver, a model or an
    architecture) should run."""

    model_config = ConfigDict(extra="forbid")

    driver: _Driver = ""
    product_name: _Text253 = Field(default="", alias="productName")
    architecture: _Text64 = ""
    driver_version: _Version = Field(default="", alias="driverVersion")
    cuda_driver_version: _Version = Field(default="", alias="cudaDriverVersion")
    cluster: _Cluster = _GIVEN
    note: _Note = ""


class _Deviation(BaseModel):
    """One of `versions.deviations`: a node or pool documented to run another pair."""

    model_config = ConfigDict(extra="forbid")

    driver: _Driver = ""
    node_name: _Text253 = Field(default="", alias="node")
    pool: _Text253 = ""
    driver_version: _Version = Field(default="", alias="driverVersion")
    cuda_driver_version: _Version = Field(default="", alias="cudaDriverVersion")
    reason: _Reason = _GIVEN
    owner: _Owner = _GIVEN
    expires_at: Annotated[datetime, PlainValidator(_expires)] = Field(
        default=None, alias="expires", validate_default=True
    )
    cluster: _Cluster = _GIVEN


class _Top(BaseModel):
    model_config = ConfigDict(extra="forbid")

    baselines: Annotated[list[Any], Strict()] | None = None
    deviations: Annotated[list[Any], Strict()] | None = None


def _given(mapping: Any, key: str) -> str:
    """What the section reads for `key` of an item where its own check failed: nothing."""
    value = _as_written(mapping.get(key, "")) if isinstance(mapping, dict) else ""
    return value.strip() if isinstance(value, str) else ""


# Checks across an item's fields, each after the field named (the order errors are listed in).
_PAIR = "give driverVersion, cudaDriverVersion or both"


def _no_pair(item: dict[str, Any]) -> bool:
    return not _given(item, "driverVersion") and not _given(item, "cudaDriverVersion")


def _model_and_architecture(item: dict[str, Any]) -> bool:
    return bool(_given(item, "productName") and _given(item, "architecture"))


def _no_node_or_pool(item: dict[str, Any]) -> bool:
    return not _given(item, "node") and not _given(item, "pool")


_CROSS: dict[type[BaseModel], list[tuple[str, Callable[[dict[str, Any]], bool], str]]] = {
    _Baseline: [
        ("cudaDriverVersion", _no_pair, _PAIR),
        (
            "cudaDriverVersion",
            _model_and_architecture,
            "give productName or architecture (or neither: the whole cluster), not both",
        ),
    ],
    _Deviation: [
        ("cudaDriverVersion", _no_pair, _PAIR),
        ("cudaDriverVersion", _no_node_or_pool, "give node, pool or both"),
    ],
}


def _item(
    model: type[_Baseline] | type[_Deviation], value: Any, path: str, errors: list[str]
) -> Any:
    """`value` checked by `model`, or None with its errors (named by path) added to `errors`,
    in the order the item is read: unknown keys, then each field and the checks across them."""
    # Errors name a field by its key in the file (a default validated: by its own name).
    keys = {name: field.alias or name for name, field in model.model_fields.items()}
    order = list(keys.values())
    found: list[tuple[tuple[int, int, int], str]] = []
    checked = None
    try:
        checked = model.model_validate(value)
    except PydanticValidationError as exc:
        for index, error in enumerate(problems(exc)):
            if not error.loc:
                found.append(((0, 0, index), f"{path}: must be a mapping, got {_kind(value)}"))
            elif error.kind in ("extra_forbidden", "invalid_key"):
                key = error.loc[0] if error.kind == "extra_forbidden" else error.input
                found.append(((1, 0, index), f"{path}: unknown key {key!r}"))
            else:
                key = keys.get(str(error.loc[0]), str(error.loc[0]))
                message = (
                    error.message
                    if error.kind == PROBLEM
                    else (f"must be a string, got {_kind(error.input)}")
                )
                found.append(((2, order.index(key), 2 * index), f"{path}.{key}: {message}"))
    if isinstance(value, dict):
        for index, (after, fails, message) in enumerate(_CROSS[model]):
            if fails(value):
                found.append(((2, order.index(after), 2 * index + 1 + 1000), f"{path}: {message}"))
    errors.extend(message for _, message in sorted(found))
    return checked if not found else None


def parse_version_policy(value: Any, path: str) -> tuple[VersionPolicy, list[str]]:
    """Check the policy file's `versions:` section (`value`, found at `path`); returns the
    specs and every error, each named by its path (`versions.deviations[0].expires: ...`).

    Reads nothing from the database: clusters named are created when applied, as the sync
    creates them.
    """
    errors: list[str] = []
    if not isinstance(value, dict):
        return VersionPolicy(), [f"{path}: must be a mapping, got {_kind(value)}"]
    lists: dict[str, list[Any]] = {"baselines": [], "deviations": []}
    wrong: dict[str, str] = {}
    try:
        top = _Top.model_validate(value)
        lists = {key: getattr(top, key) or [] for key in lists}
    except PydanticValidationError as exc:
        for error in problems(exc):
            key = error.loc[0] if error.kind == "extra_forbidden" else None
            if error.kind == "invalid_key":
                key = error.input
            if key is not None and key not in lists:
                errors.append(f"{path}: unknown key {key!r}")
            else:
                wrong[str(error.loc[0])] = (
                    f"{path}.{error.loc[0]}: must be a list, got {_kind(error.input)}"
                )
        for key in lists:
            if key not in wrong and isinstance(value.get(key), list):
                lists[key] = value[key]
    baselines = [
        BaselineSpec(path=where, **checked.model_dump())
        for where, checked in _items(_Baseline, lists, "baselines", path, wrong, errors)
    ]
    deviations = [
        DeviationSpec(path=where, **checked.model_dump())
        for where, checked in _items(_Deviation, lists, "deviations", path, wrong, errors)
    ]
    _check_unique([(spec.path, spec.key) for spec in baselines], "baseline", errors)
    _check_unique([(spec.path, spec.key) for spec in deviations], "deviation", errors)
    return VersionPolicy(baselines=tuple(baselines), deviations=tuple(deviations)), errors


def _items(
    model: type[_Baseline] | type[_Deviation],
    lists: dict[str, list[Any]],
    key: str,
    path: str,
    wrong: dict[str, str],
    errors: list[str],
) -> list[tuple[str, Any]]:
    """The items of the list `key` that pass `model`, each with its path; the list's own error
    (not a list) and each failing item's go to `errors`. Each spec holds its model's fields
    under the same names, plus its path."""
    if key in wrong:
        errors.append(wrong[key])
    found = []
    for index, item in enumerate(lists[key]):
        where = f"{path}.{key}[{index}]"
        if (checked := _item(model, item, where, errors)) is not None:
            found.append((where, checked))
    return found


def _check_unique(
    declared: list[tuple[str, tuple[str, ...]]], what: str, errors: list[str]
) -> None:
    first: dict[tuple[str, ...], str] = {}
    for path, key in declared:
        if key in first:
            errors.append(f"{path}: the same {what} as {first[key]}")
        first.setdefault(key, path)


def _expiry(value: Any) -> datetime | None:
    """An aware datetime from a YAML date or timestamp, or ISO text; naive means UTC."""
    if isinstance(value, str):
        try:
            value = parse_datetime(value.strip()) or parse_date(value.strip())
        except ValueError:  # well formed, no such day or hour: 2027-02-30, T25:00
            return None
    if isinstance(value, datetime):
        # In UTC, as stored: the audit compares it as text, so a zone alone is no change.
        return value.astimezone(UTC) if timezone.is_aware(value) else value.replace(tzinfo=UTC)
    if isinstance(value, date):
        return datetime.combine(value, time(), tzinfo=UTC)
    return None


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def apply_version_policy(*, specs: VersionPolicy, actor: str, prune: bool) -> VersionPolicyChanges:
    """Make the baselines and deviations of the policy file match `specs`, audited as `actor`.

    A declared baseline takes over the row of its scope (written in the admin too); a
    declared deviation the row with its cluster, node, pool and pair. Rows the file wrote
    before (source "policy") and no longer declares are deleted with `prune`, else kept with
    a note; rows written in the admin are never the file's to delete. Call it inside the
    policy's transaction: applying the same specs again writes nothing. A deviation that has
    already expired is stored all the same (it documents what was allowed until then) with a
    warning among the notes naming it: it documents nothing now, so its GPUs are outliers.
    """
    changes = VersionPolicyChanges()
    now = timezone.now()
    for dspec in specs.deviations:
        if not dspec.expires_at > now:
            # Kept, as it documents what was allowed until then; it documents nothing now.
            changes.notes.append(
                f"warning: {dspec.path} (cluster {dspec.cluster}, "
                f"{dspec.node_name or dspec.pool}) expired at {dspec.expires_at.isoformat()}: "
                "stored as history, its GPUs count as outliers"
            )
    clusters = {
        name: Cluster.objects.get_or_create(name=name)[0]
        for name in sorted(
            {spec.cluster for spec in specs.baselines} | {spec.cluster for spec in specs.deviations}
        )
    }
    with transaction.atomic():
        stored_baselines = {
            (row.cluster.name, row.driver, row.product_name, row.architecture): row
            for row in VersionBaseline.objects.select_related("cluster").select_for_update()
        }
        for spec in specs.baselines:
            changes.rows[spec.path] = _put(
                changes,
                stored_baselines.pop(spec.key, None),
                VersionBaseline,
                identity={
                    "cluster": clusters[spec.cluster],
                    "driver": spec.driver,
                    "product_name": spec.product_name,
                    "architecture": spec.architecture,
                },
                values={
                    "driver_version": spec.driver_version,
                    "cuda_driver_version": spec.cuda_driver_version,
                    "note": spec.note,
                    "source": POLICY_SOURCE,
                },
                actor=actor,
            )
        stored_deviations: dict[tuple[str, ...], list[VersionDeviation]] = defaultdict(list)
        for row in VersionDeviation.objects.select_related("cluster").select_for_update():
            key = (row.cluster.name, row.driver, row.node_name, row.pool)
            stored_deviations[(*key, row.driver_version, row.cuda_driver_version)].append(row)
        for dspec in specs.deviations:
            # One identity written twice (by the file and in the admin): the file's row first.
            rows = sorted(
                stored_deviations.get(dspec.key, []), key=lambda r: r.source != POLICY_SOURCE
            )
            if rows:
                stored_deviations[dspec.key].remove(rows[0])
            changes.rows[dspec.path] = _put(
                changes,
                rows[0] if rows else None,
                VersionDeviation,
                identity={
                    "cluster": clusters[dspec.cluster],
                    "driver": dspec.driver,
                    "node_name": dspec.node_name,
                    "pool": dspec.pool,
                    "driver_version": dspec.driver_version,
                    "cuda_driver_version": dspec.cuda_driver_version,
                },
                values={
                    "reason": dspec.reason,
                    "owner": dspec.owner,
                    "expires_at": dspec.expires_at,
                    "source": POLICY_SOURCE,
                },
                actor=actor,
            )
        undeclared: list[VersionBaseline | VersionDeviation] = [
            *stored_baselines.values(),
            *(row for rows in stored_deviations.values() for row in rows),
        ]
        for obj in undeclared:
            if obj.source != POLICY_SOURCE:
                continue
            if prune:
                changes.entries += audit.delete(actor=actor, obj=obj)
            else:
                changes.notes.append(
                    f"kept {obj._meta.verbose_name} {obj}: not declared (--prune deletes it)"
                )
    return changes


def _put(
    changes: VersionPolicyChanges,
    obj: Any,
    model: type[VersionBaseline] | type[VersionDeviation],
    *,
    identity: dict[str, Any],
    values: dict[str, Any],
    actor: str,
) -> int:
    """Create `model(**identity, **values)` when `obj` (the stored one) is None, else set
    `values` on it and save what changed; audited either way. Returns the row's pk."""
    if obj is None:
        obj = model(**identity, **values)
        entry: AuditEntry | None = audit.create(actor=actor, obj=obj)
    else:
        before = audit.snapshot(obj)
        for name, value in values.items():
            setattr(obj, name, value)
        entry = audit.update(actor=actor, obj=obj, before=before)
    if entry is not None:
        changes.entries.append(entry)
    return int(obj.pk)


@dataclass
class VersionPolicyEffects:
    """What a `versions:` section does to the fleet (`version_policy_effects`)."""

    # Per declared baseline: the nodes it judges and the outliers it makes.
    lines: list[str] = field(default_factory=list)
    # Baselines or deviations that match no node, and ambiguous baselines: each named.
    warnings: list[str] = field(default_factory=list)
    # Models the section would make mostly outliers: refused unless forced.
    refusals: list[str] = field(default_factory=list)
    # What is refused whatever: a cluster-wide baseline naming no driver among several.
    errors: list[str] = field(default_factory=list)


def version_policy_effects(
    *, specs: VersionPolicy, rows: dict[str, int], before: VersionMatrix, after: VersionMatrix
) -> VersionPolicyEffects:
    """What `specs` (stored as `rows`: spec path -> pk) does, comparing the matrix of every
    cluster `before` and `after` it was applied.

    A change that leaves more than half of a model's nodes in a cluster undocumented outliers,
    more than before, is refused: a baseline that stops most of a model is far more often a
    typo than a fleet out of line, and the taints would follow it.
    """
    effects = VersionPolicyEffects()
    drivers: dict[str, set[str]] = defaultdict(set)
    for model in after["models"]:
        drivers[model["cluster"]].add(model["driver"])
    for spec in specs.baselines:
        several = sorted(drivers[spec.cluster])
        if not (spec.driver or spec.product_name or spec.architecture) and len(several) > 1:
            effects.errors.append(
                f"{spec.path}: cluster {spec.cluster} has devices of {len(several)} drivers "
                f"({', '.join(several)}), so a cluster-wide baseline names the one it judges "
                f"(driver: {several[0]})"
            )
            continue
        judged = [m for m in after["models"] if m["baseline"]["row_id"] == rows.get(spec.path)]
        what = _describe(spec.cluster, spec.driver, spec.product_name or spec.architecture)
        if not judged:
            effects.warnings.append(
                f"warning: {spec.path} ({what}) matches no node: no GPU there publishes a "
                "version for it to judge (check cluster, driver, productName, architecture)"
            )
            continue
        nodes = sorted({node for model in judged for node in model["nodes"]})
        outliers = sorted({node for model in judged for node in _outlier_nodes(model)})
        effects.lines.append(
            f"{spec.path} ({what}): judges {len(nodes)} node(s) of "
            f"{', '.join(sorted({m['product_name'] or 'unknown model' for m in judged}))}; "
            + (f"outliers: {', '.join(outliers)}" if outliers else "no outliers")
        )
    documented = {
        outlier["deviation"]["id"]
        for model in after["models"]
        for outlier in model["outliers"]
        if outlier["deviation"] is not None
    }
    now = timezone.now()
    for dspec in specs.deviations:
        # An expired one is warned of as such (`apply_version_policy`).
        if rows.get(dspec.path) not in documented and dspec.expires_at > now:
            what = _describe(dspec.cluster, dspec.driver, dspec.node_name or dspec.pool)
            effects.warnings.append(
                f"warning: {dspec.path} ({what}) matches no node's GPUs off their baseline: it "
                "documents nothing (check node, pool, versions, expiry)"
            )
    if not effects.errors:
        effects.warnings += [f"warning: {text}" for text in after["ambiguous"]]
    was = {_model_key(model): set(_outlier_nodes(model)) for model in before["models"]}
    for model in after["models"]:
        straying = set(_outlier_nodes(model))
        if len(straying) * 2 > len(model["nodes"]) and not straying <= was.get(
            _model_key(model), set()
        ):
            baseline = model["baseline"]
            effects.refusals.append(
                f"versions: {len(straying)} of {len(model['nodes'])} nodes of "
                f"{model['product_name'] or 'unknown model'} ({model['driver']}) in cluster "
                f"{model['cluster']} would be outliers of driver "
                f"{baseline['driver_version'] or 'any'}, CUDA "
                f"{baseline['cuda_driver_version'] or 'any'} ({', '.join(sorted(straying))}); "
                "more than half of a model is more often a mistyped baseline than a fleet out "
                "of line: check the versions (they run "
                + ", ".join(
                    sorted({o["driver_version"] for o in model["outliers"] if not o["deviation"]})
                )
                + "), or apply with --force"
            )
    return effects


def _describe(cluster: str, driver: str, scope: str) -> str:
    return ", ".join(part for part in (f"cluster {cluster}", driver, scope) if part)


def _outlier_nodes(model: ModelVersions) -> list[str]:
    """The nodes (or pools, for GPUs of no node) of `model` with undocumented outliers."""
    return sorted(
        {o["node"] or f"pool {o['pool']}" for o in model["outliers"] if o["deviation"] is None}
    )


def _model_key(model: ModelVersions) -> tuple[str, str, str]:
    return (model["cluster"], model["driver"], model["product_name"])
