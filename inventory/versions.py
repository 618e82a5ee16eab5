"""Version baselines per cluster and GPU model, and the register of documented deviations.

A fleet mixes models (DGX nodes of eight H100s beside VMs with one vGPU), and each model has
its own validated driver/CUDA pair; a node-count majority over the whole cluster lets four
one-GPU VMs out-vote three eight-GPU nodes. So a baseline applies per cluster and model:

- set: the most specific `VersionBaseline` row of the cluster that matches the model (its
  product name, then its architecture, then the cluster-wide row with neither); an empty
  version in a row matches any value, so an operator may pin the driver only;
- else computed: the pair held by the most physical GPUs of that model in that cluster, ties
  to the newest driver, then the newest CUDA version.

A GPU on another pair is an outlier, unless a `VersionDeviation` documents it: same cluster,
its node and/or pool, the pair it runs (an empty version matches any), not yet expired.
Documented deviations are shown as such and kept out of general scheduling by a taint that
validation workloads tolerate (`inventory.taints`); an expired one counts as undocumented.

Baselines and deviations are written here, each write audited (`teams.audit`): by the admin,
and by the policy file's `versions:` section (`parse_version_policy`, `apply_version_policy`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from typing import Any, TypedDict

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import transaction
from django.db.models import Count, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from inventory.models import Cluster, Device, DeviceKind, VersionBaseline, VersionDeviation
from teams import audit
from teams.models import AuditEntry

SET = "set"
COMPUTED = "computed"
# What a set baseline was found by, most specific first.
SCOPES = ("product", "architecture", "cluster")
POLICY_SOURCE = "policy"
ADMIN_SOURCE = "admin"


class VersionPair(TypedDict):
    driver_version: str
    cuda_driver_version: str


class Baseline(VersionPair):
    # "set" (a VersionBaseline row) or "computed" (the pair on the most GPUs of the model).
    source: str
    # For a set baseline, the row's scope: "product", "architecture" or "cluster"; else "".
    scope: str


class DeviationInfo(TypedDict):
    id: int
    cluster: str
    node_name: str
    pool: str
    driver_version: str
    cuda_driver_version: str
    reason: str
    owner: str
    expires_at: datetime
    expired: bool


class Outlier(TypedDict):
    """GPUs of one model on one node and pool running a pair other than their baseline."""

    cluster: str
    node: str  # "" for devices without a node (multi-node pools)
    driver: str
    pool: str
    product_name: str
    driver_version: str
    cuda_driver_version: str
    gpus: int
    # The deviation that documents them; None: undocumented (or its deviation expired).
    deviation: DeviationInfo | None


class ModelVersions(TypedDict):
    """One model of one cluster: its baseline, the nodes and GPUs on it, and the outliers."""

    cluster: str
    product_name: str
    architecture: str
    baseline: Baseline
    gpus: int
    nodes_on_baseline: list[str]
    gpus_on_baseline: int
    outliers: list[Outlier]


class VersionRow(TypedDict):
    """One driver/CUDA pair of one model in one cluster."""

    cluster: str
    product_name: str
    architecture: str
    driver_version: str
    cuda_driver_version: str
    nodes: list[str]
    gpus: int
    baseline: bool
    # Of `nodes`: those whose GPUs on this pair a deviation documents, and those it does not.
    documented_nodes: list[str]
    outlier_nodes: list[str]


class VersionMatrix(TypedDict):
    rows: list[VersionRow]
    models: list[ModelVersions]
    # The requested cluster's baseline when all its models share one, else None (also when
    # all clusters are covered); `baselines` the same per cluster covered.
    baseline: Baseline | None
    baselines: dict[str, Baseline | None]
    # Nodes with an undocumented outlier GPU; nodes whose outliers are all documented.
    outlier_nodes: list[str]
    documented_nodes: list[str]
    # Every deviation of the clusters covered, expired ones included, by cluster and expiry.
    deviations: list[DeviationInfo]


@dataclass(frozen=True)
class _Group:
    """Present GPUs of one cluster, node, pool, model and pair (one aggregate row)."""

    cluster_id: int
    cluster: str
    node: str
    driver: str
    pool: str
    product_name: str
    architecture: str
    driver_version: str
    cuda_driver_version: str
    gpus: int


def version_matrix(*, cluster: Cluster | None = None, at: datetime | None = None) -> VersionMatrix:
    """Per cluster and model: the baseline (set or computed), the nodes and GPUs on it and
    the outliers, each documented by a deviation active at `at` (default now) or not.

    Devices that publish no driver version (VFIO passthrough) are left out. GPUs are physical
    units (distinct `physical_gpu_key`), so a MIG device or partition never counts apart from
    its GPU. When `cluster` is None every cluster is covered and node names are written
    `cluster/node`. Rows: by cluster, then model, then newest pair first.
    """
    at = at or timezone.now()
    qualify = cluster is None
    clusters = [cluster] if cluster is not None else list(Cluster.objects.order_by("name"))
    groups = _groups(cluster)
    set_rows = _baseline_rows(cluster)
    deviations = _deviations(cluster)

    def label(group: _Group) -> str:
        if not group.node:
            return ""
        return f"{group.cluster}/{group.node}" if qualify else group.node

    by_model: dict[tuple[int, str], list[_Group]] = defaultdict(list)
    for group in groups:
        by_model[(group.cluster_id, group.product_name)].append(group)

    models: list[ModelVersions] = []
    rows: list[VersionRow] = []
    outlier_nodes: set[str] = set()
    documented_nodes: set[str] = set()
    for (cluster_id, product), members in sorted(
        by_model.items(), key=lambda item: (item[1][0].cluster, item[0][1])
    ):
        architecture = _architecture(members)
        baseline = resolve_baseline(
            set_rows.get(cluster_id, ()), product, architecture
        ) or _computed(members)
        model = ModelVersions(
            cluster=members[0].cluster,
            product_name=product,
            architecture=architecture,
            baseline=baseline,
            gpus=sum(group.gpus for group in members),
            nodes_on_baseline=[],
            gpus_on_baseline=0,
            outliers=[],
        )
        pair_rows: dict[tuple[str, str], VersionRow] = {}
        for group in members:
            on_baseline = matches(group.driver_version, group.cuda_driver_version, baseline)
            row = pair_rows.setdefault(
                (group.driver_version, group.cuda_driver_version),
                VersionRow(
                    cluster=group.cluster,
                    product_name=product,
                    architecture=architecture,
                    driver_version=group.driver_version,
                    cuda_driver_version=group.cuda_driver_version,
                    nodes=[],
                    gpus=0,
                    baseline=on_baseline,
                    documented_nodes=[],
                    outlier_nodes=[],
                ),
            )
            row["gpus"] += group.gpus
            node = label(group)
            if node and node not in row["nodes"]:
                row["nodes"].append(node)
            if on_baseline:
                model["gpus_on_baseline"] += group.gpus
                if node and node not in model["nodes_on_baseline"]:
                    model["nodes_on_baseline"].append(node)
                continue
            deviation = _documenting(deviations.get(cluster_id, ()), group, at)
            model["outliers"].append(
                Outlier(
                    cluster=group.cluster,
                    node=node,
                    driver=group.driver,
                    pool=group.pool,
                    product_name=product,
                    driver_version=group.driver_version,
                    cuda_driver_version=group.cuda_driver_version,
                    gpus=group.gpus,
                    deviation=deviation,
                )
            )
            if node:
                (row["documented_nodes"] if deviation else row["outlier_nodes"]).append(node)
                (documented_nodes if deviation else outlier_nodes).add(node)
        model["nodes_on_baseline"].sort()
        model["outliers"].sort(key=lambda o: (o["node"], o["driver"], o["pool"]))
        for row in pair_rows.values():
            for key in ("nodes", "documented_nodes", "outlier_nodes"):
                row[key] = sorted(set(row[key]))
        rows += sorted(
            pair_rows.values(),
            key=lambda r: _pair_key(r["driver_version"], r["cuda_driver_version"]),
            reverse=True,
        )
        models.append(model)

    baselines: dict[str, Baseline | None] = {}
    for covered in clusters:
        shared = [m["baseline"] for m in models if m["cluster"] == covered.name]
        baselines[covered.name] = shared[0] if shared and _all_same(shared) else None
    return VersionMatrix(
        rows=rows,
        models=models,
        baseline=baselines[cluster.name] if cluster is not None else None,
        baselines=baselines,
        outlier_nodes=sorted(outlier_nodes),
        # A node with an undocumented outlier is an outlier, whatever else it documents.
        documented_nodes=sorted(documented_nodes - outlier_nodes),
        deviations=[
            _deviation_info(deviation, at)
            for cluster_id in sorted(deviations, key=lambda pk: deviations[pk][0].cluster.name)
            for deviation in deviations[cluster_id]
        ],
    )


def most_common_version_pairs(*, cluster: Cluster) -> dict[str, VersionPair]:
    """Per model (product name) of `cluster`: the pair on the most of its GPUs, ignoring any
    set baseline (ties to the newest). Models whose GPUs publish no driver version are absent.
    """
    by_model: dict[str, list[_Group]] = defaultdict(list)
    for group in _groups(cluster):
        by_model[group.product_name].append(group)
    pairs = {}
    for product, members in sorted(by_model.items()):
        computed = _computed(members)
        pairs[product] = VersionPair(
            driver_version=computed["driver_version"],
            cuda_driver_version=computed["cuda_driver_version"],
        )
    return pairs


def resolve_baseline(
    rows: Iterable[VersionBaseline], product_name: str, architecture: str
) -> Baseline | None:
    """The set baseline of a model among a cluster's `rows`: the most specific that matches
    (product name, then architecture, then cluster-wide); None when none does."""
    found: dict[str, VersionBaseline] = {}
    for row in rows:
        if row.product_name:
            if row.product_name == product_name and (
                not row.architecture or row.architecture == architecture
            ):
                found["product"] = row
        elif row.architecture:
            if row.architecture == architecture:
                found["architecture"] = row
        else:
            found["cluster"] = row
    for scope in SCOPES:
        if scope in found:
            row = found[scope]
            return Baseline(
                driver_version=row.driver_version,
                cuda_driver_version=row.cuda_driver_version,
                source=SET,
                scope=scope,
            )
    return None


def matches(driver_version: str, cuda_driver_version: str, wanted: VersionPair) -> bool:
    """Whether a pair is `wanted`; an empty wanted version (pinned by no one) matches any."""
    return all(
        not expected or value == expected
        for value, expected in (
            (driver_version, wanted["driver_version"]),
            (cuda_driver_version, wanted["cuda_driver_version"]),
        )
    )


def deviation_is_active(deviation: VersionDeviation, at: datetime) -> bool:
    return deviation.expires_at > at


_VERSION_PART = re.compile(r"\d+|[^\d.\-+]+")


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders versions numerically ("580.126.20" is newer than "580.82.07")."""
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part)
        for part in _VERSION_PART.findall(version)
    )


def _pair_key(driver_version: str, cuda_driver_version: str) -> tuple[Any, ...]:
    # Distinct strings can parse alike ("580.82.07" and "580.82.7"); the text keeps it stable.
    return (
        version_key(driver_version),
        version_key(cuda_driver_version),
        driver_version,
        cuda_driver_version,
    )


def _groups(cluster: Cluster | None) -> list[_Group]:
    devices = Device.objects.filter(gone_at__isnull=True)
    if cluster is not None:
        devices = devices.filter(cluster=cluster)
    rows = (
        devices.exclude(kind=DeviceKind.OTHER)
        .exclude(physical_gpu_key="")
        .exclude(driver_version="")
        .values(
            "cluster_id",
            "cluster__name",
            "node__name",
            "driver",
            "pool",
            "product_name",
            "architecture",
            "driver_version",
            "cuda_driver_version",
        )
        .annotate(gpus=Count("physical_gpu_key", distinct=True))
        .order_by()
    )
    # A GPU's devices share node, pool, model and pair, so per-group distinct counts add up.
    return [
        _Group(
            cluster_id=row["cluster_id"],
            cluster=row["cluster__name"],
            node=row["node__name"] or "",
            driver=row["driver"],
            pool=row["pool"],
            product_name=row["product_name"],
            architecture=row["architecture"],
            driver_version=row["driver_version"],
            cuda_driver_version=row["cuda_driver_version"],
            gpus=row["gpus"],
        )
        for row in rows
    ]


def _baseline_rows(cluster: Cluster | None) -> dict[int, list[VersionBaseline]]:
    rows: QuerySet[VersionBaseline] = VersionBaseline.objects.all()
    if cluster is not None:
        rows = rows.filter(cluster=cluster)
    by_cluster: dict[int, list[VersionBaseline]] = defaultdict(list)
    for row in rows:
        by_cluster[row.cluster_id].append(row)
    return by_cluster


def _deviations(cluster: Cluster | None) -> dict[int, list[VersionDeviation]]:
    rows = VersionDeviation.objects.select_related("cluster").order_by(
        "expires_at", "node_name", "pool", "pk"
    )
    if cluster is not None:
        rows = rows.filter(cluster=cluster)
    by_cluster: dict[int, list[VersionDeviation]] = defaultdict(list)
    for row in rows:
        by_cluster[row.cluster_id].append(row)
    return by_cluster


def _documenting(
    deviations: Iterable[VersionDeviation], group: _Group, at: datetime
) -> DeviationInfo | None:
    """The active deviation covering `group` that lasts longest, if any."""
    covering = [
        deviation
        for deviation in deviations
        if deviation_is_active(deviation, at)
        and (deviation.node_name or deviation.pool)
        and (not deviation.node_name or deviation.node_name == group.node)
        and (not deviation.pool or deviation.pool == group.pool)
        and matches(group.driver_version, group.cuda_driver_version, _pair_of(deviation))
    ]
    if not covering:
        return None
    return _deviation_info(max(covering, key=lambda d: (d.expires_at, d.pk)), at)


def _pair_of(row: VersionDeviation | VersionBaseline) -> VersionPair:
    return VersionPair(
        driver_version=row.driver_version, cuda_driver_version=row.cuda_driver_version
    )


def _deviation_info(deviation: VersionDeviation, at: datetime) -> DeviationInfo:
    return DeviationInfo(
        id=deviation.pk,
        cluster=deviation.cluster.name,
        node_name=deviation.node_name,
        pool=deviation.pool,
        driver_version=deviation.driver_version,
        cuda_driver_version=deviation.cuda_driver_version,
        reason=deviation.reason,
        owner=deviation.owner,
        expires_at=deviation.expires_at,
        expired=not deviation_is_active(deviation, at),
    )


def _architecture(members: list[_Group]) -> str:
    """A model's architecture: the one most of its GPUs publish (MIG devices may not)."""
    counts: dict[str, int] = defaultdict(int)
    for group in members:
        if group.architecture:
            counts[group.architecture] += group.gpus
    return max(sorted(counts), key=lambda name: counts[name], default="")


def _computed(members: list[_Group]) -> Baseline:
    gpus: dict[tuple[str, str], int] = defaultdict(int)
    for group in members:
        gpus[(group.driver_version, group.cuda_driver_version)] += group.gpus
    driver_version, cuda_driver_version = max(
        gpus, key=lambda pair: (gpus[pair], *_pair_key(*pair))
    )
    return Baseline(
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        source=COMPUTED,
        scope="",
    )


def _all_same(baselines: list[Baseline]) -> bool:
    first = baselines[0]
    return all(
        (b["driver_version"], b["cuda_driver_version"])
        == (first["driver_version"], first["cuda_driver_version"])
        for b in baselines
    )


# --- Writes ---------------------------------------------------------------------------------


def set_baseline(
    *,
    cluster: Cluster,
    driver_version: str,
    cuda_driver_version: str,
    actor: str,
    product_name: str = "",
    architecture: str = "",
    note: str = "",
    source: str = ADMIN_SOURCE,
) -> AuditEntry | None:
    """Set the validated pair of one scope of `cluster` (a product, an architecture, or the
    whole cluster when both are empty), creating or updating its one row, audited as `actor`.

    Returns the audit entry, or None when the row already said so.
    """
    with transaction.atomic():
        row = (
            VersionBaseline.objects.select_for_update()
            .filter(cluster=cluster, product_name=product_name, architecture=architecture)
            .first()
        )
        values = {
            "driver_version": driver_version,
            "cuda_driver_version": cuda_driver_version,
            "note": note,
            "source": source,
        }
        if row is None:
            return audit.create(
                actor=actor,
                obj=VersionBaseline(
                    cluster=cluster, product_name=product_name, architecture=architecture, **values
                ),
            )
        before = audit.snapshot(row)
        for name, value in values.items():
            setattr(row, name, value)
        return audit.update(actor=actor, obj=row, before=before)


# --- The policy file's `versions:` section --------------------------------------------------

_SECTION_KEYS = ("baselines", "deviations")
_BASELINE_KEYS = (
    "cluster",
    "productName",
    "architecture",
    "driverVersion",
    "cudaDriverVersion",
    "note",
)
_DEVIATION_KEYS = (
    "cluster",
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
    product_name: str
    architecture: str
    driver_version: str
    cuda_driver_version: str
    note: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.cluster, self.product_name, self.architecture)


@dataclass(frozen=True)
class DeviationSpec:
    path: str
    cluster: str
    node_name: str
    pool: str
    driver_version: str
    cuda_driver_version: str
    reason: str
    owner: str
    expires_at: datetime

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (
            self.cluster,
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
            # `cudaDriverVersion: 12.8` reads as a number: the text as written is meant.
            value = str(value)
        if not isinstance(value, str):
            self.errors.append(f"{path}.{key}: must be a string, got {_kind(value)}")
            return ""
        value = value.strip()
        if required and not value:
            self.errors.append(f"{path}.{key}: required")
        if len(value) > max_length:
            self.errors.append(f"{path}.{key}: longer than {max_length} characters")
        return value

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
    product = section.string(mapping, "productName", path, max_length=253)
    architecture = section.string(mapping, "architecture", path, max_length=64)
    driver = section.string(mapping, "driverVersion", path, max_length=64)
    cuda = section.string(mapping, "cudaDriverVersion", path, max_length=64)
    if product and architecture:
        section.errors.append(
            f"{path}: give productName or architecture (or neither: the whole cluster), not both"
        )
    if not driver and not cuda:
        section.errors.append(f"{path}: give driverVersion, cudaDriverVersion or both")
    spec = BaselineSpec(
        path=path,
        cluster=section.cluster(mapping, path),
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
    node = section.string(mapping, "node", path, max_length=253)
    pool = section.string(mapping, "pool", path, max_length=253)
    driver = section.string(mapping, "driverVersion", path, max_length=64)
    cuda = section.string(mapping, "cudaDriverVersion", path, max_length=64)
    if not node and not pool:
        section.errors.append(f"{path}: give node, pool or both")
    if not driver and not cuda:
        section.errors.append(f"{path}: give driverVersion, cudaDriverVersion or both")
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
            (row.cluster.name, row.product_name, row.architecture): row
            for row in VersionBaseline.objects.select_related("cluster").select_for_update()
        }
        for spec in specs.baselines:
            _put(
                changes,
                stored_baselines.pop(spec.key, None),
                VersionBaseline,
                identity={
                    "cluster": clusters[spec.cluster],
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
            key = (row.cluster.name, row.node_name, row.pool)
            stored_deviations[(*key, row.driver_version, row.cuda_driver_version)].append(row)
        for dspec in specs.deviations:
            # One identity written twice (by the file and in the admin): the file's row first.
            rows = sorted(
                stored_deviations.get(dspec.key, []), key=lambda r: r.source != POLICY_SOURCE
            )
            if rows:
                stored_deviations[dspec.key].remove(rows[0])
            _put(
                changes,
                rows[0] if rows else None,
                VersionDeviation,
                identity={
                    "cluster": clusters[dspec.cluster],
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
) -> None:
    """Create `model(**identity, **values)` when `obj` (the stored one) is None, else set
    `values` on it and save what changed; audited either way."""
    if obj is None:
        entry: AuditEntry | None = audit.create(actor=actor, obj=model(**identity, **values))
    else:
        before = audit.snapshot(obj)
        for name, value in values.items():
            setattr(obj, name, value)
        entry = audit.update(actor=actor, obj=obj, before=before)
    if entry is not None:
        changes.entries.append(entry)


def jsonable(value: Any) -> Any:
    """`value` (the matrix's rows, models or deviations) with times as ISO 8601 text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [jsonable(item) for item in value]
    return value
