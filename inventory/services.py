"""Writes to the inventory: snapshots and watch events from Kubernetes become rows.

Every function here takes plain Python data (the JSON of Kubernetes objects), so the same
code serves `sync_inventory --from-file`, the live list + watch, tests and benchmarks.
"""

from __future__ import annotations

import gc
import hashlib
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import (
    Case,
    DateTimeField,
    Expression,
    Value,
    When,
)

from db.bulk import AnyOf, NoneOf, json_text
from inventory import dra, owners
from inventory.claim_sync import ClaimWriter
from inventory.gang_sync import (
    attribute_gangs,
    end_gangs,
    end_gangs_at,
    gangs_of,
    record_claim_gangs,
    record_claim_gangs_seen,
)
from inventory.gangs import GangIndex, GangRef
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    DeviceShape,
    Node,
    NodeShapeCount,
    Pool,
    ResourceClaim,
    ResourceSlice,
)
from inventory.slice_sync import SliceWriter, pools_with_refusals
from inventory.sync_state import (
    CLAIMS_PER_FLUSH,
    DEVICES_PER_FLUSH,
    NODES_PER_FLUSH,
    SyncReport,
    lock_device_identities,
)

log = logging.getLogger(__name__)

# The object kinds the inventory keeps; anything else in a dump is skipped and counted.
KINDS = ("Node", "DeviceClass", "ResourceSlice", "ResourceClaim")


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
    jobs: Mapping[str, owners.Resolution] | None = None,
    gangs: Mapping[str, GangRef | None] | None = None,
) -> SyncReport:
    """Apply a full snapshot of `kinds` (default: the kinds that occur in `objects`) taken at `at`.

    New objects appear, changed ones are updated, and known objects of those kinds that are
    missing are marked gone at `at` (claims released, their allocations ended). Malformed
    objects are reported in `errors` (naming the object and field) and the rest still loads;
    a malformed object that was known before is left as it was, not marked gone.
    `objects` is consumed once, as a stream, so a large dump need not fit in memory. The whole
    snapshot is applied in one transaction: readers see it before or after, never half.

    A claim's job comes from `jobs[uid]` where the caller followed its owners (see
    `resolve_claim_jobs`), else it is the one recorded for the same owner references, else its
    own controller. Pods, ReplicaSets and Jobs among `objects` (a dump of them) then take the
    present claims of their namespaces further, whatever the order of the objects.

    A claim's gang comes from `gangs[uid]` where the caller read its Pod (see
    `record_claim_gangs`); Pods and the objects that declare gangs among `objects` (a dump)
    give the present claims of their namespaces theirs. Gangs left without a live claim end.

    A snapshot of slices (a relist) also deletes device shapes long unused
    (`delete_unused_shapes`).
    """
    report = SyncReport()
    scope = set(kinds) if kinds is not None else set()
    seen: dict[str, set[str]] = defaultdict(set)
    owner_index = owners.OwnerIndex()
    gang_index = GangIndex()
    with _fewer_collections(), transaction.atomic():
        lock_device_identities()
        writer = _Writer(cluster=cluster, at=at, report=report, jobs=jobs)
        for parsed in _parse_stream(objects, report, seen, owner_index, gang_index):
            writer.add(parsed)
        writer.flush()
        scope |= {kind for kind in seen if kind in KINDS}
        writer.mark_missing(scope, seen)
        writer.reconcile_touched_pools()
        writer.attribute_claims(owner_index)
        record_claim_gangs(cluster=cluster, gangs=gangs or {}, at=at)
        attribute_gangs(cluster=cluster, index=gang_index, at=at)
        end_gangs(cluster=cluster, at=at)
        writer.note_fleet_change()
        if "ResourceSlice" in scope:
            delete_unused_shapes(cluster=cluster, at=at)
        _analyze_if_large(report)
    return report


# An import that wrote this many objects (slices, claims, ...) analyses the tables the sync
# looks rows up in (by `(driver, pool[, name])`, `db.bulk.AnyRowOf`) before it commits. A
# first import of a large fleet fills tables the planner has no statistics for, and until
# autovacuum analyses them (a minute or so after the commit) each watch event's lookup hashes
# every device of the cluster (~0.8 s at 100,000 devices, against ~0.3 ms once analysed).
# ANALYZE in the import's transaction counts its own rows, and its statistics commit with them.
ANALYZE_AFTER_OBJECTS = 5000


def _analyze_if_large(report: SyncReport) -> None:
    if sum(report.created.values()) + sum(report.updated.values()) < ANALYZE_AFTER_OBJECTS:
        return
    tables = [model._meta.db_table for model in (Device, Allocation, ResourceSlice, Pool)]
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {', '.join(tables)}")


# The cyclic garbage collector's thresholds while a snapshot is imported (`gc.set_threshold`;
# the interpreter's are 700, 10, 10). An import allocates millions of containers (parsed
# objects, rows) that are freed by their counts, not by the collector: at the interpreter's
# thresholds it ran ~1,500 times over a 20,000-device import, full collections walking every
# object the process holds, a fifth of the import's CPU. A collection every 50,000 net
# allocations still frees the few cycles made (query compilers and the like) as it goes.
_IMPORT_GC_THRESHOLDS = (50_000, 20, 100)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run the block with the collector at `_IMPORT_GC_THRESHOLDS`, then as it was."""
    before = gc.get_threshold()
    gc.set_threshold(*_IMPORT_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


# How long a device shape stays unused before a relist deletes it. The quota webhook's workers
# read the fleet by the device counts changed since they last read
# (`quota.admission.shapes.refreshed`), and a shape's zero counts are deleted with it: each
# worker is to have read them at zero first. One that read nothing for longer (no request in
# all that time) keeps the shape's last count until it restarts.
SHAPE_UNUSED_GRACE = timedelta(days=1)


def delete_unused_shapes(*, cluster: Cluster, at: datetime) -> int:
    """Delete the cluster's device shapes that no device has, present or gone, and that no
    node counts a device of, once they have been so for `SHAPE_UNUSED_GRACE`; how many. The
    relist of slices runs it.

    A shape is written once per distinct shape and kept while any device row (history
    included) names it; one left behind when its devices' attributes or the shape key changed
    is noted unused at `at`, and deleted by a later relist. Safe against a writer giving a
    device that shape at the same moment (`_LOCK_SHAPES`): the shapes to delete are locked
    first, then looked at again, so one a writer has taken meanwhile is kept."""
    table = DeviceShape._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(_NOTE_UNUSED_SHAPES.format(shapes=table, unused=_UNUSED), [at, cluster.pk])
        cursor.execute(
            f"SELECT id FROM {table} WHERE cluster_id = %s AND unused_since <= %s "
            "ORDER BY id FOR UPDATE",
            [cluster.pk, at - SHAPE_UNUSED_GRACE],
        )
        candidates = [shape_id for (shape_id,) in cursor.fetchall()]
        if not candidates:
            return 0
        # A new statement: it sees what writers that held these shapes committed.
        cursor.execute(_DELETE_SHAPES.format(shapes=table, unused=_UNUSED), [candidates])
        deleted = cursor.rowcount
    if deleted:
        log.info("deleted %d device shape(s) no device of %s has any more", deleted, cluster)
    return deleted


# Whether the shape `shape` is unused: no device row names it, no node counts one of it.
_UNUSED = f"""
NOT EXISTS (SELECT 1 FROM {Device._meta.db_table} AS device WHERE device.shape_id = shape.id)
AND NOT EXISTS (
    SELECT 1 FROM {NodeShapeCount._meta.db_table} AS counted
    WHERE counted.shape_id = shape.id AND counted.devices > 0
)"""
# Note when each of the cluster's shapes was first found unused. Only a writer taking the shape
# again forgets it (`_LOCK_SHAPES`): the two never update one row, so they never deadlock.
_NOTE_UNUSED_SHAPES = """
UPDATE {shapes} AS shape SET unused_since = %s
WHERE shape.cluster_id = %s AND shape.unused_since IS NULL AND {unused}
"""
# Delete the shapes of these ids still unused, and their zero counts.
_DELETE_SHAPES = f"""
WITH doomed AS (
    SELECT shape.id FROM {{shapes}} AS shape WHERE shape.id = ANY(%s) AND {{unused}}
), counts AS (
    DELETE FROM {NodeShapeCount._meta.db_table} AS counted USING doomed
    WHERE counted.shape_id = doomed.id
)
DELETE FROM {{shapes}} AS shape USING doomed WHERE shape.id = doomed.id
"""


def apply_watch_event(
    *,
    cluster: Cluster,
    event_type: str,
    obj: dict[str, Any],
    at: datetime,
    jobs: Mapping[str, owners.Resolution] | None = None,
    gangs: Mapping[str, GangRef | None] | None = None,
) -> SyncReport:
    """Apply one watch event (`ADDED`, `MODIFIED` or `DELETED`) observed at `at`.

    `obj` must carry `kind` (the sync sets it, since watch events from typed lists may not).
    BOOKMARK and ERROR events are the caller's business and are not passed here. `jobs` and
    `gangs` are as for `import_snapshot`.
    """
    identity = dra.object_identity(obj)
    key = identity[1] if identity is not None else ""
    event = WatchEvent(
        event_type=event_type,
        obj=obj,
        at=at,
        job=(jobs or {}).get(key),
        gang=(gangs or {}).get(key),
    )
    return apply_watch_events(cluster=cluster, events=[event])


WATCH_EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED")


@dataclass(frozen=True)
class WatchEvent:
    """One watch event (`ADDED`, `MODIFIED` or `DELETED`) of `obj`, which carries its `kind`,
    observed at `at`; for a claim, the job its owners gave (see `resolve_claim_jobs`) and the
    gang its Pod declares (see `record_claim_gangs`), where the caller read them."""

    event_type: str
    obj: dict[str, Any]
    at: datetime
    job: owners.Resolution | None = None
    gang: GangRef | None = None


def apply_watch_events(*, cluster: Cluster, events: Sequence[WatchEvent]) -> SyncReport:
    """Apply watch events in their order, in one transaction, leaving the rows that applying
    each alone with `apply_watch_event` would: every event keeps its own `at` (first seen,
    allocation start and end, release, gone), and a malformed object is reported in `errors`
    while the others still apply.

    The events are cut into runs of claims or of slices that touch distinct objects, pools
    and gangs (see `_runs`); each run is written together (one flush, one recount per pool,
    one round of gang updates, one `claims_changed`, whose `at` is the latest event's of the
    batch so far). The fleet version is bumped once, when anything in it changed. Raises
    ValueError, before writing, for an event type other than those of `WATCH_EVENT_TYPES`.
    """
    for event in events:
        if event.event_type not in WATCH_EVENT_TYPES:
            raise ValueError(f"unknown watch event type {event.event_type!r}")
    report = SyncReport()
    if not events:
        return report
    with transaction.atomic():
        refused_pools = pools_with_refusals(cluster)
        if refused_pools or any(event.obj.get("kind") == "ResourceSlice" for event in events):
            lock_device_identities()
        writer = _Writer(
            cluster=cluster,
            at=events[-1].at,
            report=report,
            batched=True,
            first_at=min(event.at for event in events),
        )
        latest = events[0].at
        for run in _runs(cluster, events, report):
            # Marks (dirty hours) never go back in time from one run to the next, whatever
            # the order of the runs' events.
            latest = max(latest, *(event.at for event, _ in run.changes))
            _apply_run(writer, run, signalled_at=latest)
        if refused_pools:
            writer.retake_refused(refused_pools, signalled_at=latest)
        writer.note_fleet_change()
    return report


@dataclass
class _Run:
    """Watch events applied together: claims only or slices only, each object, pool and gang
    touched by one of them (a gang may be joined by several live claims, since none of them
    can end it), or any single event. `changes` pairs each event with its parsed object (None:
    deleted, rejected or not kept); `stamps` gives each object and pool its event's `at`."""

    kind: str
    changes: list[tuple[WatchEvent, dra.Parsed | None]] = field(default_factory=list)
    stamps: dict[tuple[str, ...], datetime] = field(default_factory=dict)

    def add(self, event: WatchEvent, parsed: dra.Parsed | None, touches: _Touches) -> None:
        self.changes.append((event, parsed))
        for key in touches.taken | touches.stamped:
            self.stamps[key] = event.at


@dataclass
class _Touches:
    """What one event touches (see `_Run`): objects, pools and gangs it changes (`taken`),
    gangs it joins as a live member (`joined`), and objects stamped with its time. `alone`:
    it must be a run by itself."""

    taken: set[tuple[str, ...]] = field(default_factory=set)
    joined: set[tuple[str, ...]] = field(default_factory=set)
    stamped: set[tuple[str, ...]] = field(default_factory=set)
    alone: bool = False


def _runs(cluster: Cluster, events: Sequence[WatchEvent], report: SyncReport) -> Iterator[_Run]:
    """Cut `events` into runs (see `_Run`), parsing each object once (what is rejected goes
    to `report`). Which pool a slice is in and which gang a claim is in are read once, then
    followed through the events.

    Events of one kind in a row are spread over as few runs as their overlaps allow
    (`_layers`): an event goes in the run after the last that holds an object, pool or gang
    it touches, so events that touch the same thing keep their order, and the others, which
    commute, share runs."""
    slice_names = {
        _name_of(event.obj) for event in events if event.obj.get("kind") == "ResourceSlice"
    }
    slice_pools: dict[str, tuple[str, str]] = {
        name: (driver, pool)
        for name, driver, pool in ResourceSlice.objects.filter(
            AnyOf("name", slice_names - {""}), cluster=cluster, gone_at__isnull=True
        ).values_list("name", "driver", "pool")
    }
    claim_uids = {_claim_uid(event.obj) for event in events} - {""}
    claims: dict[str, _StoredClaim] = {
        uid: _StoredClaim(namespace, name, (gang_namespace, gang_key) if gang_key else None)
        for uid, namespace, name, gang_namespace, gang_key in ResourceClaim.objects.filter(
            AnyOf("uid", claim_uids), cluster=cluster
        ).values_list("uid", "namespace", "name", "gang__namespace", "gang__key")
    }
    stretch: list[tuple[WatchEvent, dra.Parsed | None, _Touches]] = []
    stretch_kind = ""
    for event in events:
        kind = str(event.obj.get("kind") or "")
        parsed = None
        if event.event_type != "DELETED":
            parsed = next(iter(_parse_stream([event.obj], report, defaultdict(set))), None)
        elif dra.object_identity(event.obj) is None:
            report.errors.append(f"{dra.object_ref(event.obj)}: metadata.name: is required")
        if kind == "ResourceSlice":
            touches = _slice_touches(event, parsed, slice_pools)
        elif kind == "ResourceClaim":
            touches = _claim_touches(event, parsed, claims)
        else:
            touches = _Touches(alone=True)
        if stretch and (touches.alone or kind != stretch_kind or stretch[-1][2].alone):
            yield from _layers(stretch_kind, stretch)
            stretch = []
        stretch_kind = kind
        stretch.append((event, parsed, touches))
    yield from _layers(stretch_kind, stretch)


def _layers(kind: str, stretch: list[tuple[WatchEvent, dra.Parsed | None, _Touches]]) -> list[_Run]:
    """Events of one kind (see `_runs`) in runs: each in the first run after those of the
    events before it that changed what it touches (live claims joining one gang may share a
    run, in their order); within a run, in their order."""
    runs: list[_Run] = []
    taken_in: dict[tuple[str, ...], int] = {}
    joined_in: dict[tuple[str, ...], int] = {}
    for event, parsed, touches in stretch:
        layer = max(
            [
                *(taken_in.get(key, -1) + 1 for key in touches.taken | touches.joined),
                *(joined_in.get(key, -1) + 1 for key in touches.taken),
                *(joined_in.get(key, 0) for key in touches.joined),
                0,
            ]
        )
        taken_in.update(dict.fromkeys(touches.taken, layer))
        joined_in.update(dict.fromkeys(touches.joined, layer))
        while len(runs) <= layer:
            runs.append(_Run(kind=kind))
        runs[layer].add(event, parsed, touches)
    return runs


@dataclass
class _StoredClaim:
    """A claim as `_runs` follows it through the events: where it is, and its gang."""

    namespace: str
    name: str
    gang: tuple[str, str] | None


def _slice_touches(
    event: WatchEvent, parsed: dra.Parsed | None, pools: dict[str, tuple[str, str]]
) -> _Touches:
    """The slice and the pools (before and after) the event touches; follows `pools`."""
    if isinstance(parsed, dra.ParsedSlice):
        name = parsed.name
    elif event.event_type == "DELETED" and (identity := dra.object_identity(event.obj)):
        name = identity[1]
    else:
        return _Touches()  # rejected: it changes nothing
    touched: set[tuple[str, ...]] = {("ResourceSlice", name)}
    if name in pools:
        touched.add(("Pool", *pools[name]))
    if isinstance(parsed, dra.ParsedSlice):
        pools[name] = (parsed.driver, parsed.pool)
        touched.add(("Pool", *pools[name]))
    else:
        pools.pop(name, None)
    return _Touches(taken=touched)


def _claim_touches(
    event: WatchEvent, parsed: dra.Parsed | None, claims: dict[str, _StoredClaim]
) -> _Touches:
    """The claim (by uid and by name) and the gangs (before and after) the event touches;
    follows `claims`. A claim without a uid is alone: its event looks at every gang."""
    uid = _claim_uid(event.obj)
    if not uid:
        return _Touches(alone=True)
    stored = claims.get(uid)
    live = isinstance(parsed, dra.ParsedClaim)
    if isinstance(parsed, dra.ParsedClaim):
        claims[uid] = stored = _StoredClaim(
            parsed.namespace, parsed.name, stored.gang if stored is not None else None
        )
    touched: set[tuple[str, ...]] = {("ResourceClaim", uid)}
    stamped: set[tuple[str, ...]] = {("ResourceClaim", uid)}
    if stored is None:
        return _Touches(taken=touched, stamped=stamped)  # neither stored nor written
    # Reservations follow a claim by name: a name's old and new claims go in separate runs.
    touched.add(("ClaimName", stored.namespace, stored.name))
    before = stored.gang
    if event.gang is not None:
        stored.gang = (stored.namespace, event.gang.key)
    gangs: set[tuple[str, ...]] = {
        ("Gang", *gang) for gang in (before, stored.gang) if gang is not None
    }
    if live and stored.gang is not None:
        # A live member keeps its gang open: live claims may join one gang in one run.
        joined: set[tuple[str, ...]] = {("Gang", *stored.gang)}
        return _Touches(taken=touched | (gangs - joined), joined=joined, stamped=stamped)
    return _Touches(taken=touched | gangs, stamped=stamped)


def _apply_run(writer: _Writer, run: _Run, *, signalled_at: datetime) -> None:
    """Write one run of watch events (see `apply_watch_events`) with `writer`."""
    cluster = writer.cluster
    writer.start_run(
        at=run.changes[-1][0].at,
        stamps=run.stamps,
        jobs={
            uid: event.job
            for event, _ in run.changes
            if event.job is not None and (uid := _claim_uid(event.obj))
        },
    )
    claim_uids = [uid for event, _ in run.changes if (uid := _claim_uid(event.obj))]
    # Only the run's claims' gangs (before the events and after them) can end with them.
    gangs_before = gangs_of(cluster, claim_uids)
    for event, parsed in run.changes:
        if parsed is not None:
            writer.add(parsed)
        elif (
            event.event_type == "DELETED"
            and (identity := dra.object_identity(event.obj)) is not None
            and identity[0] in KINDS
        ):
            writer.mark_deleted(*identity)
    writer.flush()
    writer.reconcile_touched_pools()
    writer.send_claims_changed(at=signalled_at)
    if run.kind != "ResourceClaim":
        return
    recorded = record_claim_gangs_seen(
        cluster=cluster,
        found={
            uid: (event.gang, event.at)
            for event, _ in run.changes
            if event.gang is not None and (uid := _claim_uid(event.obj))
        },
    )
    if not claim_uids:  # which claim it was is not known: every gang is looked at
        end_gangs(cluster=cluster, at=writer.at)
        return
    # Only recording a gang moves a claim (the sync is the only writer of claims' gangs), so
    # the gangs after the run are known without reading them again: one query less a run.
    gangs_after = {**gangs_before, **recorded}
    times = {uid: event.at for event, _ in run.changes if (uid := _claim_uid(event.obj))}
    ending = {
        gang_id: times[uid]
        for gangs in (gangs_before, gangs_after)
        for uid, gang_id in gangs.items()
    }
    if ending:
        end_gangs_at(cluster=cluster, ended_at=_times_by_pk(ending), gang_ids=ending)


def _parse_stream(
    objects: Iterable[Any],
    report: SyncReport,
    seen: dict[str, set[str]],
    owner_index: owners.OwnerIndex | None = None,
    gang_index: GangIndex | None = None,
) -> Iterator[dra.Parsed]:
    for obj in objects:
        identity = dra.object_identity(obj)
        if identity is not None:
            seen[identity[0]].add(identity[1])
        try:
            parsed = dra.parse_object(obj)
        except dra.DRAObjectError as exc:
            report.errors.append(str(exc))
            log.warning("rejected %s", exc)
            continue
        if parsed is None:
            # Not kept, but a dump's Pods, ReplicaSets and Jobs say whose its claims are, and
            # its Pods, JobSets, PodGroups and the like which gangs.
            if owner_index is not None:
                owner_index.add(obj)
            if gang_index is not None:
                gang_index.add(obj)
            report.skipped[obj.get("kind") or "<no kind>"] += 1
            continue
        yield parsed


def _times_by_pk(times: Mapping[int, datetime]) -> Expression:
    """The time `times` gives each row by primary key, as one expression for an UPDATE."""
    distinct = set(times.values())
    if len(distinct) == 1:
        return Value(distinct.pop())
    return Case(
        *[When(pk=pk, then=Value(at)) for pk, at in times.items()],
        output_field=DateTimeField(),
    )


def _digest(spec: Any) -> bytes:
    """A digest of `spec` that two equal specs share, whatever the order of their keys."""
    return hashlib.blake2b(json_text(spec, sort_keys=True).encode(), digest_size=16).digest()


def _claim_uid(obj: Any) -> str:
    """The uid of a ResourceClaim object; "" for any other object, or a claim without one."""
    if not isinstance(obj, dict) or obj.get("kind") != "ResourceClaim":
        return ""
    uid = (obj.get("metadata") or {}).get("uid") if isinstance(obj.get("metadata"), dict) else ""
    return uid if isinstance(uid, str) else ""


def _name_of(obj: dict[str, Any]) -> str:
    """An object's `metadata.name`; "" when it has none."""
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) else ""


class _Writer(SliceWriter, ClaimWriter):
    """Writes parsed objects in batches; pools are reconciled from the stored slices at the end."""

    def add(self, parsed: dra.Parsed) -> None:
        if isinstance(parsed, dra.ParsedSlice):
            # The spec by a digest of its JSON, keys sorted: a 100,000-device import held
            # every slice's spec here to the end, most of its memory.
            listing = (parsed.driver, parsed.pool, parsed.generation, _digest(parsed.spec))
            first = self.slice_listings.setdefault(parsed.name, listing)
            if first is not listing and first != listing:
                self.report.errors.append(
                    f"ResourceSlice {parsed.name}: listed twice with different contents "
                    f"(pool {first[0]}/{first[1]} generation {first[2]}, then "
                    f"{parsed.driver}/{parsed.pool} generation {parsed.generation}); "
                    "the last listing is kept"
                )
            self.slices.append(parsed)
            self.buffered_devices += len(parsed.devices) + 1
            if self.buffered_devices >= DEVICES_PER_FLUSH:
                self._write_nodes()
                self._write_slices()
        elif isinstance(parsed, dra.ParsedClaim):
            self.claims.append(parsed)
            if len(self.claims) >= CLAIMS_PER_FLUSH:
                self.flush()
        elif isinstance(parsed, dra.ParsedDeviceClass):
            self._write_device_class(parsed)
        else:
            self.nodes.append(parsed)
            if len(self.nodes) >= NODES_PER_FLUSH:
                self._write_nodes()

    def flush(self) -> None:
        """Write what is buffered: nodes before the devices on them, devices before claims."""
        self._write_nodes()
        self._write_slices()
        self._write_claims()
        self._release_deleted_claims()

    # Disappearance.

    def mark_missing(self, scope: set[str], seen: dict[str, set[str]]) -> None:
        """Mark objects of the snapshot's kinds that it does not hold as gone at `at`."""
        for kind in sorted(scope):
            present = seen.get(kind, set())
            if kind == "ResourceClaim":
                missing_claims = ResourceClaim.objects.filter(
                    cluster=self.cluster, released_at__isnull=True
                ).filter(NoneOf("uid", present))
                self._release_claims(
                    dict.fromkeys(missing_claims.values_list("pk", flat=True), self.at)
                )
            elif kind == "ResourceSlice":
                missing = ResourceSlice.objects.filter(
                    cluster=self.cluster, gone_at__isnull=True
                ).filter(NoneOf("name", present))
                self.touched_pools |= set(missing.values_list("driver", "pool"))
                self.report.gone[kind] += missing.update(gone_at=self.at)
            else:
                model = {"Node": Node, "DeviceClass": DeviceClass}[kind]
                missing_rows = model._default_manager.filter(
                    cluster=self.cluster, gone_at__isnull=True
                ).filter(NoneOf("name", present))
                self.report.gone[kind] += missing_rows.update(gone_at=self.at)

    def mark_deleted(self, kind: str, identity: str) -> None:
        """Mark one object gone because a watch reported it deleted; a claim is released at
        the next `flush`, with the others deleted by then."""
        if kind == "ResourceClaim":
            self.deleted_claims.append(identity)
            return
        model = {"Node": Node, "DeviceClass": DeviceClass, "ResourceSlice": ResourceSlice}[kind]
        rows = model._default_manager.filter(
            cluster=self.cluster, name=identity, gone_at__isnull=True
        )
        if kind == "ResourceSlice":
            self.touched_pools |= set(rows.values_list("driver", "pool"))
        self.report.gone[kind] += rows.update(gone_at=self._stamp(kind, identity))
