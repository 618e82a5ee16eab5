"""The slice side of a sync writer: nodes, device classes and slices are written, and each
touched pool's devices recounted from its stored slices (shapes, counts, meters, devices
refused because another cluster holds them)."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import (
    F,
    Q,
    QuerySet,
)

from db.bulk import AnyOf, AnyRowOf, update_instances, update_rows
from db.copy import bulk_insert, insert_values
from inventory import cel, dra
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    DeviceShape,
    Node,
    Pool,
    ResourceSlice,
)
from inventory.signals import meters_changed
from inventory.sync_state import WriterState, device_key

log = logging.getLogger(__name__)

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

# Pools recounted in one go.
_POOLS_PER_RECONCILE = 500


class SliceWriter(WriterState):
    """Writes nodes, device classes and slices, and reconciles pools."""

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
            AnyRowOf(("driver", "pool"), in_hand),
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
        pool_rows = {
            (row.driver, row.name): row
            for row in Pool.objects.filter(
                AnyRowOf(("driver", "name"), pools), cluster=self.cluster
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
        new_devices: list[dict[str, Any]] = []
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
                    # Rows, not instances: an import makes 100,000 of them.
                    new_devices.append(
                        {
                            "cluster_id": self.cluster.pk,
                            "driver": pool_row.driver,
                            "pool": pool_row.name,
                            "name": name,
                            "first_seen": pool_at,
                            **fields,
                        }
                    )
                    appeared[(pool_row.driver, pool_row.name, name)] = pool_at
                elif changed := [attr for attr, value in fields.items() if known[attr] != value]:
                    changed_devices[tuple(changed)].append(
                        (known["pk"], *(fields[attr] for attr in changed))
                    )
                    if "meter_id" in changed:
                        renamed[known["pk"]] = pool_at
            gone.update((device["pk"], pool_at) for device in current.values())
        insert_values(Device, new_devices)
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
        identity lock (`lock_device_identities`), so no other cluster takes one meanwhile."""
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
            AnyRowOf(("driver", "pool"), pools),
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
                AnyRowOf(("driver", "pool", "device_name"), appeared),
                cluster=self.cluster,
                end__isnull=True,
                device__gone_at__isnull=False,
            ).only("pk", "claim_id", "start", "driver", "pool", "device_name", "device_id"):
                if (key := device_key(allocation)) in appeared:
                    relinked.append(allocation)
                    changes.append((allocation.claim_id, max(allocation.start, appeared[key])))
        # Devices whose meter id changed (by id), and when: the renamed ones, and the new rows
        # whose meter id is not the gone row's they took allocations from.
        remetered = dict(renamed)
        if relinked:
            present = {
                (driver, pool, name): (pk, meter_id)
                for pk, driver, pool, name, meter_id in Device.objects.filter(
                    AnyRowOf(("driver", "pool", "name"), {device_key(a) for a in relinked}),
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
                key = device_key(allocation)
                device_id, meter_id = present[key]
                if meter_id != gone_meters.get(allocation.device_id):
                    remetered.setdefault(device_id, appeared[key])
                allocation.device_id = device_id
            update_instances(Allocation, relinked, ["device"])
        if remetered:
            # The hours before: a source that keeps the past under the new id may measure them.
            meters_changed.send(sender=type(self), cluster=self.cluster, devices=remetered)
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


def pools_with_refusals(cluster: Cluster) -> list[tuple[str, str]]:
    """The cluster's pools with devices refused (`Pool.refused`), as (driver, pool)."""
    return sorted(
        Pool.objects.filter(cluster=cluster).exclude(refused={}).values_list("driver", "name")
    )


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
