"""Version baselines per cluster, DRA driver and GPU model, and the register of documented
deviations.

A fleet mixes models (DGX nodes of eight H100s beside VMs with one vGPU) and vendors (NVIDIA
beside AMD and Gaudi), and each model has its own validated driver/CUDA pair; a node-count
majority over the whole cluster lets four one-GPU VMs out-vote three eight-GPU nodes. So a
baseline applies per cluster, DRA driver and model:

- set: the most specific `VersionBaseline` row of the cluster that matches the model (its
  product name, then its architecture, then the cluster-wide row with neither), a row naming
  the model's driver before one naming none. A row that names a driver judges only that
  driver's devices. A row naming none judges any driver's devices when it names a product or
  an architecture (those are one vendor's), and, cluster-wide, only in a cluster whose devices
  all come from one driver: in a cluster of several it judges none (`ambiguous` says so, and
  the policy file refuses it). An empty version in a row matches any value, so an operator may
  pin the driver only;
- else computed: the pair held by the most physical GPUs of that model in that cluster, ties
  to the newest driver, then the newest CUDA version.

Versions compare in their normal form (`parse_version`: `580.82.07` is `580.82.7`, `13.0` is
`13.0.0`) and are shown as written. A GPU on another pair is an outlier, unless a
`VersionDeviation` documents it: same cluster (and driver, when it names one), its node and/or
pool, the pair it runs (an empty version matches any), not yet expired. A GPU that publishes
no version the baseline pins is no outlier: its version is unknown, listed apart and never
tainted. Documented deviations are shown as such and kept out of general scheduling by a
taint that validation workloads tolerate (`inventory.taints`); an expired one counts as
undocumented.

Baselines and deviations are written here, each write audited (`teams.audit`): by the admin,
and by the policy file's `versions:` section (`parse_version_policy`, `apply_version_policy`,
`version_policy_effects`).
"""

from __future__ import annotations

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
from inventory.profiles import is_driver_name
from inventory.version_numbers import same_version, version_error, version_key
from teams import audit
from teams.models import AuditEntry

SET = "set"
COMPUTED = "computed"
# What a set baseline was found by, most specific first.
SCOPES = ("product", "architecture", "cluster")
POLICY_SOURCE = "policy"
ADMIN_SOURCE = "admin"
# How a GPU's pair stands against its baseline (`judge`).
ON_BASELINE = "baseline"
OUTLIER = "outlier"
UNKNOWN = "unknown"


class VersionPair(TypedDict):
    driver_version: str
    cuda_driver_version: str


class Baseline(VersionPair):
    # "set" (a VersionBaseline row) or "computed" (the pair on the most GPUs of the model).
    source: str
    # For a set baseline, the row's scope: "product", "architecture" or "cluster"; else "".
    scope: str
    # For a set baseline, the row (its pk) and the driver it names ("" for none).
    row_id: int | None
    driver: str


class DeviationInfo(TypedDict):
    id: int
    cluster: str
    driver: str
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


class UnknownVersions(TypedDict):
    """GPUs of one model on one node and pool that publish no version their baseline pins
    (VFIO passthrough, a driver that publishes none): neither on the baseline nor outliers."""

    cluster: str
    node: str
    driver: str
    pool: str
    product_name: str
    gpus: int
    # What they do not publish: "driver and CUDA versions", "CUDA version", ...
    missing: str


class ModelVersions(TypedDict):
    """One model of one driver in one cluster: its baseline, the nodes and GPUs on it, and the
    outliers."""

    cluster: str
    driver: str
    product_name: str
    architecture: str
    baseline: Baseline
    gpus: int
    # Every node with GPUs of the model whose versions are known (those a baseline can judge).
    nodes: list[str]
    nodes_on_baseline: list[str]
    gpus_on_baseline: int
    outliers: list[Outlier]
    # GPUs off the baseline that no active deviation documents, and those one does.
    outlier_gpus: int
    documented_gpus: int
    unknown_gpus: int


class VersionRow(TypedDict):
    """One driver/CUDA pair of one model in one cluster."""

    cluster: str
    driver: str
    product_name: str
    architecture: str
    driver_version: str
    cuda_driver_version: str
    nodes: list[str]
    gpus: int
    baseline: bool
    # Of `nodes`: those whose GPUs on this pair a deviation documents, those it does not, and
    # those whose versions the baseline cannot judge (a pinned version not published).
    documented_nodes: list[str]
    outlier_nodes: list[str]
    unknown_nodes: list[str]


class VersionMatrix(TypedDict):
    rows: list[VersionRow]
    models: list[ModelVersions]
    # The requested cluster's baseline when all its models share one, else None (also when
    # all clusters are covered); `baselines` the same per cluster covered.
    baseline: Baseline | None
    baselines: dict[str, Baseline | None]
    # Nodes with an undocumented outlier GPU; nodes whose outliers are all documented; nodes
    # with GPUs whose versions are unknown (and no outlier).
    outlier_nodes: list[str]
    documented_nodes: list[str]
    unknown_nodes: list[str]
    # Undocumented outlier GPUs of every model: the banner warns exactly when this is not 0.
    outlier_gpus: int
    unknown: list[UnknownVersions]
    # Every deviation of the clusters covered, expired ones included, by cluster and expiry.
    deviations: list[DeviationInfo]
    # Warnings about baselines that judge nothing because they are ambiguous.
    ambiguous: list[str]


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
    """Per cluster, driver and model: the baseline (set or computed), the nodes and GPUs on
    it, the outliers, each documented by a deviation active at `at` (default now) or not, and
    the GPUs whose versions are unknown.

    GPUs are physical units (distinct `physical_gpu_key`), so a MIG device or partition never
    counts apart from its GPU. When `cluster` is None every cluster is covered and node names
    are written `cluster/node`. Rows: by cluster, then model, then newest pair first.
    """
    at = at or timezone.now()
    qualify = cluster is None
    clusters = [cluster] if cluster is not None else list(Cluster.objects.order_by("name"))
    known: list[_Group] = []
    unpublished: list[_Group] = []
    for group in _groups(cluster):
        (known if group.driver_version else unpublished).append(group)
    set_rows = _baseline_rows(cluster)
    deviations = _deviations(cluster)
    drivers = _drivers(known)

    def label(group: _Group) -> str:
        if not group.node:
            return ""
        return f"{group.cluster}/{group.node}" if qualify else group.node

    by_model: dict[tuple[int, str, str], list[_Group]] = defaultdict(list)
    for group in known:
        by_model[(group.cluster_id, group.driver, group.product_name)].append(group)

    models: list[ModelVersions] = []
    rows: list[VersionRow] = []
    unknown = [_unknown(group, label(group), "driver and CUDA versions") for group in unpublished]
    outlier_nodes: set[str] = set()
    documented_nodes: set[str] = set()
    for (cluster_id, driver, product), members in sorted(
        by_model.items(), key=lambda item: (item[1][0].cluster, item[0][2], item[0][1])
    ):
        architecture = _architecture(members)
        baseline = resolve_baseline(
            set_rows.get(cluster_id, ()),
            driver=driver,
            product_name=product,
            architecture=architecture,
            only_driver=len(drivers[cluster_id]) == 1,
        ) or _computed(members)
        model = ModelVersions(
            cluster=members[0].cluster,
            driver=driver,
            product_name=product,
            architecture=architecture,
            baseline=baseline,
            gpus=sum(group.gpus for group in members),
            nodes=sorted({node for group in members if (node := label(group))}),
            nodes_on_baseline=[],
            gpus_on_baseline=0,
            outliers=[],
            outlier_gpus=0,
            documented_gpus=0,
            unknown_gpus=0,
        )
        pair_rows: dict[tuple[str, str], VersionRow] = {}
        for group in members:
            judged = judge(group.driver_version, group.cuda_driver_version, baseline)
            row = pair_rows.setdefault(
                (group.driver_version, group.cuda_driver_version),
                VersionRow(
                    cluster=group.cluster,
                    driver=driver,
                    product_name=product,
                    architecture=architecture,
                    driver_version=group.driver_version,
                    cuda_driver_version=group.cuda_driver_version,
                    nodes=[],
                    gpus=0,
                    baseline=judged == ON_BASELINE,
                    documented_nodes=[],
                    outlier_nodes=[],
                    unknown_nodes=[],
                ),
            )
            row["gpus"] += group.gpus
            node = label(group)
            if node:
                row["nodes"].append(node)
            if judged == ON_BASELINE:
                model["gpus_on_baseline"] += group.gpus
                if node:
                    model["nodes_on_baseline"].append(node)
                continue
            if judged == UNKNOWN:
                model["unknown_gpus"] += group.gpus
                unknown.append(_unknown(group, node, _missing(group, baseline)))
                if node:
                    row["unknown_nodes"].append(node)
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
            model["documented_gpus" if deviation else "outlier_gpus"] += group.gpus
            if node:
                (row["documented_nodes"] if deviation else row["outlier_nodes"]).append(node)
                (documented_nodes if deviation else outlier_nodes).add(node)
        model["nodes_on_baseline"] = sorted(set(model["nodes_on_baseline"]))
        model["outliers"].sort(key=lambda o: (o["node"], o["driver"], o["pool"]))
        for row in pair_rows.values():
            for key in ("nodes", "documented_nodes", "outlier_nodes", "unknown_nodes"):
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
    unknown.sort(key=lambda u: (u["cluster"], u["node"], u["driver"], u["pool"], u["product_name"]))
    unknown_nodes = {u["node"] for u in unknown if u["node"]}
    return VersionMatrix(
        rows=rows,
        models=models,
        baseline=baselines[cluster.name] if cluster is not None else None,
        baselines=baselines,
        outlier_nodes=sorted(outlier_nodes),
        # A node with an undocumented outlier is an outlier, whatever else it documents.
        documented_nodes=sorted(documented_nodes - outlier_nodes),
        unknown_nodes=sorted(unknown_nodes - outlier_nodes - documented_nodes),
        outlier_gpus=sum(model["outlier_gpus"] for model in models),
        unknown=unknown,
        deviations=[
            _deviation_info(deviation, at)
            for cluster_id in sorted(deviations, key=lambda pk: deviations[pk][0].cluster.name)
            for deviation in deviations[cluster_id]
        ],
        ambiguous=_ambiguous(set_rows, drivers),
    )


def most_common_version_pairs(*, cluster: Cluster) -> dict[tuple[str, str], VersionPair]:
    """Per (driver, model) of `cluster`: the pair on the most of its GPUs, ignoring any set
    baseline (ties to the newest). Models whose GPUs publish no driver version are absent.
    """
    by_model: dict[tuple[str, str], list[_Group]] = defaultdict(list)
    for group in _groups(cluster):
        if group.driver_version:
            by_model[(group.driver, group.product_name)].append(group)
    pairs = {}
    for key, members in sorted(by_model.items()):
        computed = _computed(members)
        pairs[key] = VersionPair(
            driver_version=computed["driver_version"],
            cuda_driver_version=computed["cuda_driver_version"],
        )
    return pairs


def version_drivers(*, cluster: Cluster) -> list[str]:
    """The DRA drivers whose present devices in `cluster` publish a driver version."""
    return sorted(
        Device.objects.filter(cluster=cluster, gone_at__isnull=True)
        .exclude(kind=DeviceKind.OTHER)
        .exclude(driver_version="")
        .values_list("driver", flat=True)
        .distinct()
    )


def baseline_applies(row: VersionBaseline, *, driver: str, only_driver: bool) -> bool:
    """Whether `row` may judge the devices of `driver`: a row naming a driver judges only its
    own; one naming none judges a named product or architecture (one vendor's), and
    cluster-wide only where one driver publishes versions (`only_driver`)."""
    if row.driver:
        return row.driver == driver
    return bool(row.product_name or row.architecture) or only_driver


def resolve_baseline(
    rows: Iterable[VersionBaseline],
    *,
    driver: str,
    product_name: str,
    architecture: str,
    only_driver: bool,
) -> Baseline | None:
    """The set baseline of a model among a cluster's `rows`: the most specific that applies
    (product name, then architecture, then cluster-wide; in each, one naming `driver` before
    one naming none); None when none does."""
    found: dict[str, VersionBaseline] = {}
    for row in rows:
        if not baseline_applies(row, driver=driver, only_driver=only_driver):
            continue
        if row.product_name:
            scope = (
                "product"
                if row.product_name == product_name
                and (not row.architecture or row.architecture == architecture)
                else ""
            )
        elif row.architecture:
            scope = "architecture" if row.architecture == architecture else ""
        else:
            scope = "cluster"
        if scope and (scope not in found or row.driver):
            found[scope] = row
    for scope in SCOPES:
        if scope in found:
            row = found[scope]
            return Baseline(
                driver_version=row.driver_version,
                cuda_driver_version=row.cuda_driver_version,
                source=SET,
                scope=scope,
                row_id=row.pk,
                driver=row.driver,
            )
    return None


def judge(driver_version: str, cuda_driver_version: str, wanted: VersionPair) -> str:
    """How a published pair stands against `wanted`: ON_BASELINE, OUTLIER (a pinned version
    differs, in normal form) or UNKNOWN (no pinned version differs, but one is not
    published). An empty wanted version (pinned by no one) matches any."""
    unknown = False
    for value, expected in (
        (driver_version, wanted["driver_version"]),
        (cuda_driver_version, wanted["cuda_driver_version"]),
    ):
        if not expected:
            continue
        if not value:
            unknown = True
        elif not same_version(value, expected):
            return OUTLIER
    return UNKNOWN if unknown else ON_BASELINE


def matches(driver_version: str, cuda_driver_version: str, wanted: VersionPair) -> bool:
    """Whether a pair is `wanted` (`judge` says it is on it)."""
    return judge(driver_version, cuda_driver_version, wanted) == ON_BASELINE


def deviation_is_active(deviation: VersionDeviation, at: datetime) -> bool:
    return deviation.expires_at > at


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


def _drivers(groups: Iterable[_Group]) -> dict[int, set[str]]:
    """Per cluster: the drivers whose devices publish a version."""
    drivers: dict[int, set[str]] = defaultdict(set)
    for group in groups:
        drivers[group.cluster_id].add(group.driver)
    return drivers


def _unknown(group: _Group, node: str, missing: str) -> UnknownVersions:
    return UnknownVersions(
        cluster=group.cluster,
        node=node,
        driver=group.driver,
        pool=group.pool,
        product_name=group.product_name,
        gpus=group.gpus,
        missing=missing,
    )


def _missing(group: _Group, baseline: Baseline) -> str:
    """The versions `baseline` pins that `group` does not publish."""
    names = [
        name
        for name, value, expected in (
            ("driver", group.driver_version, baseline["driver_version"]),
            ("CUDA", group.cuda_driver_version, baseline["cuda_driver_version"]),
        )
        if expected and not value
    ]
    return " and ".join(names) + (" versions" if len(names) > 1 else " version")


def _ambiguous(rows: dict[int, list[VersionBaseline]], drivers: dict[int, set[str]]) -> list[str]:
    """Cluster-wide rows naming no driver in a cluster of several drivers: they judge nothing."""
    return [
        f"the cluster-wide baseline of {row.cluster} names no driver, and its devices come from "
        f"{len(drivers[cluster_id])} ({', '.join(sorted(drivers[cluster_id]))}): it judges none "
        "of them; name its driver"
        for cluster_id, cluster_rows in sorted(rows.items())
        for row in cluster_rows
        if not (row.driver or row.product_name or row.architecture) and len(drivers[cluster_id]) > 1
    ]


def _baseline_rows(cluster: Cluster | None) -> dict[int, list[VersionBaseline]]:
    rows: QuerySet[VersionBaseline] = VersionBaseline.objects.select_related("cluster")
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
        and (not deviation.driver or deviation.driver == group.driver)
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
        driver=deviation.driver,
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
    # Counted per version, not per spelling: "580.82.07" and "580.82.7" are one pair.
    gpus: dict[tuple[Any, ...], int] = defaultdict(int)
    spelling: dict[tuple[Any, ...], tuple[str, str]] = {}
    for group in members:
        pair = (group.driver_version, group.cuda_driver_version)
        key = (version_key(pair[0]), version_key(pair[1]))
        gpus[key] += group.gpus
        spelling[key] = max(spelling.get(key, pair), pair)
    driver_version, cuda_driver_version = spelling[
        max(gpus, key=lambda key: (gpus[key], *_pair_key(*spelling[key])))
    ]
    return Baseline(
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        source=COMPUTED,
        scope="",
        row_id=None,
        driver="",
    )


def _all_same(baselines: list[Baseline]) -> bool:
    first = baselines[0]
    return all(
        same_version(b["driver_version"], first["driver_version"])
        and same_version(b["cuda_driver_version"], first["cuda_driver_version"])
        for b in baselines
    )


# --- Writes ---------------------------------------------------------------------------------


def set_baseline(
    *,
    cluster: Cluster,
    driver_version: str,
    cuda_driver_version: str,
    actor: str,
    driver: str = "",
    product_name: str = "",
    architecture: str = "",
    note: str = "",
    source: str = ADMIN_SOURCE,
) -> AuditEntry | None:
    """Set the validated pair of one scope of `cluster` (a driver's product, architecture, or
    whole fleet when both are empty), creating or updating its one row, audited as `actor`.

    Returns the audit entry, or None when the row already said so. Raises `ValueError` for a
    version that is no version.
    """
    for value in (driver_version, cuda_driver_version):
        if error := version_error(value):
            raise ValueError(error)
    with transaction.atomic():
        row = (
            VersionBaseline.objects.select_for_update()
            .filter(
                cluster=cluster,
                driver=driver,
                product_name=product_name,
                architecture=architecture,
            )
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
                    cluster=cluster,
                    driver=driver,
                    product_name=product_name,
                    architecture=architecture,
                    **values,
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

    def version(self, mapping: dict[str, Any], key: str, path: str) -> str:
        """A version as written (kept for display), refused when it is no version."""
        value = self.string(mapping, key, path, max_length=64)
        if error := version_error(value):
            self.errors.append(f"{path}.{key}: {error}")
        return value

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
    driver = section.version(mapping, "driverVersion", path)
    cuda = section.version(mapping, "cudaDriverVersion", path)
    if product and architecture:
        section.errors.append(
            f"{path}: give productName or architecture (or neither: the whole cluster), not both"
        )
    if not driver and not cuda:
        section.errors.append(f"{path}: give driverVersion, cudaDriverVersion or both")
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
    driver = section.version(mapping, "driverVersion", path)
    cuda = section.version(mapping, "cudaDriverVersion", path)
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


def jsonable(value: Any) -> Any:
    """`value` (the matrix's rows, models or deviations) with times as ISO 8601 text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [jsonable(item) for item in value]
    return value
