"""Writes to the inventory: snapshots and watch events from Kubernetes become rows.

Every function here takes plain Python data (the JSON of Kubernetes objects), so the same
code serves `sync_inventory --from-file`, the live list + watch, tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from inventory.models import Cluster

# The object kinds the inventory keeps; anything else in a dump is skipped and counted.
KINDS = ("Node", "DeviceClass", "ResourceSlice", "ResourceClaim")


@dataclass
class SyncReport:
    """What one import or event did, and the objects it rejected with the reason."""

    created: dict[str, int] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    gone: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def get_cluster(name: str) -> Cluster:
    """The cluster called `name`, created on first use."""
    cluster, _ = Cluster.objects.get_or_create(name=name)
    return cluster


def import_snapshot(
    *,
    cluster: Cluster,
    objects: Iterable[dict[str, Any]],
    at: datetime,
    kinds: Iterable[str] | None = None,
) -> SyncReport:
    """Apply a full snapshot of `kinds` (default: the kinds that occur in `objects`) taken at `at`.

    New objects appear, changed ones are updated, and known objects of those kinds that are
    missing are marked gone at `at` (claims released, their allocations ended). Malformed
    objects are reported in `errors` (naming the object and field) and the rest still loads;
    a malformed object that was known before is left as it was, not marked gone.
    `objects` is consumed once, as a stream, so a large dump need not fit in memory.
    """
    raise NotImplementedError


def apply_watch_event(
    *, cluster: Cluster, event_type: str, obj: dict[str, Any], at: datetime
) -> SyncReport:
    """Apply one watch event (`ADDED`, `MODIFIED` or `DELETED`) observed at `at`.

    `obj` must carry `kind` (the sync sets it, since watch events from typed lists may not).
    BOOKMARK and ERROR events are the caller's business and are not passed here.
    """
    raise NotImplementedError
