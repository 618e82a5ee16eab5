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
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from inventory.models import Cluster, VersionBaseline, VersionDeviation
from inventory.profiles import is_driver_name
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


class _Section:
    """Reads one mapping of the section, collecting errors named by their path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors

    def mapping(self, value: Any, path: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.errors.append(f"{path}: must be a mapping, got {_kind(value)}")
            return None
        for key in value:
            if key not in keys:
                self.errors.append(f"{path}: unknown key {key!r}")
        return value

    def string(
        self,
        mapping: dict[str, Any],
        key: str,
        path: str,
        *,
        max_length: int,
        required: bool = False,
    ) -> str:
        value = mapping.get(key, "")
        if isinstance(value, int | float) and not isinstance(value, bool) and "Version" in key:
            # `cudaDriverVersion: 12.8` reads as a number: the text as written is meant (the
            # policy file's loader keeps it, `13.10` the number 13.1 is "13.10").
            value = getattr(value, "written", str(value))
        if not isinstance(value, str):
            self.errors.append(f"{path}.{key}: must be a string, got {_kind(value)}")
            return ""
        value = value.strip()
        if required and not value:
            self.errors.append(f"{path}.{key}: required")
        if len(value) > max_length:
            self.errors.append(f"{path}.{key}: longer than {max_length} characters")
        return value

    def version(self, mapping: dict[str, Any], key: str, path: str) -> str:
        """A version as written (kept for display), refused when it is no version."""
        value = self.string(mapping, key, path, max_length=64)
        if error := version_error(value):
            self.errors.append(f"{path}.{key}: {error}")
        return value

    def version_pair(self, mapping: dict[str, Any], path: str) -> tuple[str, str]:
        """The driver and CUDA versions a baseline or deviation pins: at least one of them."""
        driver = self.version(mapping, "driverVersion", path)
        cuda = self.version(mapping, "cudaDriverVersion", path)
        if not driver and not cuda:
            self.errors.append(f"{path}: give driverVersion, cudaDriverVersion or both")
        return driver, cuda

    def driver(self, mapping: dict[str, Any], path: str) -> str:
        name = self.string(mapping, "driver", path, max_length=253)
        if name and not is_driver_name(name):
            self.errors.append(f"{path}.driver: {name!r} is not a DRA driver name (a DNS name)")
        return name

    def cluster(self, mapping: dict[str, Any], path: str) -> str:
        name = self.string(mapping, "cluster", path, max_length=63) or settings.TALLY_CLUSTER_NAME
        try:
            validate_slug(name)
        except ValidationError:
            self.errors.append(f"{path}.cluster: {name!r} is not a cluster name (a slug)")
        return name


def parse_version_policy(value: Any, path: str) -> tuple[VersionPolicy, list[str]]:
    """Check the policy file's `versions:` section (`value`, found at `path`); returns the
    specs and every error, each named by its path (`versions.deviations[0].expires: ...`).

    Reads nothing from the database: clusters named are created when applied, as the sync
    creates them.
    """
    errors: list[str] = []
    section = _Section(errors)
    top = section.mapping(value, path, _SECTION_KEYS)
    if top is None:
        return VersionPolicy(), errors
    baselines = [
        spec
        for index, item in enumerate(_list(top, "baselines", path, errors))
        if (spec := _baseline_spec(section, item, f"{path}.baselines[{index}]")) is not None
    ]
    deviations = [
        deviation
        for index, item in enumerate(_list(top, "deviations", path, errors))
        if (deviation := _deviation_spec(section, item, f"{path}.deviations[{index}]")) is not None
    ]
    _check_unique([(spec.path, spec.key) for spec in baselines], "baseline", errors)
    _check_unique([(spec.path, spec.key) for spec in deviations], "deviation", errors)
    return VersionPolicy(baselines=tuple(baselines), deviations=tuple(deviations)), errors


def _check_unique(
    declared: list[tuple[str, tuple[str, ...]]], what: str, errors: list[str]
) -> None:
    first: dict[tuple[str, ...], str] = {}
    for path, key in declared:
        if key in first:
            errors.append(f"{path}: the same {what} as {first[key]}")
        first.setdefault(key, path)


def _list(top: dict[str, Any], key: str, path: str, errors: list[str]) -> list[Any]:
    value = top.get(key, [])
    if value is None:
        return []
    if not isinstance(value, list):
        errors.append(f"{path}.{key}: must be a list, got {_kind(value)}")
        return []
    return value


def _baseline_spec(section: _Section, value: Any, path: str) -> BaselineSpec | None:
    mapping = section.mapping(value, path, _BASELINE_KEYS)
    if mapping is None:
        return None
    before = len(section.errors)
    dra_driver = section.driver(mapping, path)
    product = section.string(mapping, "productName", path, max_length=253)
    architecture = section.string(mapping, "architecture", path, max_length=64)
    driver, cuda = section.version_pair(mapping, path)
    if product and architecture:
        section.errors.append(
            f"{path}: give productName or architecture (or neither: the whole cluster), not both"
        )
    spec = BaselineSpec(
        path=path,
        cluster=section.cluster(mapping, path),
        driver=dra_driver,
        product_name=product,
        architecture=architecture,
        driver_version=driver,
        cuda_driver_version=cuda,
        note=section.string(mapping, "note", path, max_length=10_000),
    )
    return spec if len(section.errors) == before else None


def _deviation_spec(section: _Section, value: Any, path: str) -> DeviationSpec | None:
    mapping = section.mapping(value, path, _DEVIATION_KEYS)
    if mapping is None:
        return None
    before = len(section.errors)
    dra_driver = section.driver(mapping, path)
    node = section.string(mapping, "node", path, max_length=253)
    pool = section.string(mapping, "pool", path, max_length=253)
    driver, cuda = section.version_pair(mapping, path)
    if not node and not pool:
        section.errors.append(f"{path}: give node, pool or both")
    reason = section.string(mapping, "reason", path, max_length=10_000, required=True)
    owner = section.string(mapping, "owner", path, max_length=253, required=True)
    expires = _expiry(mapping.get("expires"))
    if expires is None:
        section.errors.append(
            f"{path}.expires: required, a date (2027-01-31: expires at its start, UTC) "
            "or a date and time"
        )
    spec_cluster = section.cluster(mapping, path)
    if len(section.errors) != before or expires is None:
        return None
    return DeviationSpec(
        path=path,
        cluster=spec_cluster,
        driver=dra_driver,
        node_name=node,
        pool=pool,
        driver_version=driver,
        cuda_driver_version=cuda,
        reason=reason,
        owner=owner,
        expires_at=expires,
    )


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
