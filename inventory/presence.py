"""When each physical unit of the fleet was present, over time (issue 35, item 4).

The sync never deletes a device: one that disappears gets `gone_at`, one that comes back is a
new row with its own `first_seen` (`inventory.models`). A device's rows are so its presence
history: each row is present over `[first_seen, gone_at)`. One correction: the sync's first
import of a running cluster sees devices that were already held, their allocations starting
days before (`Allocation.start`, from the claim's own allocation time). Such a device was
there when its first allocation began, so a row is present from the earliest of its
`first_seen` and the start of its first allocation. A physical unit (a whole GPU, counted by
`physical_gpu_key`, which its MIG devices and partitions share) is present while any of its
rows is.

Nothing here is counted past `now`: an hour to come holds no unit yet.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Min, Q
from django.db.models.functions import Least

from inventory.models import Cluster, Device

HOUR = timedelta(hours=1)


@dataclass(frozen=True)
class NodeUnits:
    """Which node and unit a count of present units is of."""

    cluster: str
    node: str
    unit: str


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def hourly_units(
    *, start: datetime, hours: int, now: datetime, cluster: Cluster | None = None
) -> dict[NodeUnits, list[int]]:
    """Per node and unit, the physical units present at some moment of each of the `hours`
    hours from `start` (and before `now`): a unit there for part of an hour counts in it.
    Nodes of which no unit was present in any of the hours are absent; devices without a node
    (multi-node pools) and without a physical key (not accelerators) are not counted."""
    end = min(start + hours * HOUR, now)
    if end <= start:
        return {}
    devices = (
        Device.objects.filter(node__isnull=False)
        .exclude(physical_gpu_key="")
        .filter(Q(gone_at__isnull=True) | Q(gone_at__gt=start))
        .annotate(present_from=Least("first_seen", Min("allocations__start")))
        .filter(present_from__lt=end)
    )
    if cluster is not None:
        devices = devices.filter(cluster=cluster)
    # Per node and unit, per physical unit: the hour indexes [first, last) it was present in.
    spans: dict[NodeUnits, dict[str, list[tuple[int, int]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for cluster_name, node, unit, key, present_from, gone_at in devices.values_list(
        "cluster__name", "node__name", "unit", "physical_gpu_key", "present_from", "gone_at"
    ).order_by():
        until = end if gone_at is None else min(gone_at, end)
        first = max(math.floor((present_from - start) / HOUR), 0)
        last = math.ceil((until - start) / HOUR)  # past the hour `until` falls in, if in one
        if last > first:
            spans[NodeUnits(cluster_name, node, unit)][key].append((first, last))
    counts: dict[NodeUnits, list[int]] = {}
    for node_units, units in spans.items():
        steps = [0] * (hours + 1)
        for unit_spans in units.values():
            for first, last in _merged(unit_spans):
                steps[first] += 1
                steps[min(last, hours)] -= 1
        running, per_hour = 0, []
        for step in steps[:hours]:
            running += step
            per_hour.append(running)
        counts[node_units] = per_hour
    return counts
