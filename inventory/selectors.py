"""Reads of the GPU fleet: capacity by model, driver/CUDA versions and fragmentation.

These are operator reads of the whole fleet (no tenant data), so they take a cluster, not a
user. Every count is aggregated in SQL and only small per-node or per-model rows come back,
so the reports stay fast at 100,000 devices.

Counting rules, shared by every function here:

- A device is present while `gone_at` is null.
- A physical GPU is a distinct non-empty `physical_gpu_key` among present devices whose kind
  is not `other`: a whole GPU, its MIG devices and its partitions share one key, so keys are
  counted, never rows. Keys are counted per cluster and summed, so two clusters never merge.
- A physical GPU is allocated while any present device with its key has an open allocation
  (`end` is null), free otherwise. Its model is the `product_name` of its devices.
- Devices without a node (multi-node pools) count towards capacity but not towards any node.
- A physical GPU is partly used while some but not all of its present devices are held and
  their summed `gpu_share` is below 1: it counts as allocated above, and `partial_gpus`
  reports the share still free on it. A GPU whose MIG slices are all held is full, even
  when their shares sum below 1 (two 3g.40gb on an A100: 6/7, but no memory left).

When `cluster` is None a function covers all clusters; node names are then written
`cluster/node`, since a node name is unique only within its cluster.
"""

from __future__ import annotations

import re
from collections import defaultdict
from decimal import Decimal
from typing import Any, TypedDict

from django.db.models import BooleanField, Case, Count, F, Q, QuerySet, Sum, When

from inventory.models import Allocation, Cluster, Device, DeviceKind

# Shares are stored to 6 places, so seven 1g slices sum to 0.999999: within this of 1 a GPU
# is fully held.
_FULL_SHARE_TOLERANCE = Decimal("0.0001")


class VersionPair(TypedDict):
    driver_version: str
    cuda_driver_version: str


class Baseline(VersionPair):
    # "operator": the cluster's baseline fields; "most_common": the pair on the most nodes.
    source: str


class CapacityRow(TypedDict):
    product_name: str
    gpus: int
    allocated: int
    free: int
    mig_devices: int


class VersionRow(TypedDict):
    cluster: str
    driver_version: str
    cuda_driver_version: str
    nodes: list[str]
    gpus: int
    baseline: bool


class VersionMatrix(TypedDict):
    rows: list[VersionRow]
    # The baseline of the requested cluster; None when all clusters are covered or none is known.
    baseline: Baseline | None
    baselines: dict[str, Baseline | None]
    outlier_nodes: list[str]


class NodeFragmentation(TypedDict):
    cluster: str
    node: str
    clique: str
    gpus: int
    # Physical GPUs with anything held (partly used ones included) and with nothing held.
    allocated: int
    free: int
    # Partly used GPUs, and GPU-equivalents free: `free` plus the free share of those.
    gpus_partial: int
    free_share: Decimal


class PartialGpu(TypedDict):
    cluster: str
    node: str  # "" for a GPU without a node
    physical_gpu_key: str
    product_name: str
    held_share: Decimal
    free_share: Decimal
    held_label: str  # "3/7" when the share is in sevenths (MIG), else a percentage
    # Held devices by profile (a device without one by name).
    held_devices: dict[str, int]
    # Unheld statically created MIG devices by profile: slices a claim can get as they are.
    free_slices: dict[str, int]
    # Whether unheld devices that overlap others (KEP-4815 partitions, the whole GPU) exist:
    # they are not listed, as holding one may rule out the rest; `free_share` is all we know.
    overlapping_unheld: bool


class FragmentationSummary(TypedDict):
    nodes_free: int
    nodes_partial: int
    nodes_full: int
    largest_free_block: int
    largest_free_clique_block: int
    gpus_partial: int
    # GPU-equivalents free on partly used GPUs (not counted in any whole-GPU figure).
    partial_free_share: Decimal


class Fragmentation(FragmentationSummary):
    nodes: list[NodeFragmentation]
    partial_gpus: list[PartialGpu]


def capacity_by_model(*, cluster: Cluster | None = None) -> list[CapacityRow]:
    """Physical GPUs per `product_name`: how many, how many allocated or free, and MIG devices.

    Rows are sorted by product name; a model with only non-GPU devices does not appear.
    """
    counts = (
        _present_devices(cluster)
        .exclude(kind=DeviceKind.OTHER)
        .values("cluster_id", "product_name")
        .annotate(
            gpus=_count_gpus(),
            allocated=_count_gpus(allocated=True),
            mig_devices=Count("pk", filter=Q(kind=DeviceKind.MIG)),
        )
        .order_by()
    )
    totals: dict[str, CapacityRow] = {}
    for row in counts:
        product = row["product_name"]
        total = totals.setdefault(
            product,
            CapacityRow(product_name=product, gpus=0, allocated=0, free=0, mig_devices=0),
        )
        total["gpus"] += row["gpus"]
        total["allocated"] += row["allocated"]
        total["free"] += row["gpus"] - row["allocated"]
        total["mig_devices"] += row["mig_devices"]
    return [totals[product] for product in sorted(totals)]


def version_matrix(*, cluster: Cluster | None = None) -> VersionMatrix:
    """Which driver/CUDA pairs run where, the baseline pair, and the nodes that stray from it.

    One row per cluster and pair: the nodes with a GPU on that pair and the physical GPUs on
    it. Devices that publish no driver version (VFIO passthrough) are left out. A cluster's
    baseline is its `baseline_*` fields when an operator set either (an empty one matches any
    value), else the pair found on the most nodes, ties going to the newest driver, then the
    newest CUDA version. Every cluster covered gets its own baseline in `baselines`, and
    `outlier_nodes` (sorted) are the nodes with any GPU on a pair that differs from the
    baseline of their cluster.
    """
    qualify = cluster is None
    per_node = (
        _present_gpu_devices(cluster)
        .exclude(driver_version="")
        .values("cluster__name", "node__name", "driver_version", "cuda_driver_version")
        .annotate(gpus=Count("physical_gpu_key", distinct=True))
        .order_by()
    )
    rows: dict[tuple[str, str, str], VersionRow] = {}
    for entry in per_node:
        key = (entry["cluster__name"], entry["driver_version"], entry["cuda_driver_version"])
        row = rows.setdefault(
            key,
            VersionRow(
                cluster=key[0],
                driver_version=key[1],
                cuda_driver_version=key[2],
                nodes=[],
                gpus=0,
                baseline=False,
            ),
        )
        # A key lives on one node, so per-node distinct counts add up without double counting.
        row["gpus"] += entry["gpus"]
        if entry["node__name"] is not None:
            row["nodes"].append(_node_label(key[0], entry["node__name"], qualify))

    clusters = [cluster] if cluster is not None else list(Cluster.objects.order_by("name"))
    baselines: dict[str, Baseline | None] = {}
    outliers: set[str] = set()
    for covered in clusters:
        cluster_rows = [row for row in rows.values() if row["cluster"] == covered.name]
        baseline = _baseline(covered, cluster_rows)
        baselines[covered.name] = baseline
        for row in cluster_rows:
            row["nodes"].sort()
            row["baseline"] = baseline is not None and _matches(row, baseline)
            if not row["baseline"]:
                outliers.update(row["nodes"])

    # Newest pair first within each cluster: two stable sorts, the last one decides first.
    ordered = sorted(
        rows.values(),
        key=lambda row: (
            _version_key(row["driver_version"]),
            _version_key(row["cuda_driver_version"]),
        ),
        reverse=True,
    )
    ordered.sort(key=lambda row: row["cluster"])
    return VersionMatrix(
        rows=ordered,
        baseline=baselines[cluster.name] if cluster is not None else None,
        baselines=baselines,
        outlier_nodes=sorted(outliers),
    )


def most_common_version_pair(*, cluster: Cluster) -> VersionPair | None:
    """The driver/CUDA pair on the most nodes of `cluster`, ignoring its operator baseline.

    Ties go to the newest driver, then the newest CUDA version; None when no GPU publishes a
    driver version.
    """
    pair = _most_common(version_matrix(cluster=cluster)["rows"])
    if pair is None:
        return None
    return VersionPair(
        driver_version=pair["driver_version"], cuda_driver_version=pair["cuda_driver_version"]
    )


def fragmentation(*, cluster: Cluster | None = None) -> Fragmentation:
    """How the free GPUs are spread over nodes, NVLink cliques and partly used GPUs.

    `nodes` has one row per node with a present GPU (sorted by name); a node is free when
    none of its GPUs is allocated, full when all are, partial otherwise.
    `largest_free_block` is the most free GPUs on one node; `largest_free_clique_block` the
    most free GPUs within one NVLink clique, summing the nodes of a cluster that share a
    non-empty `Node.clique`, a node without clique counting alone. Both count whole GPUs
    only: a partly used GPU cannot take a claim for a whole one. `partial_gpus` is
    `partial_gpus()`; `gpus_partial` and `partial_free_share` sum it.
    """
    qualify = cluster is None
    per_node = (
        _present_gpu_devices(cluster)
        .filter(node__isnull=False)
        .values("cluster__name", "node_id", "node__name", "node__clique")
        .annotate(gpus=_count_gpus(), allocated=_count_gpus(allocated=True))
        .order_by()
    )
    partial = partial_gpus(cluster=cluster)
    partial_by_node: dict[str, list[PartialGpu]] = defaultdict(list)
    for gpu in partial:
        partial_by_node[gpu["node"]].append(gpu)
    nodes: list[NodeFragmentation] = []
    free_by_clique: dict[tuple[str, object], int] = defaultdict(int)
    for entry in per_node:
        free = entry["gpus"] - entry["allocated"]
        label = _node_label(entry["cluster__name"], entry["node__name"], qualify)
        on_node = partial_by_node.get(label, [])
        nodes.append(
            NodeFragmentation(
                cluster=entry["cluster__name"],
                node=label,
                clique=entry["node__clique"],
                gpus=entry["gpus"],
                allocated=entry["allocated"],
                free=free,
                gpus_partial=len(on_node),
                free_share=Decimal(free) + sum((gpu["free_share"] for gpu in on_node), Decimal(0)),
            )
        )
        # Clique ids are only meaningful within a cluster; a node without one is its own group.
        group = entry["node__clique"] or ("node", entry["node_id"])
        free_by_clique[(entry["cluster__name"], group)] += free
    nodes.sort(key=lambda row: row["node"])
    return Fragmentation(
        nodes=nodes,
        nodes_free=sum(1 for row in nodes if row["allocated"] == 0),
        nodes_partial=sum(1 for row in nodes if 0 < row["allocated"] < row["gpus"]),
        nodes_full=sum(1 for row in nodes if row["allocated"] == row["gpus"]),
        largest_free_block=max((row["free"] for row in nodes), default=0),
        largest_free_clique_block=max(free_by_clique.values(), default=0),
        gpus_partial=len(partial),
        partial_free_share=sum((gpu["free_share"] for gpu in partial), Decimal(0)),
        partial_gpus=partial,
    )


def partial_gpus(*, cluster: Cluster | None = None) -> list[PartialGpu]:
    """Physical GPUs partly used now, with the share held and free and the devices behind it.

    Sorted by node, then physical GPU key. The held share sums the `gpu_share` of the held
    devices, each once however many allocations share it; the free share is the rest. Only
    unheld statically created MIG devices (kind `mig` with a uuid, consuming no counters) are
    listed as free slices; other unheld devices overlap (KEP-4815 partitions, or the whole
    GPU) and only set `overlapping_unheld`, as the free share may fit none of them.
    """
    held = _held_device_ids()
    # Keys of GPUs partly held, as a subquery: one round trip, and only their devices return.
    partly_held = (
        _present_gpu_devices(cluster)
        .values("cluster_id", "physical_gpu_key")
        .annotate(
            devices=Count("pk"),
            held_devices=Count("pk", filter=Q(pk__in=held)),
            held_share=Sum("gpu_share", filter=Q(pk__in=held)),
        )
        .filter(
            held_devices__gt=0,
            held_devices__lt=F("devices"),
            held_share__lt=1 - _FULL_SHARE_TOLERANCE,
        )
        .order_by()
        .values("physical_gpu_key")
    )
    static = Q(kind=DeviceKind.MIG) & ~Q(uuid="") & ~Q(extra__has_key="consumesCounters")
    devices = (
        _present_gpu_devices(cluster)
        .filter(physical_gpu_key__in=partly_held)
        .annotate(
            held=Case(When(pk__in=held, then=True), default=False, output_field=BooleanField()),
            static_mig=Case(When(static, then=True), default=False, output_field=BooleanField()),
        )
        .values(
            "cluster_id",
            "cluster__name",
            "node__name",
            "physical_gpu_key",
            "product_name",
            "name",
            "profile",
            "gpu_share",
            "held",
            "static_mig",
        )
        .order_by("name")
    )
    qualify = cluster is None
    gpus: dict[tuple[int, str], PartialGpu] = {}
    for device in devices:
        # Per cluster: a key partly held in one cluster may also exist whole in another.
        identity = (device["cluster_id"], device["physical_gpu_key"])
        gpu = gpus.get(identity)
        if gpu is None:
            node = device["node__name"]
            gpu = gpus[identity] = PartialGpu(
                cluster=device["cluster__name"],
                node=_node_label(device["cluster__name"], node, qualify) if node else "",
                physical_gpu_key=device["physical_gpu_key"],
                product_name=device["product_name"],
                held_share=Decimal(0),
                free_share=Decimal(0),
                held_label="",
                held_devices={},
                free_slices={},
                overlapping_unheld=False,
            )
        label = device["profile"] or device["name"]
        if device["held"]:
            gpu["held_share"] += device["gpu_share"]
            gpu["held_devices"][label] = gpu["held_devices"].get(label, 0) + 1
        elif device["static_mig"]:
            gpu["free_slices"][label] = gpu["free_slices"].get(label, 0) + 1
        else:
            gpu["overlapping_unheld"] = True
    partial = [
        gpu
        for gpu in gpus.values()
        if gpu["held_devices"]
        and (gpu["free_slices"] or gpu["overlapping_unheld"])
        and gpu["held_share"] < 1 - _FULL_SHARE_TOLERANCE
    ]
    for gpu in partial:
        gpu["free_share"] = Decimal(1) - gpu["held_share"]
        gpu["held_label"] = _share_label(gpu["held_share"])
        gpu["held_devices"] = dict(sorted(gpu["held_devices"].items()))
        gpu["free_slices"] = dict(sorted(gpu["free_slices"].items()))
    return sorted(partial, key=lambda gpu: (gpu["node"], gpu["physical_gpu_key"]))


def fleet_report(*, cluster: Cluster | None = None) -> dict[str, Any]:
    """The fleet at a glance, as JSON-ready data (what `manage.py fleet_report` prints).

    Keys: `nodes` (nodes with a present GPU), `gpus_by_model` (product_name → physical GPUs),
    `mig_devices`, `capacity` (see `capacity_by_model`), `driver_matrix` (one row per
    cluster and pair: `nodes` is the node count, `node_names` the names, plus `gpus` and
    whether it is the `baseline`), `baseline` and `baselines` (see `version_matrix`),
    `outlier_nodes`, `fragmentation` (the summary counts of `fragmentation`) and
    `partial_gpus` (see `partial_gpus`). GPU shares are decimal strings, as JSON has no
    exact decimals.
    """
    capacity = capacity_by_model(cluster=cluster)
    versions = version_matrix(cluster=cluster)
    spread = fragmentation(cluster=cluster)
    return {
        "cluster": cluster.name if cluster is not None else None,
        "nodes": len(spread["nodes"]),
        "gpus_by_model": {row["product_name"]: row["gpus"] for row in capacity},
        "mig_devices": sum(row["mig_devices"] for row in capacity),
        "capacity": capacity,
        "driver_matrix": [
            {
                "cluster": row["cluster"],
                "driver_version": row["driver_version"],
                "cuda_driver_version": row["cuda_driver_version"],
                "nodes": len(row["nodes"]),
                "node_names": row["nodes"],
                "gpus": row["gpus"],
                "baseline": row["baseline"],
            }
            for row in versions["rows"]
        ],
        "baseline": versions["baseline"],
        "baselines": versions["baselines"],
        "outlier_nodes": versions["outlier_nodes"],
        "fragmentation": {
            "nodes_free": spread["nodes_free"],
            "nodes_partial": spread["nodes_partial"],
            "nodes_full": spread["nodes_full"],
            "largest_free_block": spread["largest_free_block"],
            "largest_free_clique_block": spread["largest_free_clique_block"],
            "gpus_partial": spread["gpus_partial"],
            "partial_free_share": str(spread["partial_free_share"]),
        },
        "partial_gpus": [
            {**gpu, "held_share": str(gpu["held_share"]), "free_share": str(gpu["free_share"])}
            for gpu in spread["partial_gpus"]
        ],
    }


def _present_devices(cluster: Cluster | None) -> QuerySet[Device]:
    devices = Device.objects.filter(gone_at__isnull=True)
    return devices if cluster is None else devices.filter(cluster=cluster)


def _present_gpu_devices(cluster: Cluster | None) -> QuerySet[Device]:
    """Present devices that belong to a physical GPU."""
    return _present_devices(cluster).exclude(kind=DeviceKind.OTHER).exclude(physical_gpu_key="")


def _held_device_ids() -> QuerySet[Allocation, Any]:
    """Ids of devices with an open allocation, as a subquery.

    `IN (open allocations)` rather than a correlated EXISTS: PostgreSQL hashes it once, and
    the EXISTS form's cost estimate is high enough to trigger slow JIT compilation.
    """
    return Allocation.objects.filter(end__isnull=True).values("device_id")


def _share_label(share: Decimal) -> str:
    """A share of a GPU as "3/7" when it is in sevenths (MIG slices), else as a percentage."""
    sevenths = (share * 7).quantize(Decimal(1))
    if abs(share * 7 - sevenths) <= _FULL_SHARE_TOLERANCE:
        return f"{sevenths}/7"
    return f"{(share * 100).quantize(Decimal(1))}%"


def _count_gpus(*, allocated: bool = False) -> Count:
    """Distinct physical GPUs in a group of devices; with `allocated`, only those held now.

    A key counts as allocated when any of its devices in the group has an open allocation,
    which is exactly "any present device with its key" as long as the group holds all of a
    GPU's present devices (it does: they share cluster, node and product name).
    """
    condition = ~Q(physical_gpu_key="")
    if allocated:
        condition &= Q(pk__in=_held_device_ids())
    return Count("physical_gpu_key", distinct=True, filter=condition)


def _node_label(cluster_name: str, node_name: str, qualify: bool) -> str:
    return f"{cluster_name}/{node_name}" if qualify else node_name


def _baseline(cluster: Cluster, rows: list[VersionRow]) -> Baseline | None:
    if cluster.baseline_driver_version or cluster.baseline_cuda_driver_version:
        return Baseline(
            driver_version=cluster.baseline_driver_version,
            cuda_driver_version=cluster.baseline_cuda_driver_version,
            source="operator",
        )
    pair = _most_common(rows)
    if pair is None:
        return None
    return Baseline(
        driver_version=pair["driver_version"],
        cuda_driver_version=pair["cuda_driver_version"],
        source="most_common",
    )


def _most_common(rows: list[VersionRow]) -> VersionRow | None:
    return max(
        rows,
        key=lambda row: (
            len(row["nodes"]),
            _version_key(row["driver_version"]),
            _version_key(row["cuda_driver_version"]),
            # Distinct strings can parse alike ("580.82.07" and "580.82.7"); keep the choice stable.
            row["driver_version"],
            row["cuda_driver_version"],
        ),
        default=None,
    )


def _matches(row: VersionRow, baseline: Baseline) -> bool:
    # An operator may pin only one of the two versions; the other then matches anything.
    pinned_only = baseline["source"] == "operator"

    def same(value: str, wanted: str) -> bool:
        return value == wanted or (pinned_only and not wanted)

    return same(row["driver_version"], baseline["driver_version"]) and same(
        row["cuda_driver_version"], baseline["cuda_driver_version"]
    )


_VERSION_PART = re.compile(r"\d+|[^\d.\-+]+")


def _version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders versions numerically ("580.126.20" is newer than "580.82.07")."""
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part)
        for part in _VERSION_PART.findall(version)
    )
