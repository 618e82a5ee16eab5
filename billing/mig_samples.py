"""Samples of NVIDIA MIG devices made when a claim is prepared (dynamic MIG), matched to the
partition device the DRA driver published for their placement.

With its DynamicMIG feature, NVIDIA's DRA driver publishes every placement a GPU offers a MIG
profile at as a partitionable device (KEP-4815), before any MIG device exists: named
`gpu-<minor>-mig-<profile without dots>-<GI profile id>-<placement start>`, with the
attributes `type: mig`, `parentUUID` and `profile` but no `uuid`, consuming from its GPU's
counter set one `memory-slice-<i>` counter per memory slice it occupies, `[start, start +
size)`. The MIG device, and so its UUID, is created only when a claim allocated to that
partition is prepared (a new UUID each time), so no ResourceSlice carries the UUID the node
agent reads its samples under.

Where the MIG device sits identifies it on both sides: NVML gives its parent GPU and, through
its GPU instance (`nvmlGpuInstanceGetInfo`), its GI profile id and placement (start and size
in memory slices); the driver publishes the same as the partition's `parentUUID`, its
memory-slice counters and (in its name) its profile id. The agent sends them with a MIG
device's sample (`MigPlacement`), and `partitions_at` finds the one partition device at that
placement: on the sending node, of that parent GPU, published without a UUID, taking exactly
those memory slices, of that profile and profile id where the sample gives them. No such
device, or several: nothing is matched, and the sample is set aside under its MIG UUID as
any unknown device's (never guessed).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from typing import Any, NamedTuple

from inventory.models import Device, DeviceKind

# A counter of one memory slice: the driver's `memory-slice-3`, or KEP-4815's example's
# `memorySlice3`.
_MEMORY_SLICE = re.compile(r"memory-?[sS]lice-?(\d+)")
# The driver's name of a dynamic MIG partition: its GI profile id and placement start last.
_PARTITION_NAME = re.compile(r"gpu-\d+-mig-.+-(\d+)-(\d+)")


class MigPlacement(NamedTuple):
    """Where a MIG device sits on its GPU, as NVML reads it: the parent GPU's UUID, the
    memory slices `[start, start + size)` its GPU instance occupies, its profile ("" not
    read) and its GPU instance profile id (None: not read)."""

    parent_uuid: str
    start: int
    size: int
    profile: str = ""
    profile_id: int | None = None


class _Partition(NamedTuple):
    """A partition device published without a UUID: where it sits, and its meter id."""

    profile: str
    name: str
    meter_id: str


def memory_slices(extra: dict[str, Any]) -> tuple[int, int] | None:
    """(start, size) of the memory slices a device consumes (`extra["consumesCounters"]`, as
    the inventory keeps it), or None where it consumes none or not one contiguous run."""
    taken = sorted(
        int(match[1])
        for consumption in extra.get("consumesCounters") or ()
        if isinstance(consumption, dict)
        for name in consumption.get("counters") or ()
        if (match := _MEMORY_SLICE.fullmatch(name))
    )
    if not taken or taken != list(range(taken[0], taken[0] + len(taken))):
        return None
    return taken[0], len(taken)


def _named_placement(name: str) -> tuple[int, int] | None:
    """(GI profile id, placement start) from a name the driver formed, or None."""
    match = _PARTITION_NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


def _fits(partition: _Partition, placement: MigPlacement) -> bool:
    """Whether `partition` (at `placement`'s memory slices already) is of its profile and
    profile id, as far as the sample gives them and the driver's name says."""
    if placement.profile and partition.profile != placement.profile:
        return False
    named = _named_placement(partition.name)
    return (
        placement.profile_id is None
        or named is None
        or named
        == (
            placement.profile_id,
            placement.start,
        )
    )


def partitions_at(
    placements: Collection[MigPlacement], *, node: str, cluster_id: int | None
) -> dict[MigPlacement, str]:
    """The meter id of the one present partition device at each placement on `node` (in
    cluster `cluster_id`; any, for None), for the placements exactly one device fits; one
    query."""
    if not placements:
        return {}
    devices = Device.objects.filter(
        gone_at__isnull=True,
        node__name=node,
        kind=DeviceKind.MIG,
        uuid="",
        parent_uuid__in={placement.parent_uuid for placement in placements},
    ).exclude(meter_id="")
    if cluster_id is not None:
        devices = devices.filter(cluster_id=cluster_id)
    at: dict[tuple[str, int, int], list[_Partition]] = defaultdict(list)
    for parent, profile, name, meter_id, extra in devices.values_list(
        "parent_uuid", "profile", "name", "meter_id", "extra"
    ):
        slices = memory_slices(extra)
        if slices is not None:
            start, size = slices
            at[parent, start, size].append(_Partition(profile, name, meter_id))
    found: dict[MigPlacement, str] = {}
    for placement in placements:
        fitting = [
            partition
            for partition in at.get((placement.parent_uuid, placement.start, placement.size), ())
            if _fits(partition, placement)
        ]
        if len(fitting) == 1:
            found[placement] = fitting[0].meter_id
    return found
