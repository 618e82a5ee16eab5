"""Adoption: samples set aside for devices the inventory did not know are stored once it
knows them, where their sender could have sent them (`adopt_unknown_samples`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connection, transaction
from django.db.models import Exists, OuterRef
from django.db.models.fields.json import KT

from db.copy import json_rows
from inventory.models import Device, DeviceKind
from metering.blocks import thaw_samples
from metering.dirty import mark_dirty
from metering.hours import sample_hold_ms
from metering.ingest.gaps import Bounds, lock_devices, refresh_gaps, touched_hours
from metering.ingest.placement import (
    WIDEN_SQL,
    Held,
    InstanceSample,
    Placements,
    instance_points,
    place_keyed,
)
from metering.ingest.rows import ADOPT_CHUNK, COLUMNS
from metering.ingest.store import device_places, insert_new, table_name, why_misplaced
from metering.ingest.validation import instance_key
from metering.mig_instances import (
    InstanceKey,
    lock_instances,
    record_instances,
)
from metering.mig_samples import GpuInstance, MigPlacement, partitions_at
from metering.models import AgentToken, MigInstance, Sample, UnknownDeviceSample


class _SetAside(NamedTuple):
    """A sample set aside, as adoption reads it."""

    id: int
    device_uuid: str
    agent_token_id: int | None
    node: str
    ts_ms: int
    mig_placement: dict[str, Any] | None
    gpu_instance: dict[str, Any] | None


def _adoptable(candidates: Sequence[_SetAside]) -> dict[int, str]:
    """Of samples set aside, the meter id each one that may be adopted is stored under, by
    id, as `ingest` would have stored it had the inventory known then what it knows now: a
    device carrying its identity, if its sender may send for that device (`why_misplaced`);
    else, for a dynamic MIG device's sample, the partition at its placement on the node the
    sample records, in its token's cluster (`placed_mig_samples`). Adoption trusts nothing
    ingest would not."""
    tokens = AgentToken.objects.select_related("cluster").in_bulk(
        {row.agent_token_id for row in candidates if row.agent_token_id is not None}
    )
    places = device_places({row.device_uuid for row in candidates})
    adopted: dict[int, str] = {}
    placed: dict[tuple[str, int | None], list[tuple[int, MigPlacement, int]]] = defaultdict(list)
    for row in candidates:
        token = None if row.agent_token_id is None else tokens[row.agent_token_id]
        if row.device_uuid in places:
            if token is None or not why_misplaced(places[row.device_uuid], token):
                adopted[row.id] = row.device_uuid
        elif row.mig_placement is not None:
            cluster_id = None if token is None else token.cluster_id
            placed[row.node, cluster_id].append(
                (row.id, MigPlacement(**row.mig_placement), row.ts_ms)
            )
    for (node, cluster_id), rows in placed.items():
        found = partitions_at(
            {placement for _, placement, _ in rows},
            node=node,
            cluster_id=cluster_id,
            since_ms=min(ts_ms for _, _, ts_ms in rows),
        )
        for row_id, placement, ts_ms in rows:
            timeline = found.get(placement)
            meter_id = timeline.meter_id_at(ts_ms) if timeline is not None else None
            if meter_id is not None:
                adopted[row_id] = meter_id
    return adopted


def _adopted_instances(
    candidates: Sequence[_SetAside], meter_ids: dict[int, str]
) -> list[InstanceSample]:
    """The GPU instances of the adopted samples (`meter_ids`, by id) that carry one, as
    `ingest` records them: under the meter id adopted, from their token's cluster (None: an
    operator's) and the node that sent them. Adopted or already stored (a twin sent again
    once the device was known), the instant was seen."""
    with_instance = [
        row for row in candidates if row.id in meter_ids and row.gpu_instance is not None
    ]
    clusters = dict(
        AgentToken.objects.filter(pk__in={row.agent_token_id for row in with_instance}).values_list(
            "pk", "cluster_id"
        )
    )
    return [
        InstanceSample(
            meter_ids[row.id],
            row.ts_ms,
            GpuInstance(**row.gpu_instance),
            None if row.agent_token_id is None else clusters[row.agent_token_id],
            row.node,
        )
        for row in with_instance
        if row.gpu_instance is not None
    ]


# DCGM samples named by their GPU instance, set aside, that a spell of their GPU instance on
# their node may cover now (of any cluster: `place_keyed` tells), from id `after` on: one index
# range of the GPU's spells per sample. The cluster each is of (null: an operator's, any).
_COVERED_ASIDE_SQL = f"""
SELECT u.id, u.device_uuid, u.ts_ms, u.node, u.gpu_instance ->> 'parent_uuid',
       (u.gpu_instance ->> 'gpu_instance_id')::integer, COALESCE(t.cluster_id, u.cluster_id)
FROM {table_name(UnknownDeviceSample)} AS u
LEFT JOIN {table_name(AgentToken)} AS t ON t.id = u.agent_token_id
WHERE u.id > %(after)s AND u.gpu_instance IS NOT NULL AND u.device_uuid LIKE '%%::gi%%'
  AND EXISTS (
      SELECT FROM {MigInstance._meta.db_table} AS m
      WHERE m.parent_uuid = u.gpu_instance ->> 'parent_uuid' AND m.last_ms >= u.ts_ms - %(hold)s
        AND m.first_ms <= u.ts_ms AND m.node = u.node
        AND m.gpu_instance_id = (u.gpu_instance ->> 'gpu_instance_id')::integer
  )
ORDER BY u.id LIMIT %(chunk)s
"""


def _place_set_aside(*, now: datetime) -> int:
    """Place the DCGM samples named by their GPU instance that are set aside though a spell
    covers their instant now, as `ingest` would place them arriving now; how many. Those set
    aside before their GPU instance's span was recorded (`DcgmInstance`: before migration
    0013) are found by no change of the spells, so adoption looks for them; their span is
    recorded, so a later change finds them. Read without locks: under the GPU instances'
    locks, a sample another writer moved meanwhile is no longer there to move. Each chunk is
    its own transaction."""
    placed = 0
    after = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                _COVERED_ASIDE_SQL, {"after": after, "hold": sample_hold_ms(), "chunk": ADOPT_CHUNK}
            )
            rows = cursor.fetchall()
            if not rows:
                return placed
            after = rows[-1][0]
            aside = [
                Held(InstanceKey(cluster_id or 0, node, parent, instance), row_id, ts_ms, "",
                      cluster_id is None)
                for row_id, uuid, ts_ms, node, parent, instance, cluster_id in rows
                if uuid == instance_key(GpuInstance(parent, instance))
            ]  # fmt: skip
            if not aside:
                continue
            lock_instances(cursor, {one.key.instance for one in aside})
            placements = place_keyed(cursor, {}, [], aside=aside)
            lock_devices(cursor, placements.devices)
            _, shifted = placements.store(cursor, node="", received_at=now)
            spans: dict[tuple[str, str, int], tuple[int, int]] = {}
            for one in aside:
                first, last = spans.get(one.key.instance, (one.ts_ms, one.ts_ms))
                spans[one.key.instance] = (min(first, one.ts_ms), max(last, one.ts_ms))
            cursor.execute(
                WIDEN_SQL, [json.dumps([[*instance, *span] for instance, span in spans.items()])]
            )
            mark_dirty(hours=touched_hours(shifted), at=now)
            placed += len(placements.moves)


def adopt_unknown_samples(*, now: datetime) -> int:
    """Move the samples set aside whose device has become known into `Sample`; how many.

    A sample is adopted only where `ingest` would have stored it had the device been known
    when it came (`_adoptable`): one an agent token sent, only for a device where that token
    may send (a node's token: a device on its node, the node the sample records; a
    cluster-wide token: one of its cluster); one an operator loaded (no token), for any
    device. A token cannot plant samples under the identity of a device elsewhere by naming
    it before the inventory knows it. A dynamic MIG device's sample is adopted by the
    partition at its placement, once the sync has published it, as `ingest` would have
    matched it. An adopted sample's GPU instance is recorded as `ingest` records it, and
    DCGM's samples named by that GPU instance are placed again where its spells changed (those
    are never adopted here: no device carries their name); and DCGM's samples set aside that a
    spell covers now are placed (`_place_set_aside`). The others stay aside until they expire
    (`metering.retention.purge_unknown_device_samples`).

    A sample already in `Sample` for the same device and instant wins; the one set aside is
    dropped. An adopted mean keeps its covered time. Hours the moved samples count in are
    marked dirty. Each chunk is its own transaction; rows another run holds are skipped, not
    waited for.
    """
    known = Exists(Device.objects.filter(meter_id=OuterRef("device_uuid"))) | Exists(
        Device.objects.filter(meter_id="", uuid=OuterRef("device_uuid"))
    )
    # Those of a GPU with partitions published on their node: `_adoptable` matches them.
    on_partitioned_gpu = Exists(
        Device.objects.filter(
            kind=DeviceKind.MIG,
            uuid="",
            parent_uuid=OuterRef("placed_on"),
            node__name=OuterRef("node"),
        ).exclude(meter_id="")
    )
    moved = 0
    after = 0  # the rows up to this id were seen: those not adoptable are not looked at again
    while True:
        with transaction.atomic():
            candidates = [
                _SetAside(*row)
                for row in UnknownDeviceSample.objects.filter(id__gt=after)
                .annotate(placed_on=KT("mig_placement__parent_uuid"))
                .filter(known | on_partitioned_gpu)
                .select_for_update(skip_locked=True)
                .order_by("id")
                .values_list(
                    "id",
                    "device_uuid",
                    "agent_token_id",
                    "node",
                    "ts_ms",
                    "mig_placement",
                    "gpu_instance",
                )[:ADOPT_CHUNK]
            ]
            if not candidates:
                return moved + _place_set_aside(now=now)
            after = candidates[-1].id
            meter_ids = _adoptable(candidates)
            if not meter_ids:
                continue
            # The samples set aside, each with the meter id it is adopted under.
            adopted = (
                f"{table_name(UnknownDeviceSample)} JOIN ({json_rows('bigint', 'text')}) "
                "AS adopted(id, meter_id) USING (id)"
            )
            params = [json.dumps(list(meter_ids.items()))]
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT meter_id, MIN(ts_ms), MAX(ts_ms) FROM {adopted} GROUP BY meter_id",
                    params,
                )
                bounds = {uuid: Bounds(first, last) for uuid, first, last in cursor.fetchall()}
                # The GPU instances' locks before the devices' (as `ingest`): the spells the
                # adopted samples record may move DCGM's samples to other devices.
                points = instance_points(_adopted_instances(candidates, meter_ids))
                placements = Placements()
                if points:
                    lock_instances(cursor, {key.instance for key in points})
                    placements = place_keyed(cursor, record_instances(cursor, points), [])
                lock_devices(cursor, bounds.keys() | placements.devices)
                thaw_samples(cursor, bounds)  # compacted samples among them (`metering.blocks`)
                stored, instants = insert_new(
                    cursor,
                    Sample,
                    # Named as the column it fills, so that rows are kept in its order.
                    select="meter_id AS device_uuid, ts_ms, gpu_util, mem_used_bytes, "
                    "processes, node, received_at, covered_ms",
                    source=adopted,
                    where="true",
                    params=params,
                    first="id",
                    columns=f"{COLUMNS}, covered_ms",
                )
                if stored:
                    refresh_gaps(cursor, bounds)
                _, shifted = placements.store(cursor, node="", received_at=now)
            UnknownDeviceSample.objects.filter(id__in=meter_ids).delete()
            mark_dirty(hours=touched_hours(instants + shifted), at=now)
            moved += stored
