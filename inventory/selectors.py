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
  reports the share still free on it and what can still be placed there. A GPU whose MIG
  slices are all held is full, even when their shares sum below 1 (two 3g.40gb on an A100:
  6/7, but no memory left). A node with a partly used GPU is partly used, never full.
- Shares count the device's `unit` (GPUs, TPU chips, Gaudi cards): one physical unit is 1.
  Units never add up across units or models: capacity is per unit and model, and so is every
  free block (8 free H100s and 4 free TPU chips on one node are no block of 12).

When `cluster` is None a function covers all clusters; node names are then written
`cluster/node`, since a node name is unique only within its cluster.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import Any, TypedDict

from django.db.models import (
    BooleanField,
    Case,
    CharField,
    Count,
    F,
    Max,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Cast, Concat

from inventory import versions
from inventory.checks import PoolGeneration, published_counter_sets, quantities, sync_warnings
from inventory.models import Allocation, Cluster, Device, DeviceKind
from inventory.profiles import UNITS, unit_label
from inventory.versions import VersionMatrix

# Shares are stored to 6 places, so seven 1g slices sum to 0.999999: within this of 1 a GPU
# is fully held.
_FULL_SHARE_TOLERANCE = Decimal("0.0001")


class CapacityRow(TypedDict):
    product_name: str
    # What the model's devices count (`Unit`) and its name in the plural ("GPUs", "TPU chips"):
    # rows of different units never add up.
    unit: str
    unit_label: str
    # Physical units of the model (GPUs, TPU chips, Gaudi cards, as `unit` says), with
    # anything held and with nothing held.
    gpus: int
    allocated: int
    free: int
    mig_devices: int
    # The same capacity in units: 1 per physical unit published whole or as MIG devices, the
    # shares of its partitions for one published only as partitions (a VM's A100-4C vGPU is
    # 0.1 GPU, not a GPU), at most 1 per unit.
    equivalents: Decimal


class FreeBlock(TypedDict):
    """The most wholly free units of one model on one node, and in one NVLink clique."""

    unit: str
    unit_label: str
    product_name: str
    largest_free_block: int
    largest_free_clique_block: int


class NodeFragmentation(TypedDict):
    cluster: str
    node: str
    clique: str
    # What the node's shares count (`Unit`), "accelerator" when its devices mix units, and
    # its name in the plural ("GPUs", "TPU chips").
    unit: str
    unit_label: str
    gpus: int
    # Physical GPUs with anything held (partly used ones included) and with nothing held.
    allocated: int
    free: int
    # Wholly held and partly used GPUs (`allocated` is their sum), and units free: `free`
    # plus the free share of the partly used ones.
    gpus_full: int
    gpus_partial: int
    free_share: Decimal
    # "free" (nothing held), "full" (every GPU wholly held) or "partly used".
    state: str
    # Unheld non-overlapping slices on its partly used GPUs, by profile.
    free_slices: dict[str, int]
    # The largest device a claim could get on the node now ("whole GPU", "3g.40gb"), and its
    # share; "" and 0 when nothing is placeable.
    largest_placeable: str
    largest_placeable_share: Decimal


class PartialGpu(TypedDict):
    cluster: str
    node: str  # "" for a GPU without a node
    physical_gpu_key: str
    product_name: str
    unit: str
    unit_label: str  # the unit's name, singular ("GPU", "TPU chip")
    held_share: Decimal
    free_share: Decimal
    held_label: str  # "3/7" when the share is in sevenths (MIG), else a percentage
    free_label: str
    # Held devices by profile (a device without one by name).
    held_devices: dict[str, int]
    # Unheld slices that overlap nothing (static MIG devices, fixed partitions), by profile:
    # a claim can get each of them as they are, all at once.
    free_slices: dict[str, int]
    # Whether unheld devices that overlap others (KEP-4815 partitions, the whole GPU) exist.
    overlapping_unheld: bool
    # Unheld devices a claim could get now, by profile (else share): the free slices, and
    # overlapping devices whose counters fit in what the held ones leave of their counter
    # set (where the set is not stored, whose share fits in the free share). Each on its
    # own: taking one may rule out others.
    placeable: dict[str, int]
    # The largest of them, and its share; "" and 0 when none is.
    largest_placeable: str
    largest_placeable_share: Decimal


class FragmentationSummary(TypedDict):
    nodes_free: int
    nodes_partial: int
    nodes_full: int
    # The largest of `free_blocks`: the most free units of one model on one node (in one
    # clique), never a sum of GPUs and TPU chips, or of two models.
    largest_free_block: int
    largest_free_clique_block: int
    free_blocks: list[FreeBlock]
    gpus_partial: int
    # Units free on partly used GPUs (not counted in any whole-GPU figure), in all and by
    # unit (`Unit` value → share), as GPUs and TPU chips do not add up.
    partial_free_share: Decimal
    partial_free_by_unit: dict[str, Decimal]


class Fragmentation(FragmentationSummary):
    nodes: list[NodeFragmentation]
    partial_gpus: list[PartialGpu]


def capacity_by_model(*, cluster: Cluster | None = None) -> list[CapacityRow]:
    """Physical units per unit and `product_name`: how many, how many allocated or free, MIG
    devices, and the capacity they make in their unit (`equivalents`).

    Rows are sorted by unit (GPUs, TPU chips, Gaudi cards, other accelerators), then product
    name: TPU chips and Gaudi cards are listed as what they are, never as GPUs. A model with
    only non-accelerator devices does not appear.
    """
    identity = Concat(Cast("cluster_id", CharField()), Value(" "), "physical_gpu_key")
    whole_units = (
        _present_gpu_devices(cluster)
        .filter(kind__in=(DeviceKind.GPU, DeviceKind.MIG))
        .annotate(identity=identity)
        .values("identity")
    )
    counts = (
        _present_devices(cluster)
        .exclude(kind=DeviceKind.OTHER)
        .annotate(identity=identity)
        .values("cluster_id", "unit", "product_name")
        .annotate(
            gpus=_count_gpus(),
            allocated=_count_gpus(allocated=True),
            mig_devices=Count("pk", filter=Q(kind=DeviceKind.MIG)),
            whole=Count(
                "physical_gpu_key",
                distinct=True,
                filter=Q(kind__in=(DeviceKind.GPU, DeviceKind.MIG)) & ~Q(physical_gpu_key=""),
            ),
            partition_share=Sum(
                "gpu_share",
                filter=Q(kind=DeviceKind.PARTITION)
                & ~Q(physical_gpu_key="")
                & ~Q(identity__in=whole_units),
            ),
        )
        .order_by()
    )
    totals: dict[tuple[int, str, str], CapacityRow] = {}
    for row in counts:
        unit, product = row["unit"], row["product_name"]
        total = totals.setdefault(
            (_unit_order(unit), unit, product),
            CapacityRow(
                product_name=product,
                unit=unit,
                unit_label=unit_label(unit),
                gpus=0,
                allocated=0,
                free=0,
                mig_devices=0,
                equivalents=Decimal(0),
            ),
        )
        total["gpus"] += row["gpus"]
        total["allocated"] += row["allocated"]
        total["free"] += row["gpus"] - row["allocated"]
        total["mig_devices"] += row["mig_devices"]
        # Units published only as partitions: their shares, at most one unit each.
        partition_only = row["gpus"] - row["whole"]
        total["equivalents"] += row["whole"] + min(
            row["partition_share"] or Decimal(0), Decimal(partition_only)
        )
    return [totals[key] for key in sorted(totals)]


def _unit_order(unit: str) -> int:
    return UNITS.index(unit) if unit in UNITS else len(UNITS)


def version_matrix(*, cluster: Cluster | None = None) -> VersionMatrix:
    """Which driver/CUDA pairs run where, per cluster and GPU model: the baseline (set or
    computed), the nodes and GPUs on it, the outliers and the deviations documenting them.

    See `inventory.versions.version_matrix`, which this is.
    """
    return versions.version_matrix(cluster=cluster)


def fragmentation(*, cluster: Cluster | None = None) -> Fragmentation:
    """How the free GPUs are spread over nodes, NVLink cliques and partly used GPUs.

    `nodes` has one row per node with a present GPU (sorted by name); a node is free when
    none of its GPUs is allocated, full when all are wholly held, partly used otherwise (one
    MIG slice held on its only A100 leaves it partly used, with 6/7 free).
    `free_blocks` has, per unit and model, the most wholly free units on one node
    (`largest_free_block`) and within one NVLink clique (`largest_free_clique_block`, summing
    the nodes of a cluster that share a non-empty `Node.clique`, a node without clique
    counting alone): a claim gets devices of one model, so free H100s and free TPU chips (or
    A100s) are never one block. The summary's two figures are the largest of them. Both
    count whole units only: a partly used GPU cannot take a claim for a whole one. `partial_gpus` is
    `partial_gpus()`; `gpus_partial` and `partial_free_share` sum it. A node's
    `largest_placeable` is the largest device of its wholly free GPUs or the largest
    placeable one of its partly used GPUs.
    """
    qualify = cluster is None
    # Per node and model (a physical unit's devices share both), folded into nodes below.
    per_node_and_model = (
        _present_gpu_devices(cluster)
        .filter(node__isnull=False)
        .values("cluster__name", "node_id", "node__name", "node__clique", "unit", "product_name")
        .annotate(gpus=_count_gpus(), allocated=_count_gpus(allocated=True))
        .order_by()
    )
    per_node: dict[int, dict[str, Any]] = {}
    blocks: dict[tuple[int, str, str], FreeBlock] = {}
    free_by_model_clique: dict[tuple[str, str, str, object], int] = defaultdict(int)
    for row in per_node_and_model:
        node_row = per_node.setdefault(
            row["node_id"], {**row, "gpus": 0, "allocated": 0, "units": set()}
        )
        node_row["gpus"] += row["gpus"]
        node_row["allocated"] += row["allocated"]
        node_row["units"].add(row["unit"])
        unit, product, free = row["unit"], row["product_name"], row["gpus"] - row["allocated"]
        block = blocks.setdefault(
            (_unit_order(unit), unit, product),
            FreeBlock(
                unit=unit,
                unit_label=unit_label(unit),
                product_name=product,
                largest_free_block=0,
                largest_free_clique_block=0,
            ),
        )
        block["largest_free_block"] = max(block["largest_free_block"], free)
        # Clique ids are only meaningful within a cluster; a node without one is its own group.
        group = row["node__clique"] or ("node", row["node_id"])
        free_by_model_clique[(unit, product, row["cluster__name"], group)] += free
    for (unit, product, _, _), free in free_by_model_clique.items():
        block = blocks[(_unit_order(unit), unit, product)]
        block["largest_free_clique_block"] = max(block["largest_free_clique_block"], free)
    free_blocks = [blocks[key] for key in sorted(blocks)]
    partial = partial_gpus(cluster=cluster)
    partial_by_node: dict[str, list[PartialGpu]] = defaultdict(list)
    for gpu in partial:
        partial_by_node[gpu["node"]].append(gpu)
    largest_free = _largest_on_free_gpus(cluster)
    nodes: list[NodeFragmentation] = []
    for entry in per_node.values():
        free = entry["gpus"] - entry["allocated"]
        label = _node_label(entry["cluster__name"], entry["node__name"], qualify)
        on_node = partial_by_node.get(label, [])
        unit = next(iter(entry["units"])) if len(entry["units"]) == 1 else "accelerator"
        free_slices: dict[str, int] = defaultdict(int)
        for gpu in on_node:
            for profile, count in gpu["free_slices"].items():
                free_slices[profile] += count
        largest_share, largest = max(
            [
                largest_free.get(label, (Decimal(0), "")),
                *((gpu["largest_placeable_share"], gpu["largest_placeable"]) for gpu in on_node),
            ]
        )
        gpus_full = entry["allocated"] - len(on_node)
        nodes.append(
            NodeFragmentation(
                cluster=entry["cluster__name"],
                node=label,
                clique=entry["node__clique"],
                unit=unit,
                unit_label=unit_label(unit),
                gpus=entry["gpus"],
                allocated=entry["allocated"],
                free=free,
                gpus_full=gpus_full,
                gpus_partial=len(on_node),
                free_share=Decimal(free) + sum((gpu["free_share"] for gpu in on_node), Decimal(0)),
                state="free"
                if entry["allocated"] == 0
                else "full"
                if gpus_full == entry["gpus"]
                else "partly used",
                free_slices=dict(sorted(free_slices.items())),
                largest_placeable=largest,
                largest_placeable_share=largest_share,
            )
        )
    nodes.sort(key=lambda row: row["node"])
    free_by_unit: dict[str, Decimal] = defaultdict(Decimal)
    for gpu in partial:
        free_by_unit[gpu["unit"]] += gpu["free_share"]
    return Fragmentation(
        nodes=nodes,
        nodes_free=sum(1 for row in nodes if row["state"] == "free"),
        nodes_partial=sum(1 for row in nodes if row["state"] == "partly used"),
        nodes_full=sum(1 for row in nodes if row["state"] == "full"),
        largest_free_block=max((b["largest_free_block"] for b in free_blocks), default=0),
        largest_free_clique_block=max(
            (b["largest_free_clique_block"] for b in free_blocks), default=0
        ),
        free_blocks=free_blocks,
        gpus_partial=len(partial),
        partial_free_share=sum((gpu["free_share"] for gpu in partial), Decimal(0)),
        partial_free_by_unit=dict(sorted(free_by_unit.items())),
        partial_gpus=partial,
    )


def partial_gpus(*, cluster: Cluster | None = None) -> list[PartialGpu]:
    """Physical GPUs partly used now, with the share held and free and the devices behind it.

    Sorted by node, then physical GPU key. The held share sums the `gpu_share` of the held
    devices, each once however many allocations share it; the free share is the rest. Unheld
    devices that consume no counters and are slices (kind `mig` or `partition`) overlap
    nothing and are listed as free slices. Other unheld devices overlap (KEP-4815 partitions,
    or the whole GPU) and set `overlapping_unheld`; they are placeable when what they consume
    of each counter fits in what the held devices leave of their counter set, as the
    scheduler decides (a whole GPU's device consumes all of it). A device that consumes no
    counters, or whose counter set is not stored, is placeable when its share fits in the
    free share. Two queries at most, whatever the size of the fleet.
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
    devices = list(
        _present_gpu_devices(cluster)
        .filter(physical_gpu_key__in=partly_held)
        .annotate(
            held=Case(When(pk__in=held, then=True), default=False, output_field=BooleanField()),
        )
        .values(
            "cluster_id",
            "cluster__name",
            "node__name",
            "physical_gpu_key",
            "product_name",
            "driver",
            "pool",
            "pool_generation",
            "name",
            "kind",
            "unit",
            "profile",
            "gpu_share",
            "extra__consumesCounters",
            "held",
        )
        .order_by("name")
    )
    counter_sets = published_counter_sets(
        generations={
            (d["cluster_id"], d["driver"], d["pool"], d["pool_generation"])
            for d in devices
            if d["extra__consumesCounters"]
        }
    )
    qualify = cluster is None
    gpus: dict[tuple[int, str], PartialGpu] = {}
    by_gpu: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for device in devices:
        # Per cluster: a key partly held in one cluster may also exist whole in another.
        identity = (device["cluster_id"], device["physical_gpu_key"])
        by_gpu[identity].append(device)
        if identity not in gpus:
            node = device["node__name"]
            gpus[identity] = PartialGpu(
                cluster=device["cluster__name"],
                node=_node_label(device["cluster__name"], node, qualify) if node else "",
                physical_gpu_key=device["physical_gpu_key"],
                product_name=device["product_name"],
                unit=device["unit"],
                unit_label=unit_label(device["unit"], plural=False),
                held_share=Decimal(0),
                free_share=Decimal(0),
                held_label="",
                free_label="",
                held_devices={},
                free_slices={},
                overlapping_unheld=False,
                placeable={},
                largest_placeable="",
                largest_placeable_share=Decimal(0),
            )
    partial = []
    for identity, gpu in gpus.items():
        _tally_gpu(gpu, by_gpu[identity], counter_sets)
        if (
            gpu["held_devices"]
            and (gpu["free_slices"] or gpu["overlapping_unheld"])
            and gpu["held_share"] < 1 - _FULL_SHARE_TOLERANCE
        ):
            partial.append(gpu)
    return sorted(partial, key=lambda gpu: (gpu["node"], gpu["physical_gpu_key"]))


def _tally_gpu(
    gpu: PartialGpu,
    devices: list[dict[str, Any]],
    counter_sets: dict[PoolGeneration, dict[str, dict[str, Decimal]]],
) -> None:
    """Fill in what is held, free and placeable on one GPU from its present devices."""
    left: dict[str, dict[str, Decimal]] = {}
    for device in devices:
        generation = (
            device["cluster_id"],
            device["driver"],
            device["pool"],
            device["pool_generation"],
        )
        published = counter_sets.get(generation, {})
        for set_name in _consumed(device):
            if set_name in published and set_name not in left:
                left[set_name] = dict(published[set_name])
    for device in devices:
        if not device["held"]:
            continue
        gpu["held_share"] += device["gpu_share"]
        label = device["profile"] or device["name"]
        gpu["held_devices"][label] = gpu["held_devices"].get(label, 0) + 1
        for set_name, counters in _consumed(device).items():
            for counter, amount in counters.items():
                if set_name in left and counter in left[set_name]:
                    left[set_name][counter] -= amount
    free_share = Decimal(1) - gpu["held_share"]
    for device in devices:
        if device["held"]:
            continue
        consumed = _consumed(device)
        label = _device_label(device)
        consumes = bool(device["extra__consumesCounters"])
        if not consumes and device["kind"] in (DeviceKind.MIG, DeviceKind.PARTITION):
            gpu["free_slices"][label] = gpu["free_slices"].get(label, 0) + 1
            fits = True
        else:
            gpu["overlapping_unheld"] = True
            if consumed and all(set_name in left for set_name in consumed):
                fits = all(
                    amount <= left[set_name].get(counter, Decimal(-1))
                    for set_name, counters in consumed.items()
                    for counter, amount in counters.items()
                )
            else:
                fits = device["gpu_share"] <= free_share + _FULL_SHARE_TOLERANCE
        if fits:
            gpu["placeable"][label] = gpu["placeable"].get(label, 0) + 1
            largest = (gpu["largest_placeable_share"], gpu["largest_placeable"])
            if (device["gpu_share"], label) > largest:
                gpu["largest_placeable_share"], gpu["largest_placeable"] = (
                    device["gpu_share"],
                    label,
                )
    gpu["free_share"] = free_share
    gpu["held_label"] = _share_label(gpu["held_share"])
    gpu["free_label"] = _share_label(free_share)
    gpu["held_devices"] = dict(sorted(gpu["held_devices"].items()))
    gpu["free_slices"] = dict(sorted(gpu["free_slices"].items()))
    gpu["placeable"] = dict(sorted(gpu["placeable"].items()))


def _consumed(device: dict[str, Any]) -> dict[str, dict[str, Decimal]]:
    """What a device consumes of each counter set, summed per set and counter."""
    consumed: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for consumption in device["extra__consumesCounters"] or []:
        if isinstance(consumption, dict):
            for counter, amount in quantities(consumption.get("counters")).items():
                consumed[str(consumption.get("counterSet") or "")][counter] += amount
    return consumed


def _device_label(device: dict[str, Any]) -> str:
    """How a placeable device is named: its profile ("3g.40gb"), "whole GPU", else its share
    ("1/4 GPU", "25% TPU chip"), as partitions without a profile differ by name only."""
    unit = unit_label(device["unit"], plural=False)
    if device["profile"]:
        return str(device["profile"])
    if device["kind"] == DeviceKind.GPU:
        return f"whole {unit}"
    return f"{_share_label(device['gpu_share'])} {unit}"


def _largest_on_free_gpus(cluster: Cluster | None) -> dict[str, tuple[Decimal, str]]:
    """Per node label, the largest device on a GPU of it with nothing held, and its share."""
    # A key lives on one node; with the node in it, keys of two clusters cannot mix.
    identity = Concat(Cast("node_id", CharField()), Value(" "), "physical_gpu_key")
    held_gpus = (
        Device.objects.filter(pk__in=_held_device_ids(), node__isnull=False)
        .annotate(identity=identity)
        .values("identity")
    )
    rows = (
        _present_gpu_devices(cluster)
        .filter(node__isnull=False)
        .annotate(identity=identity)
        .exclude(identity__in=held_gpus)
        .values("cluster__name", "node__name", "kind", "profile", "unit")
        .annotate(gpu_share=Max("gpu_share"))
        .order_by()
    )
    largest: dict[str, tuple[Decimal, str]] = {}
    for row in rows:
        node = _node_label(row["cluster__name"], row["node__name"], cluster is None)
        candidate = (row["gpu_share"], _device_label(row))
        if candidate > largest.get(node, (Decimal(0), "")):
            largest[node] = candidate
    return largest


def fleet_report(*, cluster: Cluster | None = None) -> dict[str, Any]:
    """The fleet at a glance, as JSON-ready data (what `manage.py fleet_report` prints).

    Keys: `nodes` (nodes with a present GPU), `gpus_by_model` (product_name → physical units),
    `mig_devices`, `capacity` (see `capacity_by_model`; per unit and model), `driver_matrix`
    (one row per cluster, model and pair: `nodes` is the node count, `node_names` the names,
    plus `gpus`, whether it is the model's `baseline`, and its `documented_nodes` and
    `outlier_nodes`), `baseline`, `baselines`, `version_models` (per cluster and model:
    baseline, GPUs on it, outliers), `outlier_nodes` (undocumented), `documented_nodes` and
    `deviations` (see `version_matrix`; times in ISO 8601), `fragmentation` (the summary of
    `fragmentation`, with its `free_blocks` per unit and model), `partly_used_nodes` (its node
    rows in state "partly used"), `partial_gpus` (see `partial_gpus`), and `sync_warnings` (see
    `inventory.checks.sync_warnings`). GPU shares and capacities are decimal strings, as JSON
    has no exact decimals.
    """
    capacity = capacity_by_model(cluster=cluster)
    matrix = version_matrix(cluster=cluster)
    spread = fragmentation(cluster=cluster)
    return {
        "cluster": cluster.name if cluster is not None else None,
        "nodes": len(spread["nodes"]),
        "gpus_by_model": {row["product_name"]: row["gpus"] for row in capacity},
        "mig_devices": sum(row["mig_devices"] for row in capacity),
        "capacity": [
            {**row, "equivalents": f"{row['equivalents'].normalize():f}"} for row in capacity
        ],
        "driver_matrix": [
            {
                "cluster": row["cluster"],
                "product_name": row["product_name"],
                "architecture": row["architecture"],
                "driver_version": row["driver_version"],
                "cuda_driver_version": row["cuda_driver_version"],
                "nodes": len(row["nodes"]),
                "node_names": row["nodes"],
                "gpus": row["gpus"],
                "baseline": row["baseline"],
                "documented_nodes": row["documented_nodes"],
                "outlier_nodes": row["outlier_nodes"],
            }
            for row in matrix["rows"]
        ],
        "baseline": matrix["baseline"],
        "baselines": matrix["baselines"],
        "version_models": versions.jsonable(matrix["models"]),
        "outlier_nodes": matrix["outlier_nodes"],
        "documented_nodes": matrix["documented_nodes"],
        "deviations": versions.jsonable(matrix["deviations"]),
        "fragmentation": {
            "nodes_free": spread["nodes_free"],
            "nodes_partial": spread["nodes_partial"],
            "nodes_full": spread["nodes_full"],
            "largest_free_block": spread["largest_free_block"],
            "largest_free_clique_block": spread["largest_free_clique_block"],
            "free_blocks": spread["free_blocks"],
            "gpus_partial": spread["gpus_partial"],
            "partial_free_share": str(spread["partial_free_share"]),
            "partial_free_by_unit": {
                unit: str(share) for unit, share in spread["partial_free_by_unit"].items()
            },
        },
        "partly_used_nodes": [
            {
                **node,
                "free_share": str(node["free_share"]),
                "largest_placeable_share": str(node["largest_placeable_share"]),
            }
            for node in spread["nodes"]
            if node["state"] == "partly used"
        ],
        "partial_gpus": [
            {
                **gpu,
                "held_share": str(gpu["held_share"]),
                "free_share": str(gpu["free_share"]),
                "largest_placeable_share": str(gpu["largest_placeable_share"]),
            }
            for gpu in spread["partial_gpus"]
        ],
        "sync_warnings": sync_warnings(cluster=cluster),
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
