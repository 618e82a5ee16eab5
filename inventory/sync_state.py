"""The state a sync writer keeps while it writes one snapshot or batch of watch events
(`inventory.services`): the report, what is buffered, and the stamps of the run; the slice
side (`inventory.slice_sync`) and the claim side (`inventory.claim_sync`) share it."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import (
    Q,
)

from db.locks import advisory_xact_lock
from inventory import checks, dra, owners, profiles
from inventory.models import (
    Allocation,
    Cluster,
)

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """What one import or event did, and the objects it rejected with the reason."""

    created: Counter[str] = field(default_factory=Counter)
    updated: Counter[str] = field(default_factory=Counter)
    gone: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    # Stored as published, but not to be trusted as it is (a class's selector Tally cannot
    # evaluate): one line each, naming the object.
    warnings: list[str] = field(default_factory=list)
    # Device identities not taken because they are live in another cluster, by its name.
    refused: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # Allocations the cluster says began before its first sync, charged from later instead
    # (`ClaimWriter._charged_start`): how many, the earliest start given, from when, and why then.
    charged_later: int = 0
    earliest_start: datetime | None = None
    charged_from: datetime | None = None
    charged_from_why: str = ""

    def notes(self) -> list[str]:
        """What the sync did not take as the cluster gave it, one line each: devices refused
        and allocation starts moved. Empty when it took everything as given."""
        lines = [
            f"{len(identities)} device(s) refused: their identity is live in cluster {other} "
            f"(one GPU is billed by one cluster): {checks.first_few(sorted(identities))}; they are "
            f"taken once gone from {other}"
            for other, identities in sorted(self.refused.items())
        ]
        if self.charged_later:
            assert self.earliest_start is not None and self.charged_from is not None
            lines.append(
                f"{self.charged_later} allocation(s) began before the cluster's first sync "
                f"(the earliest at {self.earliest_start:%Y-%m-%d %H:%M} UTC): charged from "
                f"{self.charged_from:%Y-%m-%d %H:%M} UTC, {self.charged_from_why}"
            )
        return lines

    def summary(self) -> str:
        kinds = sorted({*self.created, *self.updated, *self.gone, *self.skipped})
        parts = [
            f"{kind}: {self.created[kind]} new, {self.updated[kind]} changed, "
            f"{self.gone[kind]} gone"
            + (f", {self.skipped[kind]} skipped" if self.skipped[kind] else "")
            for kind in kinds
        ]
        parts.append(f"{len(self.errors)} rejected")
        if self.warnings:
            parts.append(f"{len(self.warnings)} warned of")
        return "; ".join(parts)


# Objects buffered before they are written in one go; bounds memory on large snapshots.
DEVICES_PER_FLUSH = 5000
CLAIMS_PER_FLUSH = 2000
NODES_PER_FLUSH = 1000


def lock_device_identities() -> None:
    """Take the lock on which cluster a device identity is live in (see `db.locks`): first in
    the sync's transaction, before any lock its claims' writes take."""
    advisory_xact_lock("inventory.device.identity", [0])


def note_first_sync(*, cluster: Cluster, at: datetime) -> datetime:
    """Record `at` as the cluster's first sync unless one earlier is stored; the first sync.
    Conditional, as another process (an import beside the live sync) may have stored one.
    Every sync notes its own time; a caller that backfills a cluster's history on purpose
    (the demo) notes when that history begins first."""
    first = cluster.first_synced_at
    if first is not None and first <= at:
        return first
    Cluster.objects.filter(
        Q(first_synced_at__isnull=True) | Q(first_synced_at__gt=at), pk=cluster.pk
    ).update(first_synced_at=at)
    first = Cluster.objects.values_list("first_synced_at", flat=True).get(pk=cluster.pk)
    assert first is not None
    cluster.first_synced_at = first
    return first


@dataclass
class ClaimChanges:
    """What a batched writer will send in its one `claims_changed` (claim ids in order)."""

    claim_ids: dict[int, None] = field(default_factory=dict)
    spans: list[tuple[datetime, datetime]] = field(default_factory=list)
    reattributed: dict[int, None] = field(default_factory=dict)


@dataclass(eq=False)
class NewAllocation:
    """An allocation a sync is about to write (`db.copy.insert_values` writes its attributes
    as the row, the fields it lacks taking their defaults): an import makes 60,000 of them,
    and a model instance cost ~40 times as much to make. `_link` sets its device and metering
    fields as it would an instance's, and `start` may move (`_charge_from_taking`)."""

    cluster_id: int
    claim_id: int
    request: str
    driver: str
    pool: str
    device_name: str
    share_id: str
    consumed_capacity: dict[str, Any]
    start: datetime
    job: str
    username: str
    device_id: int | None = field(default=None, init=False)


def device_key(allocation: Allocation | NewAllocation) -> tuple[str, str, str]:
    return (allocation.driver, allocation.pool, allocation.device_name)


class WriterState:
    """What a writer keeps between its calls; the slice and claim sides call each other
    through the methods declared at the end (`inventory.services._Writer` joins them)."""

    def __init__(
        self,
        *,
        cluster: Cluster,
        at: datetime,
        report: SyncReport,
        jobs: Mapping[str, owners.Resolution] | None = None,
        batched: bool = False,
        first_at: datetime | None = None,
    ) -> None:
        self.cluster = cluster
        self.at = at
        # Allocations are charged from no earlier than this (`_charged_start`).
        self.first_synced_at = note_first_sync(cluster=cluster, at=first_at or at)
        self.charge_floor: tuple[datetime, str] | None = None  # read when first needed
        # Devices refused before and taken now (`_refuse_devices_elsewhere`), by key: when.
        self.retaken: dict[tuple[str, str, str], datetime] = {}
        # When each object and pool changed, where not at `at` (watch events, see `_stamp`).
        self.stamps: Mapping[tuple[str, ...], datetime] = {}
        self.report = report
        self.jobs: Mapping[str, owners.Resolution] = jobs or {}
        # Claims (by key) a watch deleted, released at the next flush.
        self.deleted_claims: list[str] = []
        # Batched: `claims_changed` is sent once, by `send_claims_changed`, not per write.
        self.pending: ClaimChanges | None = ClaimChanges() if batched else None
        # Watch events (batched): a pool republished as it was stored but for its generation
        # keeps its devices as counted, their generation moved (`_write_slices`). A list or
        # import recounts every pool, so that a driver profile changed since applies.
        self.carry_regenerated = batched
        self.claims_written: set[int] = set()
        self.slices: list[dra.ParsedSlice] = []
        # Slice name -> (driver, pool, generation, digest of the spec) of its first listing in
        # this run: a dump that lists one name twice (files concatenated, two clusters' dumps
        # mixed) keeps the last, and says so.
        self.slice_listings: dict[str, tuple[str, str, int, bytes]] = {}
        self.buffered_devices = 0
        self.claims: list[dra.ParsedClaim] = []
        self.nodes: list[dra.ParsedNode] = []
        self.touched_pools: set[tuple[str, str]] = set()
        self.linkable_pools: set[tuple[str, str]] = set()
        self.node_ids: dict[str, int] = {}
        self.shape_ids: dict[str, int] = {}
        self.gpu_drivers: frozenset[str] = settings.TALLY_GPU_DRIVERS
        # Driver profiles (built in, overridden by DriverProfile rows), read once per sync.
        self.profiles = profiles.ProfileBook.load(self.gpu_drivers)

    def start_run(
        self,
        *,
        at: datetime,
        stamps: Mapping[tuple[str, ...], datetime],
        jobs: Mapping[str, owners.Resolution],
    ) -> None:
        """Write a run of watch events next (see `apply_watch_events`): each changes its own
        objects, once, whatever runs before it listed."""
        self.at = at
        self.stamps = stamps
        self.jobs = jobs
        self.slice_listings = {}

    def _stamp(self, *key: str) -> datetime:
        """When the object or pool `key` names (`("ResourceClaim", key)`, `("ResourceSlice",
        name)`, `("Pool", driver, pool)`) changed: its watch event's time, else `at`."""
        return self.stamps.get(key, self.at)

    # Written by the claim side (`inventory.claim_sync.ClaimWriter`).

    def _claims_changed(
        self,
        claim_ids: list[int],
        *,
        spans: list[tuple[datetime, datetime]],
        reattributed: list[int],
    ) -> None:
        raise NotImplementedError

    def send_claims_changed(self, *, at: datetime) -> None:
        raise NotImplementedError

    def _link_allocations(self, pools: list[tuple[str, str]]) -> None:
        raise NotImplementedError
