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
placement when the sample was taken: on the sending node, of that parent GPU, published
without a UUID, taking exactly those memory slices, of that profile and profile id where the
sample gives them. No such device, or several: nothing is matched, and the sample is set
aside with its placement (never guessed), to be matched again once the sync has learnt more
(`metering.ingest.adopt_unknown_samples`).

Matched against the inventory of the sample's instant, not of the moment it arrives: a late
sample of a partition withdrawn since (its node drained, its driver restarted) still finds
it, as a late sample of a gone whole GPU is still stored under it; and where partitions were
published one after the other at the same placement, the sample goes to the one of its time.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Collection
from typing import Any, NamedTuple

from django.db.models import Q

from inventory.models import Device, DeviceKind
from metering.hours import EPOCH, ONE_MS, epoch_ms

# A counter of one memory slice: the driver's `memory-slice-3`, or KEP-4815's example's
# `memorySlice3`.
_MEMORY_SLICE = re.compile(r"memory-?[sS]lice-?(\d+)")
# The driver's name of a dynamic MIG partition: its GI profile id and placement start last.
_PARTITION_NAME = re.compile(r"gpu-\d+-mig-.+-(\d+)-(\d+)")


class GpuInstance(NamedTuple):
    """A MIG device's GPU instance as NVML reads it: its parent GPU's UUID and GPU instance
    id, what DCGM labels its series by (`UUID`, `GPU_I_ID`)."""

    parent_uuid: str
    gpu_instance_id: int


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
    """A partition device published without a UUID: its profile, name and meter id, and
    when the inventory had it, `[first_ms, gone_ms)` (ms since the epoch; None: present)."""

    profile: str
    name: str
    meter_id: str
    first_ms: int
    gone_ms: int | None


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


def _meter_id_then(fitting: list[_Partition], ts_ms: int) -> str | None:
    """The meter id of the partition of `fitting` (all at one placement) that a sample at
    `ts_ms` was taken on, or None where none or several can be.

    Those gone by then are out (`gone_at` is when the sync saw the device withdrawn, after
    the driver withdrew it). Of the others, the ones present then (first seen at or before
    `ts_ms`); where none was, the sync had not seen it yet (a new node, the sync behind the
    agent), and those first seen later are. One meter id among them, or nothing: a partition
    withdrawn and published again under its name keeps its meter id, two devices that fit
    the same placement at once have two."""
    live = [
        partition for partition in fitting if partition.gone_ms is None or partition.gone_ms > ts_ms
    ]
    present = [partition for partition in live if partition.first_ms <= ts_ms]
    meter_ids = {partition.meter_id for partition in present or live}
    return meter_ids.pop() if len(meter_ids) == 1 else None


class PartitionTimeline(NamedTuple):
    """Which partition device one placement's samples go to, by when they were taken: the
    meter id (None: no one partition) is `meter_ids[i]` from `changes[i - 1]` (included) to
    `changes[i]`, so a batch of a placement's samples is matched without a query or a list
    per sample."""

    changes: list[int]  # ms since the epoch, ascending
    meter_ids: list[str | None]  # one more than `changes`

    def meter_id_at(self, ts_ms: int) -> str | None:
        """The meter id of the one partition a sample taken at `ts_ms` goes to, or None."""
        return self.meter_ids[bisect_right(self.changes, ts_ms)]

    @classmethod
    def of(cls, fitting: list[_Partition]) -> PartitionTimeline:
        """The timeline of partitions that all fit one placement (`_meter_id_then`, which
        changes only where one of them was first seen or went)."""
        changes = sorted(
            {partition.first_ms for partition in fitting}
            | {partition.gone_ms for partition in fitting if partition.gone_ms is not None}
        )
        starts = [changes[0] - 1, *changes]  # an instant of each span: before, then each start
        return cls(changes, [_meter_id_then(fitting, ts_ms) for ts_ms in starts])


def partitions_at(
    placements: Collection[MigPlacement], *, node: str, cluster_id: int | None, since_ms: int
) -> dict[MigPlacement, PartitionTimeline]:
    """For each placement on `node` (in cluster `cluster_id`; any, for None) that partition
    devices fit, the one its samples taken from `since_ms` on go to (`_meter_id_then`); one
    query."""
    if not placements:
        return {}
    devices = Device.objects.filter(
        Q(gone_at__isnull=True) | Q(gone_at__gt=EPOCH + since_ms * ONE_MS),
        node__name=node,
        kind=DeviceKind.MIG,
        uuid="",
        parent_uuid__in={placement.parent_uuid for placement in placements},
    ).exclude(meter_id="")
    if cluster_id is not None:
        devices = devices.filter(cluster_id=cluster_id)
    at: dict[tuple[str, int, int], list[_Partition]] = defaultdict(list)
    for parent, profile, name, meter_id, extra, first_seen, gone_at in devices.values_list(
        "parent_uuid", "profile", "name", "meter_id", "extra", "first_seen", "gone_at"
    ):
        slices = memory_slices(extra)
        if slices is not None:
            start, size = slices
            at[parent, start, size].append(
                _Partition(
                    profile,
                    name,
                    meter_id,
                    epoch_ms(first_seen),
                    None if gone_at is None else epoch_ms(gone_at),
                )
            )
    found: dict[MigPlacement, PartitionTimeline] = {}
    for placement in placements:
        fitting = [
            partition
            for partition in at.get((placement.parent_uuid, placement.start, placement.size), ())
            if _fits(partition, placement)
        ]
        if fitting:
            found[placement] = PartitionTimeline.of(fitting)
    return found
