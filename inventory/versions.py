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
and by the policy file's `versions:` section (`inventory.version_policy`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

from django.db import transaction
from django.db.models import Count, QuerySet
from django.utils import timezone

from inventory.models import Cluster, Device, DeviceKind, VersionBaseline, VersionDeviation
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


def jsonable(value: Any) -> Any:
    """`value` (the matrix's rows, models or deviations) with times as ISO 8601 text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [jsonable(item) for item in value]
    return value
