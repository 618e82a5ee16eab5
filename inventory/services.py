"""Writes to the inventory: snapshots and watch events from Kubernetes become rows.

Every function here takes plain Python data (the JSON of Kubernetes objects), so the same
code serves `sync_inventory --from-file`, the live list + watch, tests and benchmarks.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import (
    Case,
    DateTimeField,
    Exists,
    Expression,
    F,
    OuterRef,
    Q,
    QuerySet,
    Value,
    When,
)

from db.bulk import AnyOf, update_instances, update_rows
from db.copy import bulk_insert
from db.locks import advisory_xact_lock
from inventory import cel, checks, dra, owners, profiles
from inventory.capacity import CapacityError, consumed_fraction
from inventory.gangs import GangIndex, GangRef, gang_of_claim
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    DeviceKind,
    DeviceShape,
    Gang,
    Node,
    NodeShapeCount,
    Pool,
    ResourceClaim,
    ResourceSlice,
)
from inventory.signals import claims_changed, meters_changed, usage_closed_until

log = logging.getLogger(__name__)

# The object kinds the inventory keeps; anything else in a dump is skipped and counted.
KINDS = ("Node", "DeviceClass", "ResourceSlice", "ResourceClaim")


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
    # (`_Writer._charged_start`): how many, the earliest start given, from when, and why then.
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
    with transaction.atomic():
        _lock_device_identities()
        writer = _Writer(cluster=cluster, at=at, report=report, jobs=jobs)
        for parsed in _parse_stream(objects, report, seen, owner_index, gang_index):
            writer.add(parsed)
        writer.flush()
        scope |= {kind for kind in seen if kind in KINDS}
        writer.mark_missing(scope, seen)
        writer.reconcile_touched_pools()
        writer.attribute_claims(owner_index)
        record_claim_gangs(cluster=cluster, gangs=gangs or {}, at=at)
        _attribute_gangs(cluster=cluster, index=gang_index, at=at)
        end_gangs(cluster=cluster, at=at)
        writer.note_fleet_change()
        if "ResourceSlice" in scope:
            delete_unused_shapes(cluster=cluster, at=at)
    return report


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
        refused_pools = _refused_pools(cluster)
        if refused_pools or any(event.obj.get("kind") == "ResourceSlice" for event in events):
            _lock_device_identities()
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
    gangs_before = _gangs_of(cluster, claim_uids)
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
    recorded = _record_claim_gangs(
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
        _end_gangs(cluster=cluster, ended_at=_times_by_pk(ending), gang_ids=ending)


def resolve_claim_jobs(
    *, cluster: Cluster, objects: Iterable[dict[str, Any]], lookup: owners.OwnerLookup
) -> dict[str, owners.Resolution]:
    """Follow the owners of the claims among `objects` (raw JSON) through `lookup`, by claim
    uid, for `import_snapshot` and `apply_watch_event`.

    Only the claims `claims_to_follow` names are followed. Writes nothing; the caller runs it
    before its transaction, so that no database transaction waits on the API server.
    """
    return follow_claim_jobs(claims_to_follow(cluster=cluster, objects=objects), lookup=lookup)


def claims_to_follow(
    *, cluster: Cluster, objects: Iterable[dict[str, Any]]
) -> dict[str, tuple[str, Any]]:
    """The claims among `objects` whose owners are to be followed, by uid: (namespace, owner
    references). Those whose controller is a Pod, ReplicaSet or Job, and not those already
    recorded beyond it for the same owner references: their owners are not read again."""
    candidates: dict[str, tuple[str, Any]] = {}
    for obj in objects:
        identity = dra.object_identity(obj)
        if identity is None or identity[0] != "ResourceClaim":
            continue
        metadata = obj["metadata"]
        references = metadata.get("ownerReferences")
        if owners.needs_lookup(references):
            candidates[identity[1]] = (metadata.get("namespace") or "default", references)
    keys = list(candidates)
    for start in range(0, len(keys), _CLAIMS_PER_FLUSH):
        for uid, references, job in ResourceClaim.objects.filter(
            AnyOf("uid", keys[start : start + _CLAIMS_PER_FLUSH]), cluster=cluster
        ).values_list("uid", "owner_references", "job"):
            if references == candidates[uid][1] and job not in ("", owners.own_job(references)):
                del candidates[uid]
    return candidates


def follow_claim_jobs(
    candidates: Mapping[str, tuple[str, Any]], *, lookup: owners.OwnerLookup
) -> dict[str, owners.Resolution]:
    """The job of each claim of `claims_to_follow`, by uid, read through `lookup`."""
    return {
        uid: owners.resolve_job(
            namespace=namespace,
            owner_references=references,
            lookup=lookup,
            creator_labels=settings.TALLY_CREATED_BY_LABELS,
        )
        for uid, (namespace, references) in candidates.items()
    }


def record_claim_gangs(
    *, cluster: Cluster, gangs: Mapping[str, GangRef | None], at: datetime
) -> None:
    """Point the claims `gangs` names (by uid) at their gangs, created or refreshed at `at`.

    None (the claim's Pod declares no gang, or could not be read) leaves a claim as it was. A
    gang seen here has a live member, so it is open again if it had ended. Claims not yet
    written are skipped: run it after the claims are.
    """
    _record_claim_gangs(
        cluster=cluster, found={uid: (ref, at) for uid, ref in gangs.items() if ref is not None}
    )


def _record_claim_gangs(
    *, cluster: Cluster, found: Mapping[str, tuple[GangRef, datetime]]
) -> dict[str, int]:
    """`record_claim_gangs`, each claim (by uid, in the order of `found`) seen at its own time:
    a gang is first seen at its first claim's, and last seen as its last claim's says. Returns
    the gang of each claim recorded (by uid; claims not written are left out)."""
    recorded: dict[str, int] = {}
    uids = list(found)
    for start in range(0, len(uids), _CLAIMS_PER_FLUSH):
        batch = uids[start : start + _CLAIMS_PER_FLUSH]
        claims = {
            uid: (pk, namespace, gang_id)
            for pk, uid, namespace, gang_id in ResourceClaim.objects.filter(
                AnyOf("uid", batch), cluster=cluster
            ).values_list("pk", "uid", "namespace", "gang_id")
        }
        seen: dict[tuple[str, str], _GangSeen] = {}
        for uid in batch:
            if uid not in claims:
                continue
            ref, at = found[uid]
            key = (claims[uid][1], ref.key)
            first = seen[key].first_seen if key in seen else at
            seen[key] = _GangSeen(ref=ref, first_seen=first, last_seen=at)
        gang_ids = _upsert_gangs(cluster=cluster, seen=seen)
        moved: dict[int, list[int]] = defaultdict(list)
        for uid, (pk, namespace, gang_id) in claims.items():
            wanted = recorded[uid] = gang_ids[(namespace, found[uid][0].key)]
            if gang_id != wanted:
                moved[wanted].append(pk)
        for gang_id, claim_ids in moved.items():
            ResourceClaim.objects.filter(AnyOf("pk", claim_ids)).update(gang_id=gang_id)
    return recorded


def record_gang(*, cluster: Cluster, namespace: str, ref: GangRef, at: datetime) -> Gang:
    """The gang `ref` names in `namespace`, created or refreshed (source, size) at `at`.

    For whoever learns of a gang before the sync does (the admission webhook). Concurrent
    calls for one gang leave one row: an upsert on its unique key.
    """
    seen = _GangSeen(ref=ref, first_seen=at, last_seen=at)
    gang_ids = _upsert_gangs(cluster=cluster, seen={(namespace, ref.key): seen})
    return Gang.objects.get(pk=gang_ids[(namespace, ref.key)])


def end_gangs(*, cluster: Cluster, at: datetime, gang_ids: Collection[int] | None = None) -> int:
    """End, at `at`, the open gangs of `cluster` (of `gang_ids`, when given) whose member
    claims are all released; how many. A gang no claim has joined yet (recorded by the webhook
    before the sync saw its first member) has not started, so it does not end here."""
    return _end_gangs(cluster=cluster, ended_at=Value(at), gang_ids=gang_ids)


def _end_gangs(*, cluster: Cluster, ended_at: Expression, gang_ids: Collection[int] | None) -> int:
    """`end_gangs`, each gang ending at what `ended_at` gives it."""
    member = ResourceClaim.objects.filter(gang=OuterRef("pk"))
    gangs = Gang.objects.filter(Exists(member), cluster=cluster, ended_at__isnull=True)
    if gang_ids is not None:
        gangs = gangs.filter(AnyOf("pk", gang_ids))
    return gangs.exclude(Exists(member.filter(released_at__isnull=True))).update(ended_at=ended_at)


def _times_by_pk(times: Mapping[int, datetime]) -> Expression:
    """The time `times` gives each row by primary key, as one expression for an UPDATE."""
    distinct = set(times.values())
    if len(distinct) == 1:
        return Value(distinct.pop())
    return Case(
        *[When(pk=pk, then=Value(at)) for pk, at in times.items()],
        output_field=DateTimeField(),
    )


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


def _gangs_of(cluster: Cluster, claim_uids: Collection[str]) -> dict[str, int]:
    """The gang each of the claims `claim_uids` is stored in, by uid (none: left out)."""
    if not claim_uids:
        return {}
    return dict(
        ResourceClaim.objects.filter(
            AnyOf("uid", claim_uids), cluster=cluster, gang__isnull=False
        ).values_list("uid", "gang_id")
    )


@dataclass(frozen=True)
class _GangSeen:
    """A gang as its claims last declared it, and when it was first and last seen."""

    ref: GangRef
    first_seen: datetime
    last_seen: datetime


def _upsert_gangs(
    *, cluster: Cluster, seen: Mapping[tuple[str, str], _GangSeen]
) -> dict[tuple[str, str], int]:
    """The ids of the gangs `seen` names by (namespace, key), created or refreshed."""
    rows = [
        Gang(
            cluster=cluster,
            namespace=namespace,
            key=key,
            source=gang.ref.source,
            size=gang.ref.size,
            first_seen=gang.first_seen,
            last_seen=gang.last_seen,
            ended_at=None,
        )
        for (namespace, key), gang in seen.items()
    ]
    # INSERT ... ON CONFLICT DO UPDATE: the sync and the webhook may write one gang at once.
    Gang.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["cluster", "namespace", "key"],
        update_fields=["source", "size", "last_seen", "ended_at"],
        batch_size=1000,
    )
    return {(row.namespace, row.key): row.pk for row in rows}


def _attribute_gangs(*, cluster: Cluster, index: GangIndex, at: datetime) -> None:
    """Give the present claims in the index's namespaces the gangs their Pods there declare."""
    if not index:
        return
    found: dict[str, GangRef | None] = {}
    for uid, namespace, references in ResourceClaim.objects.filter(
        cluster=cluster, released_at__isnull=True, namespace__in=index.namespaces
    ).values_list("uid", "namespace", "owner_references"):
        claim = {"metadata": {"namespace": namespace, "ownerReferences": references}}
        found[uid] = gang_of_claim(claim, index)
    record_claim_gangs(cluster=cluster, gangs=found, at=at)


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


# The stored shapes of some keys, locked against deletion (FOR KEY SHARE: what a foreign key
# check takes, so writers never wait on each other) and no longer noted unused where a relist
# had found them so: `delete_unused_shapes` locks a shape FOR UPDATE and looks again before
# deleting it, so a shape is either deleted before this reads it (and made anew) or seen in
# use. In id order, as `delete_unused_shapes` locks them: no deadlock.
_LOCK_SHAPES = f"""
WITH locked AS (
    SELECT id, key, unused_since FROM {DeviceShape._meta.db_table}
    WHERE cluster_id = %s AND key = ANY(%s) ORDER BY id FOR KEY SHARE
), reused AS (
    UPDATE {DeviceShape._meta.db_table} AS shape SET unused_since = NULL
    FROM locked WHERE shape.id = locked.id AND locked.unused_since IS NOT NULL
)
SELECT key, id FROM locked
"""

# Objects buffered before they are written in one go; bounds memory on large snapshots.
_DEVICES_PER_FLUSH = 5000
_CLAIMS_PER_FLUSH = 2000
_POOLS_PER_RECONCILE = 500
_NODES_PER_FLUSH = 1000


class _Writer:
    """Writes parsed objects in batches; pools are reconciled from the stored slices at the end."""

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
        self.pending: _ClaimChanges | None = _ClaimChanges() if batched else None
        # Watch events (batched): a pool republished as it was stored but for its generation
        # keeps its devices as counted, their generation moved (`_write_slices`). A list or
        # import recounts every pool, so that a driver profile changed since applies.
        self.carry_regenerated = batched
        self.claims_written: set[int] = set()
        self.slices: list[dra.ParsedSlice] = []
        # Slice name -> (driver, pool, generation, spec) of its first listing in this run: a
        # dump that lists one name twice (files concatenated, two clusters' dumps mixed) keeps
        # the last, and says so.
        self.slice_listings: dict[str, tuple[str, str, int, dict[str, Any]]] = {}
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

    def add(self, parsed: dra.Parsed) -> None:
        if isinstance(parsed, dra.ParsedSlice):
            listing = (parsed.driver, parsed.pool, parsed.generation, parsed.spec)
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
            if self.buffered_devices >= _DEVICES_PER_FLUSH:
                self._write_nodes()
                self._write_slices()
        elif isinstance(parsed, dra.ParsedClaim):
            self.claims.append(parsed)
            if len(self.claims) >= _CLAIMS_PER_FLUSH:
                self.flush()
        elif isinstance(parsed, dra.ParsedDeviceClass):
            self._write_device_class(parsed)
        else:
            self.nodes.append(parsed)
            if len(self.nodes) >= _NODES_PER_FLUSH:
                self._write_nodes()

    def flush(self) -> None:
        """Write what is buffered: nodes before the devices on them, devices before claims."""
        self._write_nodes()
        self._write_slices()
        self._write_claims()
        self._release_deleted_claims()

    def _stamp(self, *key: str) -> datetime:
        """When the object or pool `key` names (`("ResourceClaim", key)`, `("ResourceSlice",
        name)`, `("Pool", driver, pool)`) changed: its watch event's time, else `at`."""
        return self.stamps.get(key, self.at)

    # Nodes and device classes.

    def _write_nodes(self) -> None:
        if not self.nodes:
            return
        by_name = {parsed.name: parsed for parsed in self.nodes}
        self.nodes = []
        existing = {
            node.name: node
            for node in Node.objects.filter(AnyOf("name", by_name), cluster=self.cluster).only(
                "pk", "name", "labels", "clique", "gone_at"
            )
        }
        new_nodes = []
        for name, parsed in by_name.items():
            clique = parsed.labels.get("nvidia.com/gpu.clique", "")
            node = existing.get(name)
            if node is None:
                new_nodes.append(
                    Node(
                        cluster=self.cluster,
                        name=name,
                        labels=parsed.labels,
                        clique=clique,
                        first_seen=self.at,
                    )
                )
            elif node.labels != parsed.labels or node.clique != clique or node.gone_at:
                Node.objects.filter(pk=node.pk).update(
                    labels=parsed.labels, clique=clique, gone_at=None
                )
                self.report.updated["Node"] += 1
        bulk_insert(Node, new_nodes)
        self.report.created["Node"] += len(new_nodes)

    def _write_device_class(self, parsed: dra.ParsedDeviceClass) -> None:
        # Stored as the API server accepted it; a selector Tally cannot evaluate is said here,
        # and the webhook refuses (or warns of) claims of the class rather than take it to
        # select nothing.
        for index, expression in enumerate(parsed.selectors):
            try:
                cel.compile_selector(expression)
            except cel.CELError as exc:
                warning = (
                    f'DeviceClass "{parsed.name}": spec.selectors[{index}] cannot be evaluated '
                    f"by Tally: {exc.brief()}; claims of this class are refused where a quota "
                    "rule is enforced"
                )
                self.report.warnings.append(warning)
                log.warning("%s", warning)
        values = {
            "uid": parsed.uid,
            "api_version": parsed.api_version,
            "selectors": parsed.selectors,
            "extended_resource_name": parsed.extended_resource_name,
            "spec": parsed.spec,
            "resource_version": parsed.resource_version,
        }
        present = DeviceClass.objects.filter(
            cluster=self.cluster, name=parsed.name, gone_at__isnull=True
        )
        current = present.values(*values).first()
        if current is None:
            DeviceClass.objects.create(
                cluster=self.cluster, name=parsed.name, first_seen=self.at, **values
            )
            self.report.created["DeviceClass"] += 1
        elif current != values:
            present.update(**values)
            self.report.updated["DeviceClass"] += 1

    # Slices: stored whole; their pools are recounted afterwards.

    def _write_slices(self) -> None:
        if not self.slices:
            return
        by_name = {parsed.name: parsed for parsed in self.slices}
        existing = {
            row["name"]: row
            for row in ResourceSlice.objects.filter(
                AnyOf("name", by_name), cluster=self.cluster, gone_at__isnull=True
            ).values(
                "id", "name", "driver", "pool", "generation", "api_version", "generation_seen_at"
            )
        }
        # A slice's spec, the largest thing stored of it, is read back only where its generation
        # is the same, and, for watch events, where only the generation changed: a driver
        # republishing a pool as it was (`carry_regenerated`).
        compared = [
            row["id"]
            for name, row in existing.items()
            if row["generation"] == by_name[name].generation
            or (self.carry_regenerated and row["api_version"] == by_name[name].api_version)
        ]
        stored_specs = (
            dict(ResourceSlice.objects.filter(AnyOf("pk", compared)).values_list("pk", "spec"))
            if compared
            else {}
        )
        # Slice name -> the generation it was stored at, for those republished unchanged under
        # a new one.
        regenerated: dict[str, int] = {}
        new_rows, changed_rows = [], []
        for parsed in by_name.values():
            self.touched_pools.add((parsed.driver, parsed.pool))
            row = ResourceSlice(
                cluster=self.cluster,
                name=parsed.name,
                uid=parsed.uid,
                api_version=parsed.api_version,
                driver=parsed.driver,
                pool=parsed.pool,
                generation=parsed.generation,
                resource_slice_count=parsed.resource_slice_count,
                node_name=parsed.node_name,
                spec=parsed.spec,
                resource_version=parsed.resource_version,
                first_seen=self._stamp("ResourceSlice", parsed.name),
                generation_seen_at=self._stamp("ResourceSlice", parsed.name),
            )
            old = existing.get(parsed.name)
            if old is None:
                new_rows.append(row)
                continue
            self.touched_pools.add((old["driver"], old["pool"]))
            same_spec = (
                old["generation"] == parsed.generation and stored_specs[old["id"]] == parsed.spec
            )
            if (
                old["generation"] != parsed.generation
                and old["id"] in stored_specs
                and old["driver"] == parsed.driver
                and old["pool"] == parsed.pool
                and _but_generation(stored_specs[old["id"]]) == _but_generation(parsed.spec)
            ):
                regenerated[parsed.name] = old["generation"]
            if not same_spec or old["api_version"] != parsed.api_version:
                row.pk = old["id"]
                if same_spec:  # stored again under another API version: the same contents
                    row.generation_seen_at = old["generation_seen_at"]
                changed_rows.append(row)
        bulk_insert(ResourceSlice, new_rows)
        update_instances(
            ResourceSlice,
            changed_rows,
            [
                "uid",
                "api_version",
                "driver",
                "pool",
                "generation",
                "resource_slice_count",
                "node_name",
                "spec",
                "resource_version",
                "generation_seen_at",
            ],
        )
        self.report.created["ResourceSlice"] += len(new_rows)
        self.report.updated["ResourceSlice"] += len(changed_rows)
        self._reconcile_pools_in_hand(list(by_name.values()), regenerated)
        self.slices = []
        self.buffered_devices = 0

    def _reconcile_pools_in_hand(
        self, written: list[dra.ParsedSlice], regenerated: Mapping[str, int]
    ) -> None:
        """Recount now the pools whose every stored slice was just written.

        That is the common case (a pool is one slice, or its slices arrive together) and saves
        reading the slices back; other pools are recounted from storage at the end. A pool all
        of whose slices were republished unchanged but for a new generation, from one stored
        generation (`regenerated`), is carried: see `_reconcile_pools`. Watch events of one
        pool go in runs of their own (`_layers`), so only a pool of one slice is carried
        there; the slices of a pool of several are counted as before.
        """
        in_hand: dict[tuple[str, str], list[dra.ParsedSlice]] = defaultdict(list)
        for parsed in written:
            in_hand[(parsed.driver, parsed.pool)].append(parsed)
        stored: dict[tuple[str, str], set[str]] = defaultdict(set)
        for driver, pool, name in ResourceSlice.objects.filter(
            AnyOf("driver", {driver for driver, _ in in_hand}),
            AnyOf("pool", {pool for _, pool in in_hand}),
            cluster=self.cluster,
            gone_at__isnull=True,
        ).values_list("driver", "pool", "name"):
            stored[(driver, pool)].add(name)
        ready = {
            key: slices
            for key, slices in in_hand.items()
            if stored[key] == {parsed.name for parsed in slices} and key in self.touched_pools
        }
        carried: dict[tuple[str, str], int] = {}
        for key, slices in ready.items():
            before = {regenerated.get(parsed.name) for parsed in slices}
            if len(before) == 1 and (generation := before.pop()) is not None:
                carried[key] = generation
        pools = sorted(ready)
        for start in range(0, len(pools), _POOLS_PER_RECONCILE):
            batch = pools[start : start + _POOLS_PER_RECONCILE]
            self._reconcile_pools(
                batch,
                {key: ready[key] for key in batch},
                carried={key: carried[key] for key in batch if key in carried},
            )
        self.touched_pools -= ready.keys()
        self.linkable_pools |= ready.keys()

    def note_fleet_change(self) -> None:
        """Bump the cluster's fleet version when devices, classes, nodes or slices changed: a
        slice's shared counter sets can change with none of its devices (the admission of an
        `allocationMode: All` request weighs the devices against them, once per version)."""
        report = self.report
        if any(
            report.created[kind] or report.updated[kind] or report.gone[kind]
            for kind in ("Device", "DeviceClass", "Node", "ResourceSlice")
        ):
            Cluster.objects.filter(pk=self.cluster.pk).update(fleet_version=F("fleet_version") + 1)

    def reconcile_touched_pools(self) -> None:
        """Recount the pools left to do from their stored slices, then link allocations."""
        pools = sorted(self.touched_pools)
        self.touched_pools = set()
        for start in range(0, len(pools), _POOLS_PER_RECONCILE):
            batch = pools[start : start + _POOLS_PER_RECONCILE]
            self._reconcile_pools(batch, self._stored_slices(batch))
        linkable = sorted(self.linkable_pools | set(pools))
        self.linkable_pools = set()
        for start in range(0, len(linkable), _POOLS_PER_RECONCILE):
            self._link_allocations(linkable[start : start + _POOLS_PER_RECONCILE])

    def _stored_slices(
        self, pools: list[tuple[str, str]]
    ) -> dict[tuple[str, str], list[dra.ParsedSlice]]:
        wanted = set(pools)
        slices: dict[tuple[str, str], list[dra.ParsedSlice]] = defaultdict(list)
        for row in ResourceSlice.objects.filter(
            AnyOf("driver", {d for d, _ in pools}),
            AnyOf("pool", {p for _, p in pools}),
            cluster=self.cluster,
            gone_at__isnull=True,
        ).values("name", "api_version", "spec"):
            parsed = dra.parse_object(
                {
                    "apiVersion": row["api_version"],
                    "kind": "ResourceSlice",
                    "metadata": {"name": row["name"]},
                    "spec": row["spec"],
                }
            )
            assert isinstance(parsed, dra.ParsedSlice)
            if (parsed.driver, parsed.pool) in wanted:
                slices[(parsed.driver, parsed.pool)].append(parsed)
        return slices

    def _reconcile_pools(
        self,
        pools: list[tuple[str, str]],
        slices: dict[tuple[str, str], list[dra.ParsedSlice]],
        *,
        carried: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        """Recount each pool from all its present slices: newest complete generation only.

        A pool in `carried` (its slices all republished unchanged but for the generation, all
        stored at the generation given) that was counted at that generation, complete, and is
        complete at the new one, is not counted again: its devices are what counting its
        slices would give, but for their generation, which is moved. Counting it read and
        compared every column of every device (their JSON decoded), most of a slice event's
        time when a driver republishes its pools unchanged."""
        carried = carried or {}
        wanted = set(pools)
        drivers, pool_names = {d for d, _ in pools}, {p for _, p in pools}
        pool_rows = {
            (row.driver, row.name): row
            for row in Pool.objects.filter(
                AnyOf("driver", drivers), AnyOf("name", pool_names), cluster=self.cluster
            )
        }
        carry = {
            key
            for key, generation in carried.items()
            if (row := pool_rows.get(key)) is not None
            and row.complete
            and row.counted_generation == row.newest_generation == generation
            and not row.refused
        }
        # The present devices as rows of the columns compared, not model instances: a slice
        # event recounts all of its pool's devices, and building each instance cost more than
        # reading it. Of a carried pool, only which they are.
        existing: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
        recounted = wanted - carry
        if recounted:
            for device in self._present_devices(recounted).values(
                "pk", "driver", "pool", "name", *_DEVICE_FIELDS
            ):
                if (device["driver"], device["pool"]) in recounted:
                    existing[(device["driver"], device["pool"])][device["name"]] = device
        kept: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        if carry:
            for pk, driver, pool_name, generation in self._present_devices(carry).values_list(
                "pk", "driver", "pool", "pool_generation"
            ):
                if (driver, pool_name) in carry:
                    kept[(driver, pool_name)].append((pk, generation))
        new_devices: list[Device] = []
        # (id, value, ...) of the devices changed, by the columns that changed.
        changed_devices: dict[tuple[str, ...], list[tuple[Any, ...]]] = defaultdict(list)
        counted_pools: list[tuple[Pool, dict[str, dra.CountedDevice]]] = []
        moved_generation: list[tuple[int, int]] = []  # (device id, generation) of carried pools
        for key in pools:
            driver, pool_name = key
            pool_slices = slices.get(key, [])
            newest = max((s.generation for s in pool_slices), default=None)
            at_newest = [s for s in pool_slices if s.generation == newest]
            pool_row = pool_rows.get(key) or Pool(
                cluster=self.cluster, driver=driver, name=pool_name
            )
            pool_rows[key] = pool_row
            if pool_row.pk is None or pool_row.newest_generation != newest:
                pool_row.newest_generation_seen_at = self._stamp("Pool", driver, pool_name)
            pool_row.newest_generation = newest
            pool_row.slices_expected = max((s.resource_slice_count for s in at_newest), default=0)
            pool_row.slices_seen = len(at_newest)
            pool_row.updated_at = self._stamp("Pool", driver, pool_name)
            if not pool_slices:
                counted_pools.append((pool_row, {}))
            elif pool_row.complete:
                pool_row.counted_generation = newest
                if key in carry and newest is not None:
                    moved_generation.extend(
                        (pk, newest) for pk, generation in kept[key] if generation != newest
                    )
                else:
                    counted_pools.append((pool_row, self._count(driver, pool_name, at_newest)))
            # else: the newest generation is incomplete; keep counting the last complete one.
        self._refuse_devices_elsewhere(counted_pools, existing)
        known_pools = [row for row in pool_rows.values() if row.pk is not None]
        Pool.objects.bulk_create([row for row in pool_rows.values() if row.pk is None])
        update_instances(
            Pool,
            known_pools,
            [
                "counted_generation",
                "newest_generation",
                "slices_expected",
                "slices_seen",
                "updated_at",
                "newest_generation_seen_at",
                "refused",
            ],
        )
        node_times: dict[str, datetime] = {}
        for pool_row, desired in counted_pools:
            pool_at = self._stamp("Pool", pool_row.driver, pool_row.name)
            for counted in desired.values():
                name = counted.device.node_name
                node_times[name] = min(node_times.get(name, pool_at), pool_at)
        node_ids = self._node_ids(node_times)
        shape_ids = self._shape_ids(
            [counted for _, desired in counted_pools for counted in desired.values()]
        )
        gone: dict[int, datetime] = {}
        # Devices whose meter id changed (by id), and devices new under their name (by key):
        # when, for `_follow_meter_changes`.
        renamed: dict[int, datetime] = {}
        appeared: dict[tuple[str, str, str], datetime] = {}
        for pool_row, desired in counted_pools:
            pool_at = self._stamp("Pool", pool_row.driver, pool_row.name)
            current = existing.get((pool_row.driver, pool_row.name), {})
            for name, counted in desired.items():
                fields = _device_fields(
                    counted, node_ids, shape_ids, pool_row.counted_generation or 0
                )
                known = current.pop(name) if name in current else None
                if known is None:
                    new_devices.append(
                        Device(
                            cluster=self.cluster,
                            driver=pool_row.driver,
                            pool=pool_row.name,
                            name=name,
                            first_seen=pool_at,
                            **fields,
                        )
                    )
                    appeared[(pool_row.driver, pool_row.name, name)] = pool_at
                elif changed := [attr for attr, value in fields.items() if known[attr] != value]:
                    changed_devices[tuple(changed)].append(
                        (known["pk"], *(fields[attr] for attr in changed))
                    )
                    if "meter_id" in changed:
                        renamed[known["pk"]] = pool_at
            gone.update((device["pk"], pool_at) for device in current.values())
        bulk_insert(Device, new_devices)
        # By the columns that changed: a new pool generation changes one column of each of
        # its devices, and an UPDATE of every column would send all of them for each device.
        for columns, rows in changed_devices.items():
            update_rows(Device, columns, rows)
        update_rows(Device, ["pool_generation"], moved_generation)
        update_rows(Device, ["gone_at"], gone.items())
        self.report.created["Device"] += len(new_devices)
        self.report.updated["Device"] += sum(map(len, changed_devices.values()))
        self.report.updated["Device"] += len(moved_generation)
        self.report.gone["Device"] += len(gone)
        self._follow_meter_changes(renamed, appeared)

    def _refuse_devices_elsewhere(
        self,
        counted_pools: list[tuple[Pool, dict[str, dra.CountedDevice]]],
        existing: Mapping[tuple[str, str], Mapping[str, Mapping[str, Any]]],
    ) -> None:
        """Leave out of the counted pools the devices whose identity (UUID or meter id) is
        live in another cluster, and record them on their pool (`Pool.refused`) and, when
        newly refused, in the report and the log: samples name a GPU by its identity alone,
        so a GPU taken by two clusters would have its hours billed to both. A device this
        cluster holds already under the same identity keeps it (first come, first served);
        a refused one is taken once the other cluster has let it go, by the first sync that
        recounts its pool after that (every sync recounts pools with refused devices), and
        its allocations here are charged from then (`retaken`). The caller holds the
        identity lock (`_lock_device_identities`), so no other cluster takes one meanwhile."""
        wanted: dict[str, list[tuple[Pool, str]]] = defaultdict(list)
        refused_before = {id(pool_row): pool_row.refused for pool_row, _ in counted_pools}
        for pool_row, desired in counted_pools:
            pool_row.refused = {}
            present = existing.get((pool_row.driver, pool_row.name), {})
            for name, counted in desired.items():
                known = present.get(name)
                held = {known["meter_id"], known["uuid"]} if known is not None else set()
                for identity in {counted.meter_id, counted.columns.get("uuid", "")} - {""}:
                    if identity not in held:
                        wanted[identity].append((pool_row, name))
        desired_of = {id(pool_row): desired for pool_row, desired in counted_pools}
        elsewhere = identities_live_elsewhere(cluster=self.cluster, identities=wanted)
        for identity, other in elsewhere.items():
            for pool_row, name in wanted[identity]:
                desired_of[id(pool_row)].pop(name, None)
                pool_row.refused[name] = [identity, other]
                if refused_before[id(pool_row)].get(name) == [identity, other]:
                    # Refused before, as now: said then, and stored (`inventory.checks`); a
                    # watch recounts the pool at each batch, which would say it each time.
                    continue
                self.report.refused[other].append(identity)
                log.warning(
                    "cluster %s: device %s/%s/%s refused: %s is live in cluster %s",
                    self.cluster.name,
                    pool_row.driver,
                    pool_row.name,
                    name,
                    identity,
                    other,
                )
        for pool_row, desired in counted_pools:
            at = self._stamp("Pool", pool_row.driver, pool_row.name)
            for name in refused_before[id(pool_row)]:
                if name in desired:
                    self.retaken[(pool_row.driver, pool_row.name, name)] = at

    def _charge_from_taking(self, allocations: list[Allocation]) -> list[Allocation]:
        """Move the start of allocations of devices taken only now from another cluster
        (`retaken`) to when they were taken: the hours before were the other cluster's, its
        allocations billed them. Returns the allocations moved."""
        moved = []
        for allocation in allocations:
            taken = self.retaken.get(_device_key(allocation))
            if taken is not None and allocation.start < taken:
                allocation.start = taken
                moved.append(allocation)
        return moved

    def retake_refused(self, pools: list[tuple[str, str]], *, signalled_at: datetime) -> None:
        """Recount the pools with refused devices (a watch batch that did not touch them), so
        a device is taken as soon as the other cluster has let it go."""
        self.touched_pools |= set(pools)
        self.reconcile_touched_pools()
        self.send_claims_changed(at=signalled_at)

    def _present_devices(self, pools: Iterable[tuple[str, str]]) -> QuerySet[Device]:
        """The cluster's present devices of these drivers and pool names (a superset of the
        pools': filter by pair)."""
        pools = list(pools)
        return Device.objects.filter(
            AnyOf("driver", {driver for driver, _ in pools}),
            AnyOf("pool", {pool for _, pool in pools}),
            cluster=self.cluster,
            gone_at__isnull=True,
        )

    def _follow_meter_changes(
        self, renamed: Mapping[int, datetime], appeared: Mapping[tuple[str, str, str], datetime]
    ) -> None:
        """Re-mark the hours that devices' new meter ids change, from when they changed.

        An allocation keeps the meter id its device had when it started (`Allocation`), and the
        rollup finds its samples under that id or under its device's current one, so the
        hours an allocation holds after its device gains a UUID count samples sent under
        either, each stored under one. A device published again after its slice was deleted
        (a driver upgrade that restarts the plugin) is a new row under the same name: the open
        allocations still tied to the gone row are tied to it, their metering facts kept, or
        samples under its new id would never reach them. Either way the hours since the
        change are marked (`claims_changed`), as any change of what the rollup reads is."""
        changes: list[tuple[int, datetime]] = []  # (claim id, changed at)
        relinked = []
        if appeared:
            for allocation in Allocation.objects.filter(
                AnyOf("driver", {driver for driver, _, _ in appeared}),
                AnyOf("pool", {pool for _, pool, _ in appeared}),
                AnyOf("device_name", {name for _, _, name in appeared}),
                cluster=self.cluster,
                end__isnull=True,
                device__gone_at__isnull=False,
            ).only("pk", "claim_id", "start", "driver", "pool", "device_name", "device_id"):
                if (key := _device_key(allocation)) in appeared:
                    relinked.append(allocation)
                    changes.append((allocation.claim_id, max(allocation.start, appeared[key])))
        # Devices whose meter id changed (by id), and when: the renamed ones, and the new rows
        # whose meter id is not the gone row's they took allocations from.
        remetered = dict(renamed)
        if relinked:
            present = {
                (driver, pool, name): (pk, meter_id)
                for pk, driver, pool, name, meter_id in Device.objects.filter(
                    AnyOf("driver", {a.driver for a in relinked}),
                    AnyOf("pool", {a.pool for a in relinked}),
                    AnyOf("name", {a.device_name for a in relinked}),
                    cluster=self.cluster,
                    gone_at__isnull=True,
                ).values_list("pk", "driver", "pool", "name", "meter_id")
            }
            gone_meters: dict[int | None, str] = dict(
                Device.objects.filter(AnyOf("pk", {a.device_id for a in relinked})).values_list(
                    "pk", "meter_id"
                )
            )
            for allocation in relinked:
                key = _device_key(allocation)
                device_id, meter_id = present[key]
                if meter_id != gone_meters.get(allocation.device_id):
                    remetered.setdefault(device_id, appeared[key])
                allocation.device_id = device_id
            update_instances(Allocation, relinked, ["device"])
        if remetered:
            # The hours before: a source that keeps the past under the new id may measure them.
            meters_changed.send(sender=_Writer, cluster=self.cluster, devices=remetered)
        if renamed:
            changes.extend(
                (claim_id, max(start, renamed[device_id]))
                for claim_id, start, device_id in Allocation.objects.filter(
                    AnyOf("device_id", renamed), end__isnull=True
                ).values_list("claim_id", "start", "device_id")
            )
        if changes:
            self._claims_changed(
                sorted({claim_id for claim_id, _ in changes}),
                spans=[(since, max(since, self.at)) for _, since in changes],
                reattributed=[],
            )

    def _count(
        self, driver: str, pool: str, slices: list[dra.ParsedSlice]
    ) -> dict[str, dra.CountedDevice]:
        """The counted devices of one complete generation, by name; duplicates reported."""
        desired: dict[str, dra.CountedDevice] = {}
        profile = self.profiles.get(driver)
        for error in self.profiles.errors:
            if error not in self.report.errors:
                self.report.errors.append(error)
        for counted in dra.count_pool(
            driver=driver,
            pool=pool,
            slices=slices,
            gpu_drivers=self.gpu_drivers,
            cluster=self.cluster.name,
            profile=profile,
        ):
            if counted.device.name in desired:
                self.report.errors.append(
                    f"ResourceSlice {counted.slice_name}: spec.devices: device "
                    f"{counted.device.name!r} is published twice in pool {pool!r}"
                )
                continue
            desired[counted.device.name] = counted
        return desired

    def _shape_ids(self, counted: list[dra.CountedDevice]) -> dict[str, int]:
        """Ids of the devices' shapes by key, each distinct shape stored once.

        The stored shapes are read locked (`_LOCK_SHAPES`) until the transaction ends, so
        `delete_unused_shapes` cannot delete one this writer is about to give a device."""
        shapes: dict[str, dra.CountedDevice] = {}
        for device in counted:
            shapes.setdefault(device.shape_key, device)
        known = self.shape_ids.keys()
        missing = [key for key in shapes if key not in known]
        if missing:
            with connection.cursor() as cursor:
                cursor.execute(_LOCK_SHAPES, [self.cluster.pk, sorted(missing)])
                self.shape_ids.update(cursor.fetchall())
            new_shapes = []
            for key in missing:
                if key in self.shape_ids:
                    continue
                shape = shapes[key].shape
                new_shapes.append(
                    DeviceShape(
                        cluster=self.cluster,
                        key=key,
                        driver=shapes[key].driver,
                        kind=shape["kind"],
                        unit=shapes[key].unit,
                        gpu_share=shapes[key].gpu_share,
                        attributes=shape["attributes"],
                        capacity=shape["capacity"],
                        allow_multiple_allocations=shape["allow_multiple_allocations"],
                    )
                )
            if new_shapes:
                DeviceShape.objects.bulk_create(new_shapes)
                self.shape_ids.update(
                    DeviceShape.objects.filter(
                        AnyOf("key", [s.key for s in new_shapes]), cluster=self.cluster
                    ).values_list("key", "pk")
                )
        return self.shape_ids

    def _node_ids(self, first_seen: Mapping[str, datetime]) -> dict[str, int]:
        """Ids of the named nodes, created (without labels) when first seen through a slice,
        at the time `first_seen` gives each."""
        missing = set(first_seen) - self.node_ids.keys() - {""}
        if missing:
            for row in Node.objects.filter(AnyOf("name", missing), cluster=self.cluster).values(
                "id", "name"
            ):
                self.node_ids[row["name"]] = row["id"]
            new_nodes = [
                Node(cluster=self.cluster, name=name, first_seen=first_seen[name])
                for name in sorted(missing - self.node_ids.keys())
            ]
            if new_nodes:
                bulk_insert(Node, new_nodes)
                self.report.created["Node"] += len(new_nodes)
                for row in Node.objects.filter(
                    AnyOf("name", [n.name for n in new_nodes]), cluster=self.cluster
                ).values("id", "name"):
                    self.node_ids[row["name"]] = row["id"]
        return self.node_ids

    # Claims and their allocations.

    def _write_claims(self) -> None:
        if not self.claims:
            return
        by_key = {parsed.key: parsed for parsed in self.claims}
        self.claims = []
        existing = {
            claim.uid: claim
            for claim in ResourceClaim.objects.filter(AnyOf("uid", by_key), cluster=self.cluster)
        }
        # The open allocations' ids by claim and key: only which are still held is decided
        # here, so their other columns (JSON, decimals, times) are not read and decoded.
        open_allocations: dict[int, dict[tuple[str, ...], int]] = defaultdict(dict)
        for pk, claim_id, *key in Allocation.objects.filter(
            AnyOf("claim_id", [c.pk for c in existing.values()]), end__isnull=True
        ).values_list("pk", "claim_id", *_ALLOCATION_KEY_FIELDS):
            open_allocations[claim_id][tuple(key)] = pk
        claims_to_create = []
        # Changed claims, by the columns that changed: only those are written (quota records
        # `created_by` too, for claims the webhook saw).
        claims_to_update: dict[tuple[str, ...], list[ResourceClaim]] = defaultdict(list)
        refined: dict[int, tuple[str, str]] = {}
        jobs: dict[str, str] = {}
        creators: dict[str, str] = {}
        for key, parsed in by_key.items():
            claim = existing.get(key)
            jobs[key] = self._job(parsed, claim)
            fields = _claim_fields(parsed, job=jobs[key])
            creators[key] = owners.claim_creator(
                recorded=claim.created_by if claim is not None else "",
                owner_references=parsed.owner_references,
                labels=parsed.labels,
                resolution=self.jobs.get(key),
                creator_labels=settings.TALLY_CREATED_BY_LABELS,
                controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
            )
            if creators[key]:
                fields["created_by"] = creators[key]
            if claim is None:
                claims_to_create.append(
                    ResourceClaim(
                        cluster=self.cluster,
                        uid=key,
                        first_seen=self._stamp("ResourceClaim", key),
                        **fields,
                    )
                )
            elif changed := [
                *(attr for attr, value in fields.items() if getattr(claim, attr) != value),
                *(("released_at",) if claim.released_at is not None else ()),
            ]:
                self.report.updated["ResourceClaim"] += 1
                if claim.owner_references == parsed.owner_references:
                    refined[claim.pk] = (claim.job, fields["job"])
                for attr, value in fields.items():
                    setattr(claim, attr, value)
                claim.released_at = None
                claims_to_update[tuple(changed)].append(claim)
        for columns, changed_claims in claims_to_update.items():
            update_instances(ResourceClaim, changed_claims, columns)
        _refine_allocation_jobs(refined)
        bulk_insert(ResourceClaim, claims_to_create)
        self.report.created["ResourceClaim"] += len(claims_to_create)
        # The ids of the claims read above are known; only those just created are read.
        claim_ids = {uid: claim.pk for uid, claim in existing.items()}
        if claims_to_create:
            claim_ids.update(
                ResourceClaim.objects.filter(
                    AnyOf("uid", [claim.uid for claim in claims_to_create]), cluster=self.cluster
                ).values_list("uid", "pk")
            )
        self.claims_written.update(claim_ids.values())
        new_allocations: list[Allocation] = []
        ended: dict[int, datetime] = {}
        for key, parsed in by_key.items():
            claim_id = claim_ids[key]
            at = self._stamp("ResourceClaim", key)
            current = open_allocations.get(claim_id, {})
            # Who is charged, fixed now (see `Allocation`; the team is per hour). The webhook's
            # record of who created a claim seen for the first time reaches it just after
            # this, through quota's handler of `claims_changed`, which fills it in.
            stored = existing.get(key)
            charged = {
                "job": jobs[key] or (stored.admitted_job if stored else ""),
                "username": creators[key],
            }
            start = min(parsed.allocated_at, at) if parsed.allocated_at else at
            for result in parsed.results:
                if result.admin_access:
                    continue  # admin access observes a device; it does not hold it
                result_key = (
                    result.request,
                    result.driver,
                    result.pool,
                    result.device,
                    result.share_id,
                )
                if current.pop(result_key, None) is None:
                    new_allocations.append(
                        Allocation(
                            cluster=self.cluster,
                            claim_id=claim_id,
                            request=result.request,
                            driver=result.driver,
                            pool=result.pool,
                            device_name=result.device,
                            share_id=result.share_id,
                            consumed_capacity=result.consumed_capacity,
                            start=self._charged_start(start),
                            **charged,
                        )
                    )
            ended.update((allocation_id, at) for allocation_id in current.values())
        self._end_allocations(ended)
        self._charge_from_taking(self._link(new_allocations))
        bulk_insert(Allocation, new_allocations)
        self.report.created["Allocation"] += len(new_allocations)
        # Usage changes from a new allocation's start and from an ended one's end (`at`); a
        # claim changed in nothing else (labels, status, resourceVersion) changes none.
        claim_times = {claim_ids[key]: self._stamp("ResourceClaim", key) for key in by_key}
        spans = [
            (allocation.start, claim_times[allocation.claim_id]) for allocation in new_allocations
        ]
        spans.extend((at, at) for at in sorted(set(ended.values())))
        reattributed = [pk for pk, (before, after) in refined.items() if before != after]
        self._claims_changed(list(claim_ids.values()), spans=spans, reattributed=reattributed)

    def _charged_start(self, start: datetime) -> datetime:
        """When an allocation that the cluster says began at `start` is charged from: where
        it began before the cluster's first sync, from the first sync, or from the end of the
        last closed billing period where that is later. A first import of a running cluster
        holds claims allocated months ago; their hours before Tally knew the cluster were
        never measured, and billing them would rewrite closed periods (late-data adjustments
        from one command)."""
        if start >= self.first_synced_at:
            return start
        if self.charge_floor is None:
            answers: list[datetime] = []
            for _, answer in usage_closed_until.send(sender=Cluster):
                value: object = answer
                if isinstance(value, datetime):
                    answers.append(value)
            closed_until = max(answers, default=None)
            self.charge_floor = (
                (closed_until, "the start of the oldest open billing period")
                if closed_until is not None and closed_until > self.first_synced_at
                else (self.first_synced_at, "the cluster's first sync")
            )
        floor, why = self.charge_floor
        if start >= floor:
            return start
        report = self.report
        report.charged_later += 1
        report.earliest_start = min(report.earliest_start or start, start)
        report.charged_from, report.charged_from_why = floor, why
        return floor

    def _job(self, parsed: dra.ParsedClaim, stored: ResourceClaim | None) -> str:
        """The claim's job: as the caller followed its owners, else as recorded before for the
        same owner references (the sync does not follow those again), else its controller."""
        same_owners = stored is not None and stored.owner_references == parsed.owner_references
        recorded = stored.job if stored is not None and same_owners else ""
        resolution = self.jobs.get(parsed.key)
        if resolution is not None:
            return resolution.over(recorded)
        return recorded or owners.own_job(parsed.owner_references)

    def attribute_claims(self, owner_index: owners.OwnerIndex) -> None:
        """Take the present claims in the index's namespaces as far as its owners lead."""
        if not owner_index:
            return
        changed = []
        refined: dict[int, tuple[str, str]] = {}
        # Claims that name nobody yet, and the person their owners name (a dump's Pods may
        # come after its claims: the claims were written before their owners were known).
        creators: dict[int, str] = {}
        for claim in ResourceClaim.objects.filter(
            cluster=self.cluster, released_at__isnull=True, namespace__in=owner_index.namespaces
        ).only("pk", "namespace", "owner_references", "job", "created_by"):
            resolution = owners.resolve_job(
                namespace=claim.namespace,
                owner_references=claim.owner_references,
                lookup=owner_index,
                creator_labels=settings.TALLY_CREATED_BY_LABELS,
            )
            job = resolution.over(claim.job)
            creator = "" if claim.created_by else resolution.created_by
            if job == claim.job and not creator:
                continue
            if job != claim.job:
                refined[claim.pk] = (claim.job, job)
                claim.job = job
            if creator:
                creators[claim.pk] = creator
                claim.created_by = creator
            changed.append(claim)
        update_instances(ResourceClaim, changed, ["job", "created_by"])
        _refine_allocation_jobs(refined)
        _fill_allocation_creators(creators)
        # Claims written by this snapshot were counted and signalled already.
        others = [claim.pk for claim in changed if claim.pk not in self.claims_written]
        self.report.updated["ResourceClaim"] += len(others)
        if refined or creators:
            # Those written by this snapshot are reattributed only now: all their hours too.
            self._claims_changed(others, spans=[], reattributed=list({*refined, *creators}))

    def _claims_changed(
        self,
        claim_ids: list[int],
        *,
        spans: list[tuple[datetime, datetime]],
        reattributed: list[int],
    ) -> None:
        """Send `claims_changed` (see `inventory.signals`) for these claims; batched, keep it
        for `send_claims_changed`."""
        if self.pending is not None:
            self.pending.claim_ids.update(dict.fromkeys(claim_ids))
            self.pending.spans.extend(spans)
            self.pending.reattributed.update(dict.fromkeys(reattributed))
            return
        self._send_claims_changed(claim_ids, spans=spans, reattributed=reattributed)

    def send_claims_changed(self, *, at: datetime) -> None:
        """Send the one `claims_changed`, as of `at`, of what a batched writer wrote so far,
        if anything."""
        if self.pending is None or not self.pending.claim_ids:
            return
        pending, self.pending = self.pending, _ClaimChanges()
        self._send_claims_changed(
            list(pending.claim_ids),
            spans=pending.spans,
            reattributed=list(pending.reattributed),
            at=at,
        )

    def _send_claims_changed(
        self,
        claim_ids: list[int],
        *,
        spans: list[tuple[datetime, datetime]],
        reattributed: list[int],
        at: datetime | None = None,
    ) -> None:
        unfilled = {
            pk: (username, job)
            for pk, username, job in Allocation.objects.filter(
                Q(username="") | Q(job=""), AnyOf("claim_id", claim_ids)
            ).values_list("pk", "username", "job")
        }
        claims_changed.send(
            sender=ResourceClaim,
            cluster=self.cluster,
            claim_ids=claim_ids,
            at=at or self.at,
            spans=spans,
            reattributed=reattributed,
            unfilled=unfilled,
        )

    def _end_allocations(self, ends: Mapping[int, datetime]) -> None:
        """End the allocations `ends` names (by id), each at its time there."""
        self.report.gone["Allocation"] += update_rows(
            Allocation, ["end"], ends.items(), where_null=["end"]
        )

    def _link(self, allocations: list[Allocation]) -> list[Allocation]:
        """Tie each allocation to its present device, where it is known, and fix what the
        allocation is metered and counted by from the device as it is now (see `Allocation`);
        returns the allocations linked. A device's capacity is read only for the few that
        consumed part of it."""
        wanted = {(a.driver, a.pool, a.device_name) for a in allocations}
        if not wanted:
            return []
        devices = {
            (row["driver"], row["pool"], row["name"]): row
            for row in Device.objects.filter(
                AnyOf("driver", {driver for driver, _, _ in wanted}),
                AnyOf("pool", {pool for _, pool, _ in wanted}),
                AnyOf("name", {name for _, _, name in wanted}),
                cluster=self.cluster,
                gone_at__isnull=True,
            ).values("pk", "driver", "pool", "name", *_METERED_DEVICE_FIELDS)
            if (row["driver"], row["pool"], row["name"]) in wanted
        }
        consuming = {
            devices[key]["pk"]
            for allocation in allocations
            if allocation.consumed_capacity and (key := _device_key(allocation)) in devices
        }
        capacities = dict(
            Device.objects.filter(AnyOf("pk", consuming)).values_list("pk", "capacity")
            if consuming
            else ()
        )
        linked = []
        for allocation in allocations:
            device = devices.get(_device_key(allocation))
            if device is None:
                continue
            allocation.device_id = device["pk"]
            for attr, value in allocation_metering(
                device=device,
                capacity=capacities.get(device["pk"], {}),
                consumed_capacity=allocation.consumed_capacity,
            ).items():
                setattr(allocation, attr, value)
            linked.append(allocation)
        return linked

    def _link_allocations(self, pools: list[tuple[str, str]]) -> None:
        """Tie open allocations seen before their device to the device, once it is known: they
        take their metering facts from it then."""
        wanted = set(pools)
        unlinked = [
            allocation
            for allocation in Allocation.objects.filter(
                AnyOf("driver", {driver for driver, _ in pools}),
                AnyOf("pool", {pool for _, pool in pools}),
                cluster=self.cluster,
                device__isnull=True,
                end__isnull=True,
            ).only("pk", "claim_id", "start", "driver", "pool", "device_name", "consumed_capacity")
            if (allocation.driver, allocation.pool) in wanted
        ]
        linked = self._link(unlinked)
        update_instances(Allocation, linked, ["device", *METERING_FIELDS])
        update_instances(Allocation, self._charge_from_taking(linked), ["start"])
        if linked:
            # Metered from now on, from their start: all their hours so far change.
            self._claims_changed(
                sorted({allocation.claim_id for allocation in linked}),
                spans=[
                    (allocation.start, self._stamp("Pool", allocation.driver, allocation.pool))
                    for allocation in linked
                ],
                reattributed=[],
            )

    # Disappearance.

    def mark_missing(self, scope: set[str], seen: dict[str, set[str]]) -> None:
        """Mark objects of the snapshot's kinds that it does not hold as gone at `at`."""
        for kind in sorted(scope):
            present = seen.get(kind, set())
            if kind == "ResourceClaim":
                missing_claims = ResourceClaim.objects.filter(
                    cluster=self.cluster, released_at__isnull=True
                ).exclude(AnyOf("uid", present))
                self._release_claims(
                    dict.fromkeys(missing_claims.values_list("pk", flat=True), self.at)
                )
            elif kind == "ResourceSlice":
                missing = ResourceSlice.objects.filter(
                    cluster=self.cluster, gone_at__isnull=True
                ).exclude(AnyOf("name", present))
                self.touched_pools |= set(missing.values_list("driver", "pool"))
                self.report.gone[kind] += missing.update(gone_at=self.at)
            else:
                model = {"Node": Node, "DeviceClass": DeviceClass}[kind]
                missing_rows = model._default_manager.filter(
                    cluster=self.cluster, gone_at__isnull=True
                ).exclude(AnyOf("name", present))
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

    def _release_deleted_claims(self) -> None:
        if not self.deleted_claims:
            return
        keys, self.deleted_claims = self.deleted_claims, []
        self._release_claims(
            {
                pk: self._stamp("ResourceClaim", uid)
                for pk, uid in ResourceClaim.objects.filter(
                    AnyOf("uid", keys), cluster=self.cluster, released_at__isnull=True
                ).values_list("pk", "uid")
            }
        )

    def _release_claims(self, released: Mapping[int, datetime]) -> None:
        """Release the claims `released` names (by id), each at its time there."""
        if not released:
            return
        ending = dict(
            Allocation.objects.filter(AnyOf("claim_id", released), end__isnull=True).values_list(
                "pk", "claim_id"
            )
        )
        self._end_allocations({pk: released[claim_id] for pk, claim_id in ending.items()})
        self.report.gone["ResourceClaim"] += update_rows(
            ResourceClaim, ["released_at"], released.items(), where_null=["released_at"]
        )
        # Usage changes from the hour the allocations ended in (`at`), not before.
        spans = [(at, at) for at in sorted({released[claim_id] for claim_id in ending.values()})]
        self._claims_changed(list(released), spans=spans, reattributed=[])


# The columns `_device_fields` gives a device: what `_reconcile_pools` reads back to compare.
_DEVICE_FIELDS = (
    "node_id",
    "shape_id",
    "slice_name",
    "pool_generation",
    "kind",
    "physical_gpu_key",
    "unit",
    "gpu_share",
    "meter_id",
    "attributes",
    "capacity",
    "extra",
    "product_name",
    "uuid",
    "parent_uuid",
    "device_type",
    "profile",
    "memory_bytes",
    "architecture",
    "driver_version",
    "cuda_driver_version",
    "cuda_compute_capability",
)


def _lock_device_identities() -> None:
    """Take the lock on which cluster a device identity is live in (see `db.locks`): first in
    the sync's transaction, before any lock its claims' writes take."""
    advisory_xact_lock("inventory.device.identity", [0])


def identities_live_elsewhere(*, cluster: Cluster, identities: Collection[str]) -> dict[str, str]:
    """Of `identities` (UUIDs or meter ids), those a present device of another cluster has,
    with that cluster's name."""
    found: dict[str, str] = {}
    for meter_id, uuid, other in (
        Device.objects.filter(
            Q(AnyOf("meter_id", identities)) | Q(AnyOf("uuid", identities)),
            gone_at__isnull=True,
        )
        .exclude(cluster=cluster)
        .values_list("meter_id", "uuid", "cluster__name")
    ):
        for identity in {meter_id, uuid} & set(identities):
            found.setdefault(identity, other)
    return found


def _refused_pools(cluster: Cluster) -> list[tuple[str, str]]:
    """The cluster's pools with devices refused (`Pool.refused`), as (driver, pool)."""
    return sorted(
        Pool.objects.filter(cluster=cluster).exclude(refused={}).values_list("driver", "name")
    )


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


def _but_generation(spec: Any) -> Any:
    """A slice's spec without its pool's generation: what its devices are counted from."""
    if not isinstance(spec, dict) or not isinstance(spec.get("pool"), dict):
        return spec
    return {**spec, "pool": {k: v for k, v in spec["pool"].items() if k != "generation"}}


def _device_fields(
    counted: dra.CountedDevice,
    node_ids: dict[str, int],
    shape_ids: dict[str, int],
    generation: int,
) -> dict[str, Any]:
    device = counted.device
    return {
        "node_id": node_ids.get(device.node_name),
        "shape_id": shape_ids[counted.shape_key],
        "slice_name": counted.slice_name,
        "pool_generation": generation,
        "kind": counted.kind,
        "physical_gpu_key": counted.physical_gpu_key,
        "unit": counted.unit,
        "gpu_share": counted.gpu_share,
        "meter_id": counted.meter_id,
        "attributes": device.attributes,
        "capacity": device.capacity,
        "extra": device.extra,
        **counted.columns,
    }


@dataclass
class _ClaimChanges:
    """What a batched writer will send in its one `claims_changed` (claim ids in order)."""

    claim_ids: dict[int, None] = field(default_factory=dict)
    spans: list[tuple[datetime, datetime]] = field(default_factory=list)
    reattributed: dict[int, None] = field(default_factory=dict)


def _claim_fields(parsed: dra.ParsedClaim, *, job: str) -> dict[str, Any]:
    return {
        "namespace": parsed.namespace,
        "name": parsed.name,
        "api_version": parsed.api_version,
        "labels": parsed.labels,
        "annotations": parsed.annotations,
        "owner_references": parsed.owner_references,
        "job": job,
        "spec": parsed.spec,
        "status": parsed.status,
        "resource_version": parsed.resource_version,
        "created_at": parsed.created_at,
    }


def _refine_allocation_jobs(refined: dict[int, tuple[str, str]]) -> None:
    """Per claim id, (job before, job now): the claim's allocations charged to the job before
    are charged to the job now. The sync follows a claim's owners further as it learns them
    (`Pod/web-5d9f-x`, then `Deployment/web`), for the same owner references: the same
    workload, named better. An allocation charged to anything else keeps it."""
    refined = {claim_id: jobs for claim_id, jobs in refined.items() if jobs[0] != jobs[1]}
    if not refined:
        return
    changed = []
    for allocation in Allocation.objects.filter(AnyOf("claim_id", refined)).only(
        "pk", "claim", "job"
    ):
        before, after = refined[allocation.claim_id]
        if allocation.job == before:
            allocation.job = after
            changed.append(allocation)
    update_instances(Allocation, changed, ["job"])


def _fill_allocation_creators(creators: dict[int, str]) -> None:
    """Per claim id, the person its owners name: its allocations that name nobody are charged
    to that person (one that names someone keeps it: fixed when it started)."""
    changed = []
    for allocation in Allocation.objects.filter(AnyOf("claim_id", creators), username="").only(
        "pk", "claim", "username"
    ):
        allocation.username = creators[allocation.claim_id]
        changed.append(allocation)
    update_instances(Allocation, changed, ["username"])


# What an allocation is metered and counted by (`Allocation`), and the device columns they come
# from besides its capacity.
METERING_FIELDS = ("meter_id", "unit", "product_name", "profile", "device_share", "gpu_share")
_METERED_DEVICE_FIELDS = ("meter_id", "unit", "product_name", "profile", "gpu_share", "kind")
_MILLIONTH = Decimal("0.000001")


def allocation_metering(
    *, device: Mapping[str, Any], capacity: Mapping[str, Any], consumed_capacity: Mapping[str, Any]
) -> dict[str, Any]:
    """The `METERING_FIELDS` of an allocation of `device` (its driver and the columns named in
    `_METERED_DEVICE_FIELDS`, by name) that consumed `consumed_capacity` of the device's
    `capacity`: the facts the allocation keeps from when it starts.

    A consumable share (KEP-5075) holds the largest fraction of any capacity it consumed, to the
    millionth; a capacity published with a value that is no quantity holds the whole device,
    as a share that names no capacity does: the allocation still holds it. A device that is not
    an accelerator holds no share."""
    device_share = Decimal(device["gpu_share"])
    share = device_share if device["kind"] != DeviceKind.OTHER else Decimal(0)
    if consumed_capacity:
        try:
            fraction = consumed_fraction(capacity, consumed_capacity, device["driver"])
        except CapacityError:
            fraction = Decimal(1)
        share = (share * fraction).quantize(_MILLIONTH, ROUND_HALF_EVEN)
    return {
        "meter_id": device["meter_id"],
        "unit": device["unit"],
        "product_name": device["product_name"],
        "profile": device["profile"],
        "device_share": device_share,
        "gpu_share": share,
    }


def _device_key(allocation: Allocation) -> tuple[str, str, str]:
    return (allocation.driver, allocation.pool, allocation.device_name)


# What tells an allocation of a claim from its others: one per result of its allocation.
_ALLOCATION_KEY_FIELDS = ("request", "driver", "pool", "device_name", "share_id")
