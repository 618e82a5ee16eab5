"""Writes to the inventory: snapshots and watch events from Kubernetes become rows.

Every function here takes plain Python data (the JSON of Kubernetes objects), so the same
code serves `sync_inventory --from-file`, the live list + watch, tests and benchmarks.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q

from db.copy import bulk_insert
from inventory import dra, owners, profiles
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
    Pool,
    ResourceClaim,
    ResourceSlice,
)
from inventory.signals import claims_changed
from teams.models import TeamNamespace

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

    def summary(self) -> str:
        kinds = sorted({*self.created, *self.updated, *self.gone, *self.skipped})
        parts = [
            f"{kind}: {self.created[kind]} new, {self.updated[kind]} changed, "
            f"{self.gone[kind]} gone"
            + (f", {self.skipped[kind]} skipped" if self.skipped[kind] else "")
            for kind in kinds
        ]
        parts.append(f"{len(self.errors)} rejected")
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
    """
    report = SyncReport()
    scope = set(kinds) if kinds is not None else set()
    seen: dict[str, set[str]] = defaultdict(set)
    owner_index = owners.OwnerIndex()
    gang_index = GangIndex()
    writer = _Writer(cluster=cluster, at=at, report=report, jobs=jobs)
    with transaction.atomic():
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
    return report


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
    report = SyncReport()
    writer = _Writer(cluster=cluster, at=at, report=report, jobs=jobs)
    claim_uid = _claim_uid(obj)
    with transaction.atomic():
        # Only this claim's gangs (before the event and after it) can end with it.
        gangs_before = _gangs_of(cluster, claim_uid)
        if event_type == "DELETED":
            identity = dra.object_identity(obj)
            if identity is None:
                report.errors.append(f"{dra.object_ref(obj)}: metadata.name: is required")
            elif identity[0] in KINDS:
                writer.mark_deleted(*identity)
        elif event_type in ("ADDED", "MODIFIED"):
            for parsed in _parse_stream([obj], report, defaultdict(set)):
                writer.add(parsed)
            writer.flush()
        else:
            raise ValueError(f"unknown watch event type {event_type!r}")
        writer.reconcile_touched_pools()
        if obj.get("kind") == "ResourceClaim":
            record_claim_gangs(cluster=cluster, gangs=gangs or {}, at=at)
            if not claim_uid:  # which claim it was is not known: every gang is looked at
                end_gangs(cluster=cluster, at=at)
            elif touched := gangs_before | _gangs_of(cluster, claim_uid):
                end_gangs(cluster=cluster, at=at, gang_ids=touched)
        writer.note_fleet_change()
    return report


def resolve_claim_jobs(
    *, cluster: Cluster, objects: Iterable[dict[str, Any]], lookup: owners.OwnerLookup
) -> dict[str, owners.Resolution]:
    """Follow the owners of the claims among `objects` (raw JSON) through `lookup`, by claim
    uid, for `import_snapshot` and `apply_watch_event`.

    Only claims whose controller is a Pod, ReplicaSet or Job are followed, and not those
    already recorded beyond it for the same owner references: their owners are not read
    again. Writes nothing; the caller runs it before its transaction, so that no database
    transaction waits on the API server.
    """
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
            cluster=cluster, uid__in=keys[start : start + _CLAIMS_PER_FLUSH]
        ).values_list("uid", "owner_references", "job"):
            if references == candidates[uid][1] and job not in ("", owners.own_job(references)):
                del candidates[uid]
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
    found = {uid: ref for uid, ref in gangs.items() if ref is not None}
    uids = list(found)
    for start in range(0, len(uids), _CLAIMS_PER_FLUSH):
        claims = list(
            ResourceClaim.objects.filter(
                cluster=cluster, uid__in=uids[start : start + _CLAIMS_PER_FLUSH]
            ).values_list("pk", "uid", "namespace", "gang_id")
        )
        gang_ids = _upsert_gangs(
            cluster=cluster,
            refs={(namespace, found[uid].key): found[uid] for _, uid, namespace, _ in claims},
            at=at,
        )
        moved: dict[int, list[int]] = defaultdict(list)
        for pk, uid, namespace, gang_id in claims:
            wanted = gang_ids[(namespace, found[uid].key)]
            if gang_id != wanted:
                moved[wanted].append(pk)
        for gang_id, claim_ids in moved.items():
            ResourceClaim.objects.filter(pk__in=claim_ids).update(gang_id=gang_id)


def record_gang(*, cluster: Cluster, namespace: str, ref: GangRef, at: datetime) -> Gang:
    """The gang `ref` names in `namespace`, created or refreshed (source, size) at `at`.

    For whoever learns of a gang before the sync does (the admission webhook). Concurrent
    calls for one gang leave one row: an upsert on its unique key.
    """
    gang_ids = _upsert_gangs(cluster=cluster, refs={(namespace, ref.key): ref}, at=at)
    return Gang.objects.get(pk=gang_ids[(namespace, ref.key)])


def end_gangs(*, cluster: Cluster, at: datetime, gang_ids: Collection[int] | None = None) -> int:
    """End, at `at`, the open gangs of `cluster` (of `gang_ids`, when given) whose member
    claims are all released; how many. A gang no claim has joined yet (recorded by the webhook
    before the sync saw its first member) has not started, so it does not end here."""
    member = ResourceClaim.objects.filter(gang=OuterRef("pk"))
    gangs = Gang.objects.filter(Exists(member), cluster=cluster, ended_at__isnull=True)
    if gang_ids is not None:
        gangs = gangs.filter(pk__in=gang_ids)
    return gangs.exclude(Exists(member.filter(released_at__isnull=True))).update(ended_at=at)


def _claim_uid(obj: Any) -> str:
    """The uid of a ResourceClaim object; "" for any other object, or a claim without one."""
    if not isinstance(obj, dict) or obj.get("kind") != "ResourceClaim":
        return ""
    uid = (obj.get("metadata") or {}).get("uid") if isinstance(obj.get("metadata"), dict) else ""
    return uid if isinstance(uid, str) else ""


def _gangs_of(cluster: Cluster, claim_uid: str) -> set[int]:
    """The gang the claim `claim_uid` is stored in, as a set (empty: none, or no claim)."""
    if not claim_uid:
        return set()
    return set(
        ResourceClaim.objects.filter(
            cluster=cluster, uid=claim_uid, gang__isnull=False
        ).values_list("gang_id", flat=True)
    )


def _upsert_gangs(
    *, cluster: Cluster, refs: Mapping[tuple[str, str], GangRef], at: datetime
) -> dict[tuple[str, str], int]:
    """The ids of the gangs `refs` names by (namespace, key), created or refreshed at `at`."""
    rows = [
        Gang(
            cluster=cluster,
            namespace=namespace,
            key=key,
            source=ref.source,
            size=ref.size,
            first_seen=at,
            last_seen=at,
            ended_at=None,
        )
        for (namespace, key), ref in refs.items()
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
    ) -> None:
        self.cluster = cluster
        self.at = at
        self.report = report
        self.jobs: Mapping[str, owners.Resolution] = jobs or {}
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

    # Nodes and device classes.

    def _write_nodes(self) -> None:
        if not self.nodes:
            return
        by_name = {parsed.name: parsed for parsed in self.nodes}
        self.nodes = []
        existing = {
            node.name: node
            for node in Node.objects.filter(cluster=self.cluster, name__in=by_name).only(
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
                cluster=self.cluster, gone_at__isnull=True, name__in=by_name
            ).values("id", "name", "driver", "pool", "spec", "api_version")
        }
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
                first_seen=self.at,
            )
            old = existing.get(parsed.name)
            if old is None:
                new_rows.append(row)
                continue
            self.touched_pools.add((old["driver"], old["pool"]))
            unchanged = old["spec"] == parsed.spec and old["api_version"] == parsed.api_version
            if not unchanged:
                row.pk = old["id"]
                changed_rows.append(row)
        bulk_insert(ResourceSlice, new_rows)
        ResourceSlice.objects.bulk_update(
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
            ],
            batch_size=500,
        )
        self.report.created["ResourceSlice"] += len(new_rows)
        self.report.updated["ResourceSlice"] += len(changed_rows)
        self._reconcile_pools_in_hand(list(by_name.values()))
        self.slices = []
        self.buffered_devices = 0

    def _reconcile_pools_in_hand(self, written: list[dra.ParsedSlice]) -> None:
        """Recount now the pools whose every stored slice was just written.

        That is the common case (a pool is one slice, or its slices arrive together) and saves
        reading the slices back; other pools are recounted from storage at the end.
        """
        in_hand: dict[tuple[str, str], list[dra.ParsedSlice]] = defaultdict(list)
        for parsed in written:
            in_hand[(parsed.driver, parsed.pool)].append(parsed)
        stored: dict[tuple[str, str], set[str]] = defaultdict(set)
        for driver, pool, name in ResourceSlice.objects.filter(
            cluster=self.cluster,
            gone_at__isnull=True,
            driver__in={driver for driver, _ in in_hand},
            pool__in={pool for _, pool in in_hand},
        ).values_list("driver", "pool", "name"):
            stored[(driver, pool)].add(name)
        ready = {
            key: slices
            for key, slices in in_hand.items()
            if stored[key] == {parsed.name for parsed in slices} and key in self.touched_pools
        }
        pools = sorted(ready)
        for start in range(0, len(pools), _POOLS_PER_RECONCILE):
            batch = pools[start : start + _POOLS_PER_RECONCILE]
            self._reconcile_pools(batch, {key: ready[key] for key in batch})
        self.touched_pools -= ready.keys()
        self.linkable_pools |= ready.keys()

    def note_fleet_change(self) -> None:
        """Bump the cluster's fleet version when devices, classes or nodes changed."""
        report = self.report
        if any(
            report.created[kind] or report.updated[kind] or report.gone[kind]
            for kind in ("Device", "DeviceClass", "Node")
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
            cluster=self.cluster,
            gone_at__isnull=True,
            driver__in={d for d, _ in pools},
            pool__in={p for _, p in pools},
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
    ) -> None:
        """Recount each pool from all its present slices: newest complete generation only."""
        wanted = set(pools)
        pool_filter = Q(driver__in={d for d, _ in pools}, pool__in={p for _, p in pools})
        existing: dict[tuple[str, str], dict[str, Device]] = defaultdict(dict)
        for device in Device.objects.filter(
            pool_filter, cluster=self.cluster, gone_at__isnull=True
        ):
            if (device.driver, device.pool) in wanted:
                existing[(device.driver, device.pool)][device.name] = device
        pool_rows = {
            (row.driver, row.name): row
            for row in Pool.objects.filter(
                cluster=self.cluster,
                driver__in={d for d, _ in pools},
                name__in={p for _, p in pools},
            )
        }
        new_devices: list[Device] = []
        changed_devices: list[Device] = []
        gone_ids: list[int] = []
        counted_pools: list[tuple[Pool, dict[str, dra.CountedDevice]]] = []
        for key in pools:
            driver, pool_name = key
            pool_slices = slices.get(key, [])
            newest = max((s.generation for s in pool_slices), default=None)
            at_newest = [s for s in pool_slices if s.generation == newest]
            pool_row = pool_rows.get(key) or Pool(
                cluster=self.cluster, driver=driver, name=pool_name
            )
            pool_rows[key] = pool_row
            pool_row.newest_generation = newest
            pool_row.slices_expected = max((s.resource_slice_count for s in at_newest), default=0)
            pool_row.slices_seen = len(at_newest)
            pool_row.updated_at = self.at
            if not pool_slices:
                counted_pools.append((pool_row, {}))
            elif pool_row.complete:
                pool_row.counted_generation = newest
                counted_pools.append((pool_row, self._count(driver, pool_name, at_newest)))
            # else: the newest generation is incomplete; keep counting the last complete one.
        known_pools = [row for row in pool_rows.values() if row.pk is not None]
        Pool.objects.bulk_create([row for row in pool_rows.values() if row.pk is None])
        Pool.objects.bulk_update(
            known_pools,
            [
                "counted_generation",
                "newest_generation",
                "slices_expected",
                "slices_seen",
                "updated_at",
            ],
        )
        node_ids = self._node_ids(
            {c.device.node_name for _, desired in counted_pools for c in desired.values()}
        )
        shape_ids = self._shape_ids(
            [counted for _, desired in counted_pools for counted in desired.values()]
        )
        for pool_row, desired in counted_pools:
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
                            first_seen=self.at,
                            **fields,
                        )
                    )
                elif any(getattr(known, attr) != value for attr, value in fields.items()):
                    for attr, value in fields.items():
                        setattr(known, attr, value)
                    changed_devices.append(known)
            gone_ids.extend(device.pk for device in current.values())
        bulk_insert(Device, new_devices)
        if changed_devices:
            Device.objects.bulk_update(changed_devices, list(_DEVICE_FIELDS), batch_size=500)
        if gone_ids:
            Device.objects.filter(pk__in=gone_ids).update(gone_at=self.at)
        self.report.created["Device"] += len(new_devices)
        self.report.updated["Device"] += len(changed_devices)
        self.report.gone["Device"] += len(gone_ids)

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
        """Ids of the devices' shapes by key, each distinct shape stored once."""
        shapes: dict[str, dra.CountedDevice] = {}
        for device in counted:
            shapes.setdefault(device.shape_key, device)
        known = self.shape_ids.keys()
        missing = [key for key in shapes if key not in known]
        if missing:
            self.shape_ids.update(
                DeviceShape.objects.filter(cluster=self.cluster, key__in=missing).values_list(
                    "key", "pk"
                )
            )
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
                        cluster=self.cluster, key__in=[s.key for s in new_shapes]
                    ).values_list("key", "pk")
                )
        return self.shape_ids

    def _node_ids(self, names: set[str]) -> dict[str, int]:
        """Ids of the named nodes, created (without labels) when first seen through a slice."""
        names.discard("")
        missing = names - self.node_ids.keys()
        if missing:
            for row in Node.objects.filter(cluster=self.cluster, name__in=missing).values(
                "id", "name"
            ):
                self.node_ids[row["name"]] = row["id"]
            new_nodes = [
                Node(cluster=self.cluster, name=name, first_seen=self.at)
                for name in sorted(missing - self.node_ids.keys())
            ]
            if new_nodes:
                bulk_insert(Node, new_nodes)
                self.report.created["Node"] += len(new_nodes)
                for row in Node.objects.filter(
                    cluster=self.cluster, name__in=[n.name for n in new_nodes]
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
            for claim in ResourceClaim.objects.filter(cluster=self.cluster, uid__in=by_key)
        }
        open_allocations: dict[int, dict[tuple[str, ...], Allocation]] = defaultdict(dict)
        for allocation in Allocation.objects.filter(
            claim__in=[c.pk for c in existing.values()], end__isnull=True
        ):
            open_allocations[allocation.claim_id][_allocation_key(allocation)] = allocation
        claims_to_create = []
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
                    ResourceClaim(cluster=self.cluster, uid=key, first_seen=self.at, **fields)
                )
            elif claim.released_at is not None or any(
                getattr(claim, attr) != value for attr, value in fields.items()
            ):
                ResourceClaim.objects.filter(pk=claim.pk).update(released_at=None, **fields)
                self.report.updated["ResourceClaim"] += 1
                if claim.owner_references == parsed.owner_references:
                    refined[claim.pk] = (claim.job, fields["job"])
        _refine_allocation_jobs(refined)
        bulk_insert(ResourceClaim, claims_to_create)
        self.report.created["ResourceClaim"] += len(claims_to_create)
        claim_ids = dict(
            ResourceClaim.objects.filter(cluster=self.cluster, uid__in=by_key).values_list(
                "uid", "pk"
            )
        )
        self.claims_written.update(claim_ids.values())
        new_allocations: list[Allocation] = []
        ended: list[int] = []
        namespaces: dict[int, str] = {}
        for key, parsed in by_key.items():
            claim_id = claim_ids[key]
            namespaces[claim_id] = parsed.namespace
            current = open_allocations.get(claim_id, {})
            # Who is charged, fixed now (see `Allocation`; the team below). The webhook's
            # record of who created a claim seen for the first time reaches it just after
            # this, through quota's handler of `claims_changed`, which fills it in.
            stored = existing.get(key)
            charged = {
                "job": jobs[key] or (stored.admitted_job if stored else ""),
                "username": creators[key],
            }
            start = min(parsed.allocated_at, self.at) if parsed.allocated_at else self.at
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
                            start=start,
                            **charged,
                        )
                    )
            ended.extend(allocation.pk for allocation in current.values())
        self._end_allocations(ended)
        self._link(new_allocations)
        teams = _namespace_teams({namespaces[a.claim_id] for a in new_allocations})
        for allocation in new_allocations:
            allocation.team_id = teams.get(namespaces[allocation.claim_id])
        bulk_insert(Allocation, new_allocations)
        self.report.created["Allocation"] += len(new_allocations)
        # Usage changes from a new allocation's start and from an ended one's end (`at`); a
        # claim changed in nothing else (labels, status, resourceVersion) changes none.
        spans = [(allocation.start, self.at) for allocation in new_allocations]
        if ended:
            spans.append((self.at, self.at))
        reattributed = [pk for pk, (before, after) in refined.items() if before != after]
        self._claims_changed(list(claim_ids.values()), spans=spans, reattributed=reattributed)

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
        ResourceClaim.objects.bulk_update(changed, ["job", "created_by"], batch_size=1000)
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
        """Send `claims_changed` (see `inventory.signals`) for these claims."""
        unfilled = {
            pk: (username, job)
            for pk, username, job in Allocation.objects.filter(
                Q(username="") | Q(job=""), claim_id__in=claim_ids
            ).values_list("pk", "username", "job")
        }
        claims_changed.send(
            sender=ResourceClaim,
            cluster=self.cluster,
            claim_ids=claim_ids,
            at=self.at,
            spans=spans,
            reattributed=reattributed,
            unfilled=unfilled,
        )

    def _end_allocations(self, allocation_ids: list[int]) -> None:
        if allocation_ids:
            ended = Allocation.objects.filter(pk__in=allocation_ids, end__isnull=True).update(
                end=self.at
            )
            self.report.gone["Allocation"] += ended

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
                cluster=self.cluster,
                gone_at__isnull=True,
                driver__in={driver for driver, _, _ in wanted},
                pool__in={pool for _, pool, _ in wanted},
                name__in={name for _, _, name in wanted},
            ).values("pk", "driver", "pool", "name", *_METERED_DEVICE_FIELDS)
            if (row["driver"], row["pool"], row["name"]) in wanted
        }
        consuming = {
            devices[key]["pk"]
            for allocation in allocations
            if allocation.consumed_capacity and (key := _device_key(allocation)) in devices
        }
        capacities = dict(
            Device.objects.filter(pk__in=consuming).values_list("pk", "capacity")
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
                cluster=self.cluster,
                device__isnull=True,
                end__isnull=True,
                driver__in={driver for driver, _ in pools},
                pool__in={pool for _, pool in pools},
            ).only("pk", "claim_id", "start", "driver", "pool", "device_name", "consumed_capacity")
            if (allocation.driver, allocation.pool) in wanted
        ]
        linked = self._link(unlinked)
        Allocation.objects.bulk_update(linked, ["device", *METERING_FIELDS], batch_size=1000)
        if linked:
            # Metered from now on, from their start: all their hours so far change.
            self._claims_changed(
                sorted({allocation.claim_id for allocation in linked}),
                spans=[(allocation.start, self.at) for allocation in linked],
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
                ).exclude(uid__in=present)
                self._release_claims(list(missing_claims.values_list("pk", flat=True)))
            elif kind == "ResourceSlice":
                missing = ResourceSlice.objects.filter(
                    cluster=self.cluster, gone_at__isnull=True
                ).exclude(name__in=present)
                self.touched_pools |= set(missing.values_list("driver", "pool"))
                self.report.gone[kind] += missing.update(gone_at=self.at)
            else:
                model = {"Node": Node, "DeviceClass": DeviceClass}[kind]
                missing_rows = model._default_manager.filter(
                    cluster=self.cluster, gone_at__isnull=True
                ).exclude(name__in=present)
                self.report.gone[kind] += missing_rows.update(gone_at=self.at)

    def mark_deleted(self, kind: str, identity: str) -> None:
        """Mark one object gone (a claim released) because a watch reported it deleted."""
        if kind == "ResourceClaim":
            ids = ResourceClaim.objects.filter(
                cluster=self.cluster, uid=identity, released_at__isnull=True
            ).values_list("pk", flat=True)
            self._release_claims(list(ids))
            return
        model = {"Node": Node, "DeviceClass": DeviceClass, "ResourceSlice": ResourceSlice}[kind]
        rows = model._default_manager.filter(
            cluster=self.cluster, name=identity, gone_at__isnull=True
        )
        if kind == "ResourceSlice":
            self.touched_pools |= set(rows.values_list("driver", "pool"))
        self.report.gone[kind] += rows.update(gone_at=self.at)

    def _release_claims(self, claim_ids: list[int]) -> None:
        if not claim_ids:
            return
        ending = list(
            Allocation.objects.filter(claim__in=claim_ids, end__isnull=True).values_list(
                "pk", flat=True
            )
        )
        self._end_allocations(ending)
        self.report.gone["ResourceClaim"] += ResourceClaim.objects.filter(
            pk__in=claim_ids, released_at__isnull=True
        ).update(released_at=self.at)
        # Usage changes from the hour the allocations ended in (`at`), not before.
        spans = [(self.at, self.at)] if ending else []
        self._claims_changed(claim_ids, spans=spans, reattributed=[])


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


def _namespace_teams(namespaces: set[str]) -> dict[str, int]:
    """The team owning each of `namespaces` now, by id (a namespace no team owns is left out)."""
    if not namespaces:
        return {}
    return dict(
        TeamNamespace.objects.filter(namespace__in=namespaces).values_list("namespace", "team_id")
    )


def _refine_allocation_jobs(refined: dict[int, tuple[str, str]]) -> None:
    """Per claim id, (job before, job now): the claim's allocations charged to the job before
    are charged to the job now. The sync follows a claim's owners further as it learns them
    (`Pod/web-5d9f-x`, then `Deployment/web`), for the same owner references: the same
    workload, named better. An allocation charged to anything else keeps it."""
    refined = {claim_id: jobs for claim_id, jobs in refined.items() if jobs[0] != jobs[1]}
    if not refined:
        return
    changed = []
    for allocation in Allocation.objects.filter(claim_id__in=refined).only("pk", "claim", "job"):
        before, after = refined[allocation.claim_id]
        if allocation.job == before:
            allocation.job = after
            changed.append(allocation)
    Allocation.objects.bulk_update(changed, ["job"], batch_size=1000)


def _fill_allocation_creators(creators: dict[int, str]) -> None:
    """Per claim id, the person its owners name: its allocations that name nobody are charged
    to that person (one that names someone keeps it: fixed when it started)."""
    changed = []
    for allocation in Allocation.objects.filter(claim_id__in=creators, username="").only(
        "pk", "claim", "username"
    ):
        allocation.username = creators[allocation.claim_id]
        changed.append(allocation)
    Allocation.objects.bulk_update(changed, ["username"], batch_size=1000)


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


def _allocation_key(allocation: Allocation) -> tuple[str, ...]:
    return (
        allocation.request,
        allocation.driver,
        allocation.pool,
        allocation.device_name,
        allocation.share_id,
    )
