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
- A device several claims share (KEP-5075 consumable capacity, `allowMultipleAllocations`:
  an AMD GPU in an auto-partition mode, an NVIDIA GPU shared by memory) is held by the
  capacity its open allocations consumed: per capacity their sum over the device's value, the
  most of any capacity (a share that names none holds it all, as billing meters it). One CPX
  share of an MI300X in an eight-partition mode holds 1/8 of it; its GPU is partly used while
  another share still fits, full once none does. A share offered on such a device is a
  fraction of each of its capacities, as its `requestPolicy` allows.
- Shares count the device's `unit` (GPUs, TPU chips, Gaudi cards): one physical unit is 1.
  Units never add up across units or models: capacity is per unit and model, and so is every
  free block (8 free H100s and 4 free TPU chips on one node are no block of 12).

When `cluster` is None a function covers all clusters; node names are then written
`cluster/node`, since a node name is unique only within its cluster.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, NamedTuple, TypedDict

from django.conf import settings
from django.db.models import (
    BooleanField,
    Case,
    CharField,
    Count,
    F,
    JSONField,
    Max,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Cast, Concat
from kubernetes.utils import parse_quantity

from inventory import kube, taints, versions
from inventory.capacity import CapacityError, capacity_name, largest_allowed, requested_amounts
from inventory.checks import PoolGeneration, published_counter_sets, quantities, sync_warnings
from inventory.models import Allocation, Cluster, Device, DeviceKind
from inventory.profiles import unit_label, unit_order
from inventory.versions import DeviationInfo, VersionMatrix
from teams.models import Team, TeamNamespace

# Shares are stored to 6 places, so seven 1g slices sum to 0.999999: within this of 1 a GPU
# is fully held.
_FULL_SHARE_TOLERANCE = Decimal("0.0001")
# Shares of a shared device are kept to the millionth, as stored shares are.
_MILLIONTH = Decimal("0.000001")
# Devices several claims may hold at once, each a share of the device's capacity (KEP-5075).
_SHARED = Q(extra__allowMultipleAllocations=True)


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
    # Held devices by profile (a device without one by name); a shared device counts once per
    # claim holding a share of it.
    held_devices: dict[str, int]
    # Unheld slices that overlap nothing (static MIG devices, fixed partitions), and the shares
    # a claim asking for no amount would get that still fit on held shared devices, by profile
    # (a share of a device without one by its share, "10% GPU"): a claim can get each of them
    # as they are, all at once.
    free_slices: dict[str, int]
    # Whether unheld devices that overlap others (KEP-4815 partitions, the whole GPU) exist.
    overlapping_unheld: bool
    # Unheld devices a claim could get now, by profile (else share): the free slices, and
    # overlapping devices whose counters fit in what the held ones leave of their counter
    # set (where the set is not stored, whose share fits in the free share), and on held
    # shared devices the free shares and the largest share one claim could still get. Each on
    # its own: taking one may rule out others.
    placeable: dict[str, int]
    # Those of them that are no free slice (overlapping devices, the largest share of a shared
    # device), which a claim can get only each on its own.
    placeable_alone: dict[str, int]
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
            # Multi-host devices that count several units (see `_multi_host_units`).
            spanning=Count("pk", filter=Q(node__isnull=True, gpu_share__gt=1)),
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
            (unit_order(unit), unit, product),
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
    spanning = any(row["spanning"] for row in counts)
    for extra in _multi_host_units(cluster) if spanning else ():
        spanned = totals.get((unit_order(extra["unit"]), extra["unit"], extra["product_name"]))
        if spanned is None or extra["units"] is None:
            continue
        # Counted above as one unit; it holds `units`, of which `held` are taken.
        units = int(extra["units"])
        held = min(units, math.ceil(extra["held"] or 0))
        spanned["gpus"] += units - 1
        spanned["allocated"] += held - (1 if held else 0)
        spanned["free"] += (units - 1) - (held - (1 if held else 0))
        spanned["equivalents"] += units - 1
    return [totals[key] for key in sorted(totals)]


def _multi_host_units(cluster: Cluster | None) -> QuerySet[Device, dict[str, Any]]:
    """Physical keys that hold several units: those of a multi-host device (KEP-4815, no node
    of its own: it spans several) that counts more than one unit, a 4x4 TPU slice over four
    nodes 16 chips. Per key, the units its largest such device counts and the units its held
    devices take. A device that spans two GPUs of one node (it has a node) is not one: each
    GPU is a key of its own already."""
    spanning = (
        _present_gpu_devices(cluster)
        .filter(node__isnull=True, gpu_share__gt=1)
        .values("physical_gpu_key")
    )
    return (
        _present_gpu_devices(cluster)
        .filter(physical_gpu_key__in=spanning)
        .values("cluster_id", "unit", "product_name", "physical_gpu_key")
        .annotate(
            units=Max("gpu_share", filter=Q(node__isnull=True)),
            held=Sum("gpu_share", filter=Q(pk__in=_held_device_ids())),
        )
        .order_by()
    )


def _multi_host_keys(cluster: Cluster | None) -> QuerySet[Device, Any]:
    """Physical keys of multi-host sets (KEP-4815: a device with no node of its own that
    spans several and counts more than one unit), as a subquery."""
    return (
        _present_gpu_devices(cluster)
        .filter(node__isnull=True, gpu_share__gt=1)
        .values("physical_gpu_key")
    )


def _multi_host_free_blocks(cluster: Cluster | None) -> dict[tuple[str, str], int]:
    """Per unit and model, the most whole units one device of a multi-host set a claim could
    be given now counts (a 4x4 TPU slice over four nodes, a half of it, one host's 2x2): an
    unheld one whose counters fit in what the set's held devices leave (a 2x4 half of a 4x4
    slice whose other half is held: 8). Where its pool's counter set is not stored, one is
    placeable when no held device consumes a counter it consumes. Two queries."""
    devices = list(
        _present_gpu_devices(cluster)
        .filter(physical_gpu_key__in=_multi_host_keys(cluster))
        .annotate(
            held=Case(
                When(pk__in=_held_device_ids(), then=True),
                default=False,
                output_field=BooleanField(),
            )
        )
        .values(
            "cluster_id",
            "driver",
            "pool",
            "pool_generation",
            "physical_gpu_key",
            "unit",
            "product_name",
            "gpu_share",
            "extra__consumesCounters",
            "held",
        )
    )
    if not devices:
        return {}
    totals = published_counter_sets(
        generations={
            (d["cluster_id"], d["driver"], d["pool"], d["pool_generation"]) for d in devices
        }
    )
    held: dict[tuple[int, str], dict[tuple[str, str], Decimal]] = defaultdict(
        lambda: defaultdict(Decimal)
    )
    for device in devices:
        if device["held"]:
            consumed = held[(device["cluster_id"], device["physical_gpu_key"])]
            for counter_set, counters in _consumed(device).items():
                for counter, amount in counters.items():
                    consumed[(counter_set, counter)] += amount
    blocks: dict[tuple[str, str], int] = defaultdict(int)
    for device in devices:
        if device["held"]:
            continue
        taken = held.get((device["cluster_id"], device["physical_gpu_key"]), {})
        published = totals.get(
            (device["cluster_id"], device["driver"], device["pool"], device["pool_generation"]),
            {},
        )
        fits = all(
            (
                taken.get((counter_set, counter), Decimal(0)) + amount
                <= published[counter_set][counter]
            )
            if counter in published.get(counter_set, {})
            else not taken.get((counter_set, counter))
            for counter_set, counters in _consumed(device).items()
            for counter, amount in counters.items()
        )
        if fits:
            key = (device["unit"], device["product_name"])
            blocks[key] = max(blocks[key], int(device["gpu_share"]))
    return dict(blocks)


def version_matrix(*, cluster: Cluster | None = None) -> VersionMatrix:
    """Which driver/CUDA pairs run where, per cluster and GPU model: the baseline (set or
    computed), the nodes and GPUs on it, the outliers and the deviations documenting them.

    See `inventory.versions.version_matrix`, which this is.
    """
    return versions.version_matrix(cluster=cluster)


def version_taint_state(*, cluster: Cluster | None = None) -> taints.TaintState | None:
    """The DeviceTaintRules Tally plans for the GPUs off their baseline, read back from the
    cluster: applied, planned and not applied, or held by the limit (`taints.taint_state`).

    Tally's Kubernetes client reaches the cluster it runs in (TALLY_CLUSTER_NAME) only: None
    when that one is not covered (`cluster` another) or not synced yet. A cluster that cannot
    be read is said so in the state's `error`, never raised.
    """
    own = Cluster.objects.filter(name=settings.TALLY_CLUSTER_NAME).first()
    if own is None or (cluster is not None and cluster.pk != own.pk):
        return None
    try:
        # No retries: a page waits for this read, and each try may wait its whole timeout.
        client = kube.api_client(retries=0)
    except kube.KubeError as exc:
        return taints.unread_state(plan=taints.taint_plan(cluster=own), error=str(exc))
    try:
        return taints.taint_state(cluster=own, api_client=client)
    finally:
        client.close()


class DeviationRow(DeviationInfo):
    """One deviation of the register, with what it documents now and its taint's state."""

    # Physical GPUs off their baseline it documents now (0: it documents nothing).
    documented_gpus: int
    taint_state: str


EXPIRED_STATE = "expired: its GPUs are outliers again"
NOTHING_STATE = "no taint: it documents no GPU off its baseline"
UNREAD_STATE = "unknown: Tally reads the taints of its own cluster only"


def deviation_register(*, cluster: Cluster | None = None) -> list[DeviationRow]:
    """Every deviation of the clusters covered, the active ones first, soonest to expire
    first, then the expired ones, latest first; each with the GPUs it documents and the state
    of the taint on them, read from the cluster (`version_taint_state`). For operators and
    finance (fleet-wide: no team's data)."""
    matrix = version_matrix(cluster=cluster)
    state = version_taint_state(cluster=cluster)
    own = settings.TALLY_CLUSTER_NAME
    documented: dict[int, list[versions.Outlier]] = defaultdict(list)
    for model in matrix["models"]:
        for outlier in model["outliers"]:
            if outlier["deviation"] is not None:
                documented[outlier["deviation"]["id"]].append(outlier)
    rows = []
    for deviation in matrix["deviations"]:
        outliers = documented.get(deviation["id"], [])
        if deviation["expired"]:
            taint = EXPIRED_STATE
        elif not outliers:
            taint = NOTHING_STATE
        elif state is None or deviation["cluster"] != own:
            taint = UNREAD_STATE
        else:
            states = {
                state.of_pool(outlier["driver"], outlier["pool"]) or taints.PLANNED
                for outlier in outliers
            }
            taint = "; ".join(sorted(states))
            if state.error:
                taint += f" ({state.error})"
        rows.append(
            DeviationRow(
                **deviation,
                documented_gpus=sum(outlier["gpus"] for outlier in outliers),
                taint_state=taint,
            )
        )
    active = sorted((r for r in rows if not r["expired"]), key=lambda r: (r["expires_at"], r["id"]))
    expired = sorted(
        (r for r in rows if r["expired"]), key=lambda r: (r["expires_at"], r["id"]), reverse=True
    )
    return active + expired


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
        .annotate(
            multi_host=Case(
                When(physical_gpu_key__in=_multi_host_keys(cluster), then=True),
                default=False,
                output_field=BooleanField(),
            )
        )
        .values(
            "cluster__name",
            "node_id",
            "node__name",
            "node__clique",
            "unit",
            "product_name",
            "multi_host",
        )
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
            (unit_order(unit), unit, product),
            FreeBlock(
                unit=unit,
                unit_label=unit_label(unit),
                product_name=product,
                largest_free_block=0,
                largest_free_clique_block=0,
            ),
        )
        if row["multi_host"]:
            # A host of a multi-host set: its free chips are weighed with the set's slices
            # below, as what it offers depends on what the set's other slices hold.
            continue
        block["largest_free_block"] = max(block["largest_free_block"], free)
        # Clique ids are only meaningful within a cluster; a node without one is its own group.
        group = row["node__clique"] or ("node", row["node_id"])
        free_by_model_clique[(unit, product, row["cluster__name"], group)] += free
    for (unit, product, _, _), free in free_by_model_clique.items():
        block = blocks[(unit_order(unit), unit, product)]
        block["largest_free_clique_block"] = max(block["largest_free_clique_block"], free)
    # A multi-host device (a 4x4 TPU slice over four nodes) is one block of all the units it
    # counts, on its own interconnect: on no node row, but a claim can be given it whole.
    for (unit, product), units in _multi_host_free_blocks(cluster).items():
        block = blocks.setdefault(
            (unit_order(unit), unit, product),
            FreeBlock(
                unit=unit,
                unit_label=unit_label(unit),
                product_name=product,
                largest_free_block=0,
                largest_free_clique_block=0,
            ),
        )
        block["largest_free_block"] = max(block["largest_free_block"], units)
        block["largest_free_clique_block"] = max(block["largest_free_clique_block"], units)
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
    free share. A held shared device (KEP-5075) holds the share its allocations consumed (see
    the module's counting rules) and offers what is left of its capacity. Two queries at
    most, whatever the size of the fleet, and one more for the allocations of held shared
    devices where there are any.
    """
    held = _held_device_ids()
    # Keys of GPUs partly held, as a subquery: one round trip, and only their devices return.
    # A GPU with a held shared device may be partly used whatever its devices' shares say.
    partly_held = (
        _present_gpu_devices(cluster)
        .values("cluster_id", "physical_gpu_key")
        .annotate(
            devices=Count("pk"),
            held_devices=Count("pk", filter=Q(pk__in=held)),
            held_shared=Count("pk", filter=Q(pk__in=held) & _SHARED),
            held_share=Sum("gpu_share", filter=Q(pk__in=held)),
        )
        .filter(
            Q(held_shared__gt=0)
            | Q(held_devices__lt=F("devices"), held_share__lt=1 - _FULL_SHARE_TOLERANCE),
            held_devices__gt=0,
        )
        .order_by()
        .values("physical_gpu_key")
    )
    devices = list(
        _present_gpu_devices(cluster)
        .filter(physical_gpu_key__in=partly_held)
        .annotate(
            held=Case(When(pk__in=held, then=True), default=False, output_field=BooleanField()),
            shared=Case(When(_SHARED, then=True), default=False, output_field=BooleanField()),
        )
        .values(
            "pk",
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
            "capacity",
            "extra__consumesCounters",
            "held",
            "shared",
        )
        .order_by("name")
    )
    shares = _consumed_shares([d["pk"] for d in devices if d["held"] and d["shared"]])
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
                placeable_alone={},
                largest_placeable="",
                largest_placeable_share=Decimal(0),
            )
    partial = []
    for identity, gpu in gpus.items():
        _tally_gpu(gpu, by_gpu[identity], counter_sets, shares)
        # Nothing unheld and no room on its shared devices: full, whatever the shares sum to.
        if (
            gpu["held_devices"]
            and (gpu["free_slices"] or gpu["overlapping_unheld"] or gpu["placeable"])
            and gpu["held_share"] < 1 - _FULL_SHARE_TOLERANCE
        ):
            partial.append(gpu)
    return sorted(partial, key=lambda gpu: (gpu["node"], gpu["physical_gpu_key"]))


def _tally_gpu(
    gpu: PartialGpu,
    devices: list[dict[str, Any]],
    counter_sets: dict[PoolGeneration, dict[str, dict[str, Decimal]]],
    shares: dict[int, list[dict[str, Any]]],
) -> None:
    """Fill in what is held, free and placeable on one GPU from its present devices and the
    consumed capacity of the shares held on its shared devices (`shares`, by device id)."""

    def offer(label: str, share: Decimal, count: int, *, alone: bool) -> None:
        gpu["placeable"][label] = gpu["placeable"].get(label, 0) + count
        if alone:
            gpu["placeable_alone"][label] = gpu["placeable_alone"].get(label, 0) + count
        if (share, label) > (gpu["largest_placeable_share"], gpu["largest_placeable"]):
            gpu["largest_placeable_share"], gpu["largest_placeable"] = share, label

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
    # Held shared devices and what is left of each of their capacities.
    shared_left: list[tuple[dict[str, Any], dict[str, Decimal]]] = []
    for device in devices:
        if not device["held"]:
            continue
        label = device["profile"] or device["name"]
        if device["shared"]:
            held_shares = shares.get(device["pk"], [])
            fraction, capacity_left = _shared_use(device, held_shares)
            gpu["held_share"] += _units(device, fraction)
            gpu["held_devices"][label] = gpu["held_devices"].get(label, 0) + len(held_shares)
            shared_left.append((device, capacity_left))
        else:
            gpu["held_share"] += device["gpu_share"]
            gpu["held_devices"][label] = gpu["held_devices"].get(label, 0) + 1
        # Counters are consumed once per device, however many claims share it.
        for set_name, counters in _consumed(device).items():
            for counter, amount in counters.items():
                if set_name in left and counter in left[set_name]:
                    left[set_name][counter] -= amount
    free_share = Decimal(1) - gpu["held_share"]
    for device, capacity_left in shared_left:
        room = _room(device, capacity_left)
        if room.default_shares:
            label = _shared_label(device, room.default_fraction, room)
            gpu["free_slices"][label] = gpu["free_slices"].get(label, 0) + room.default_shares
            offer(label, _units(device, room.default_fraction), room.default_shares, alone=False)
        # The largest share one claim could get, where it is more than a free share.
        if room.largest_fraction and (
            not room.default_shares or room.largest_fraction > room.default_fraction
        ):
            offer(
                _shared_label(device, room.largest_fraction, room),
                _units(device, room.largest_fraction),
                1,
                alone=True,
            )
    for device in devices:
        if device["held"]:
            continue
        consumed = _consumed(device)
        label, share = _offered(device)
        # Slices that consume no counters overlap nothing; anything else overlaps others.
        alone = bool(device["extra__consumesCounters"]) or device["kind"] not in (
            DeviceKind.MIG,
            DeviceKind.PARTITION,
        )
        if not alone:
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
                fits = share <= free_share + _FULL_SHARE_TOLERANCE
        if fits and (share or not device["shared"]):
            offer(label, share, 1, alone=alone)
    gpu["free_share"] = free_share
    gpu["held_label"] = _share_label(gpu["held_share"])
    gpu["free_label"] = _share_label(free_share)
    gpu["held_devices"] = dict(sorted(gpu["held_devices"].items()))
    gpu["free_slices"] = dict(sorted(gpu["free_slices"].items()))
    gpu["placeable"] = dict(sorted(gpu["placeable"].items()))
    gpu["placeable_alone"] = dict(sorted(gpu["placeable_alone"].items()))


def _consumed_shares(device_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """The consumed capacity of each open allocation of the given (shared) devices, by device
    id; no query when there are none."""
    shares: dict[int, list[dict[str, Any]]] = defaultdict(list)
    if device_ids:
        for device_id, consumed in Allocation.objects.filter(
            end__isnull=True, device_id__in=device_ids
        ).values_list("device_id", "consumed_capacity"):
            shares[device_id].append(consumed if isinstance(consumed, dict) else {})
    return shares


def _shared_use(
    device: Mapping[str, Any], shares: list[dict[str, Any]]
) -> tuple[Decimal, dict[str, Decimal]]:
    """The part of a shared device its held `shares` (consumed capacity, by any name the
    device's capacity answers to) take, and what they leave of each capacity.

    The part is, per capacity, what the shares consumed over its value, the most of any
    capacity, at most 1. A share that names no capacity of the device holds all of it, as
    billing meters it (`inventory.claim_sync.allocation_metering`); so does anything held on a
    device with no capacity to share."""
    capacity = device["capacity"] or {}
    values = quantities(capacity)
    used = dict.fromkeys(values, Decimal(0))
    for consumed in shares:
        amounts = {
            key: Decimal(parse_quantity(amount))
            for name, amount in consumed.items()
            if (key := capacity_name(capacity, name, device["driver"])) in values
        }
        if not amounts:
            used = dict(values)
            break
        for key, amount in amounts.items():
            used[key] += amount
    fraction = max(
        (used[key] / value for key, value in values.items() if value > 0), default=Decimal(1)
    )
    return min(fraction, Decimal(1)), {
        key: max(value - used[key], Decimal(0)) for key, value in values.items()
    }


class _Room(NamedTuple):
    """What claims could still get of a shared device, as fractions of each of its capacities:
    how many shares of what a claim asking for no amount gets (`default_fraction`) fit at
    once, and the largest share one claim could get (0: none fits)."""

    default_shares: int
    default_fraction: Decimal
    largest_fraction: Decimal


def _room(device: Mapping[str, Any], capacity_left: Mapping[str, Decimal]) -> _Room:
    """The `_Room` on a shared device with `capacity_left` of each capacity, as its capacities'
    `requestPolicy` allow (KEP-5075: `inventory.capacity` rounds requests up to them)."""
    capacity = device["capacity"] or {}
    values = {key: value for key, value in quantities(capacity).items() if value > 0}
    largest: list[Decimal] = []
    for key, value in values.items():
        allowed = largest_allowed(capacity[key], capacity_left.get(key, Decimal(0)))
        if allowed is None:
            return _Room(0, Decimal(0), Decimal(0))
        largest.append(allowed / value)
    if not largest:
        return _Room(0, Decimal(0), Decimal(0))
    try:
        default = requested_amounts(capacity, {}, device["driver"])
    except CapacityError:  # a policy's default it does not allow: no claim gets a default share
        return _Room(0, Decimal(0), min(largest))
    default_shares = min(
        (int(capacity_left.get(key, 0) // default[key]) for key in values if default[key] > 0),
        default=0,
    )
    return _Room(
        default_shares, min(default[key] / value for key, value in values.items()), min(largest)
    )


def _units(device: Mapping[str, Any], fraction: Decimal) -> Decimal:
    """A fraction of a device in its unit, to the millionth."""
    share: Decimal = device["gpu_share"] * fraction
    return share.quantize(_MILLIONTH)


def _shared_label(device: Mapping[str, Any], fraction: Decimal, room: _Room) -> str:
    """How a share of a shared device is named: the device's own label for all of it, its
    profile for the share a claim gets by default ("cpx_nps1": one CPX partition), else the
    share ("10% GPU")."""
    if fraction == 1:
        return _device_label(device)
    if device["profile"] and fraction == room.default_fraction:
        return str(device["profile"])
    return f"{_share_label(_units(device, fraction))} {unit_label(device['unit'], plural=False)}"


def _offered(device: Mapping[str, Any]) -> tuple[str, Decimal]:
    """What a claim could get of an unheld device, named, and its share: all of it, but of a
    shared device only the largest share its policies allow."""
    if not device.get("shared"):
        return _device_label(device), device["gpu_share"]
    room = _room(device, quantities(device["capacity"] or {}))
    return _shared_label(device, room.largest_fraction, room), _units(device, room.largest_fraction)


def _consumed(device: dict[str, Any]) -> dict[str, dict[str, Decimal]]:
    """What a device consumes of each counter set, summed per set and counter."""
    consumed: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for consumption in device["extra__consumesCounters"] or []:
        if isinstance(consumption, dict):
            for counter, amount in quantities(consumption.get("counters")).items():
                consumed[str(consumption.get("counterSet") or "")][counter] += amount
    return consumed


def _device_label(device: Mapping[str, Any]) -> str:
    """How a placeable device is named: its profile ("3g.40gb"), "whole GPU", else its share
    ("1/4 GPU", "25% TPU chip"), as partitions without a profile differ by name only."""
    unit = unit_label(device["unit"], plural=False)
    if device["profile"]:
        return str(device["profile"])
    if device["kind"] == DeviceKind.GPU:
        return f"whole {unit}"
    return f"{_share_label(device['gpu_share'])} {unit}"


def _largest_on_free_gpus(cluster: Cluster | None) -> dict[str, tuple[Decimal, str]]:
    """Per node label, the largest device on a GPU of it with nothing held, and its share (of
    a shared device, the largest share one claim could get of it)."""
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
        # A shared device's capacity says what a claim gets of it: one row per capacity.
        .annotate(
            capacity_shared=Case(
                When(_SHARED, then=F("capacity")), default=None, output_field=JSONField()
            )
        )
        .values(
            "cluster__name", "node__name", "driver", "kind", "profile", "unit", "capacity_shared"
        )
        .annotate(gpu_share=Max("gpu_share"))
        .order_by()
    )
    largest: dict[str, tuple[Decimal, str]] = {}
    for row in rows:
        node = _node_label(row["cluster__name"], row["node__name"], cluster is None)
        shared = row["capacity_shared"] is not None
        label, share = _offered({**row, "shared": shared, "capacity": row["capacity_shared"]})
        candidate = (share, label)
        if candidate > largest.get(node, (Decimal(0), "")):
            largest[node] = candidate
    return largest


def fleet_report(*, cluster: Cluster | None = None) -> dict[str, Any]:
    """The fleet at a glance, as JSON-ready data (what `manage.py fleet_report` prints).

    Keys: `nodes` (nodes with a present GPU), `gpus_by_model` (product_name → physical units),
    `mig_devices`, `capacity` (see `capacity_by_model`; per unit and model), `driver_matrix`
    (one row per cluster, model and pair: `nodes` is the node count, `node_names` the names,
    plus `gpus`, whether it is the model's `baseline`, and its `documented_nodes` and
    `outlier_nodes`), `baseline`, `baselines`, `version_models` (per cluster, driver and
    model: baseline, GPUs on it, outliers), `outlier_nodes` (undocumented), `documented_nodes`,
    `unknown_nodes`, `outlier_gpus` and `deviations` (see `version_matrix`; times in ISO
    8601), `fragmentation` (the summary of `fragmentation`, with its `free_blocks` per unit
    and model), `partly_used_nodes` (its node rows in state "partly used"), `partial_gpus`
    (see `partial_gpus`), and `sync_warnings` (see `inventory.checks.sync_warnings`). GPU
    shares and capacities are decimal strings, as JSON has no exact decimals.
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
        "unknown_nodes": matrix["unknown_nodes"],
        "outlier_gpus": matrix["outlier_gpus"],
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


def team_open_allocations(team: Team) -> QuerySet[Allocation]:
    """The allocations still held by claims in the namespaces `team` owns now (the current
    ownerships, `TeamNamespace.objects`): what a team's pages show as its open allocations
    (the team page's idle holders, its live claims). The one place this is worked out."""
    return Allocation.objects.filter(
        end__isnull=True,
        claim__namespace__in=TeamNamespace.objects.filter(team=team).values("namespace"),
    )
