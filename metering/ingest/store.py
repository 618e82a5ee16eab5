"""Storage: a batch written into `billing_sample` (a binary COPY, or the general way when it
meets stored samples), samples of devices the inventory does not know set aside, and where
the inventory puts the devices samples name.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from operator import itemgetter
from typing import Any, NamedTuple

from django.db import connection, models, transaction
from django.db.backends.utils import CursorWrapper
from psycopg.errors import UniqueViolation

from db.copy import copy_rows
from inventory.models import Device, Node
from metering.blocks import thaw_samples
from metering.hours import MS_PER_HOUR
from metering.ingest.gaps import (
    batch_gaps,
    find_neighbours,
    latest_per_hour,
    lock_and_find_neighbours,
    lock_devices,
    refresh_gaps,
    set_previous_gaps,
)
from metering.ingest.rows import BATCH_TABLE, COLUMNS, ROW_COLUMNS, UNIQUE_SET_ASIDE, SampleRow
from metering.mig_samples import GpuInstance, MigPlacement
from metering.models import AgentToken, Sample, UnknownDeviceSample


def table_name(model: type[models.Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def insert_new(
    cursor: CursorWrapper,
    target: type[models.Model],
    *,
    select: str,
    source: str,
    where: str,
    params: Sequence[Any],
    first: str,
    columns: str = COLUMNS,
) -> tuple[int, list[int]]:
    """`INSERT INTO target SELECT ...` skipping rows already stored; of rows of the same
    device and instant in `source`, the one that sorts first by `first` is kept (for samples
    set aside: of the same device, instant, sending node and cluster, `UNIQUE_SET_ASIDE`);
    a DCGM sample the spells placed gives way to the device's own (`_own_sample_wins`).

    Returns how many rows were inserted, and instants whose `touched_hours` are those of all
    inserted rows: the latest per hour, so a large batch sends back a row per hour, not per
    row.
    """
    if target is UnknownDeviceSample:
        distinct, conflict = "", f"ON CONFLICT ({UNIQUE_SET_ASIDE}) DO NOTHING"
    else:
        # One per device and instant: an update may not meet a row the statement wrote.
        distinct, conflict = "DISTINCT ON (device_uuid, ts_ms) ", _own_sample_wins(columns)
    # Key order: two writers of overlapping batches then wait on each other, never deadlock.
    cursor.execute(
        f"WITH inserted AS (INSERT INTO {table_name(target)} AS s ({columns}) "
        f"SELECT {distinct}{select} "
        f"FROM {source} WHERE {where} ORDER BY device_uuid, ts_ms, {first} "
        f"{conflict} RETURNING ts_ms) "
        f"SELECT count(*), max(ts_ms) FROM inserted GROUP BY floor(ts_ms / {MS_PER_HOUR}.0)",
        params,
    )
    per_hour = cursor.fetchall()
    return sum(count for count, _ in per_hour), [latest for _, latest in per_hour]


def _own_sample_wins(columns: str) -> str:
    """The conflict clause of a device's own samples stored in `billing_sample` (`columns`):
    one already there at the instant is kept, but for a DCGM sample the spells placed there
    (`placed_gpu_instance`), which gives way, so the device's own sample holds the instant
    whichever came first (the spells are made of own samples only). The DCGM reading's
    utilisation and memory stay where the own sample has none (NVML measures no utilisation
    on a MIG device), as `_PLACE_SQL` merges them arriving second: the same row either way."""
    sets = []
    for column in columns.split(", "):
        if column in ("gpu_util", "mem_used_bytes"):
            sets.append(f"{column} = COALESCE(excluded.{column}, s.{column})")
        elif column == "covered_ms":
            # A mean's covered time goes with the utilisation kept.
            sets.append(
                "covered_ms = CASE WHEN excluded.gpu_util IS NULL THEN s.covered_ms "
                "ELSE excluded.covered_ms END"
            )
        elif column not in ("device_uuid", "ts_ms"):
            sets.append(f"{column} = excluded.{column}")
    sets.append("placed_gpu_instance = NULL")
    return (
        f"ON CONFLICT (device_uuid, ts_ms) DO UPDATE SET {', '.join(sets)} "
        "WHERE s.placed_gpu_instance IS NOT NULL"
    )


# The column types of `ROW_COLUMNS`, for a binary COPY (`processes` is the JSON text
# `check_sample` made).
_ROW_TYPES = ("text", "int8", "float8", "int8", "jsonb", "int8")
_STORED = len(_ROW_TYPES)  # the fields of a `SampleRow` that are stored


_KEY = itemgetter(0, 1)  # device_uuid, ts_ms


def store_batch(
    cursor: CursorWrapper,
    target: type[models.Model],
    rows: Sequence[SampleRow],
    *,
    node: str,
    received_at: datetime,
    gaps: Sequence[int | None] | None = None,
    agent: AgentToken | None = None,
) -> tuple[int, list[int]]:
    """Store `rows` in `target` unless already there, the general way: into a temporary
    table, then `INSERT ... SELECT ... ON CONFLICT DO NOTHING`. As `insert_new`, the first of
    rows of the same device and instant is kept. `gaps` (one per row) go to `gap_ms`, `agent`
    (samples set aside) to `agent_token`; a sample set aside keeps its placement
    (`mig_placement`), by which it may be adopted, and its GPU instance (`gpu_instance`).
    """
    if not rows:
        return 0, []
    columns = f"{COLUMNS}, covered_ms"
    select = "device_uuid, ts_ms, gpu_util, mem_used_bytes, processes, %s, %s, covered_ms"
    params: list[Any] = [node, received_at]
    if agent is not None:
        # Set aside, a token's sample is of its cluster (`UNIQUE_SET_ASIDE`).
        cluster = ", cluster_id" if target is UnknownDeviceSample else ""
        columns = f"{columns}, agent_token_id{cluster}"
        select = f"{select}, %s{', %s' if cluster else ''}"
        params.extend([agent.pk, agent.cluster_id] if cluster else [agent.pk])
    copied = f"{ROW_COLUMNS}, position"  # the temporary table's columns the batch fills
    types: tuple[str, ...] = (*_ROW_TYPES, "int4")
    batch: Iterable[tuple[Any, ...]] = (
        (*row[:_STORED], position) for position, row in enumerate(rows)
    )
    if gaps is not None:
        columns, select = f"{columns}, gap_ms", f"{select}, gap_ms"
        copied, types = f"{copied}, gap_ms", (*types, "int8")
        batch = (
            (*row[:_STORED], position, gap)
            for position, (row, gap) in enumerate(zip(rows, gaps, strict=True))
        )
    elif target is UnknownDeviceSample:
        mig = "mig_placement, gpu_instance"
        columns, select, copied = f"{columns}, {mig}", f"{select}, {mig}", f"{copied}, {mig}"
        types = (*types, "jsonb", "jsonb")
        batch = (
            (*row[:_STORED], position, fields_json(row.placement), fields_json(row.instance))
            for position, row in enumerate(rows)
        )
    # The DELETE empties what an outer transaction's earlier `ingest` left.
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {BATCH_TABLE} (device_uuid text, ts_ms bigint, "
        "gpu_util double precision, mem_used_bytes bigint, processes jsonb, covered_ms bigint, "
        "position int, gap_ms bigint, mig_placement jsonb, gpu_instance jsonb) "
        "ON COMMIT DELETE ROWS; "
        f"DELETE FROM {BATCH_TABLE}"
    )
    copy_rows(cursor, f"{BATCH_TABLE} ({copied})", batch, types)
    return insert_new(
        cursor,
        target,
        select=select,
        source=BATCH_TABLE,
        where="true",
        params=params,
        first="position",
        columns=columns,
    )


def fields_json(fields: MigPlacement | GpuInstance | None) -> str | None:
    """A sample's placement or GPU instance as a sample set aside keeps it
    (`UnknownDeviceSample.mig_placement`, `.gpu_instance`: the fields by name, read back with
    `MigPlacement(**fields)`, `GpuInstance(**fields)`), or None."""
    return None if fields is None else json.dumps(fields._asdict())


def store_samples(
    cursor: CursorWrapper,
    rows: Sequence[SampleRow],
    *,
    node: str,
    received_at: datetime,
    also_lock: Iterable[str] = (),
) -> tuple[int, list[int]]:
    """Store samples of known devices unless already there, with their gaps.

    The devices are locked first (with `also_lock`, the other devices the transaction will
    write samples of: all in one round, in key order), so their gaps are worked out against
    every sample stored before. A batch that repeats nothing and falls after (or between) what is
    stored, the usual case, is COPYed straight into `billing_sample` with its gaps, then the
    gap of each device's sample just before it is set (`set_previous_gaps`); the COPY runs
    under a savepoint, and should it meet a stored sample after all it is undone. Otherwise the
    batch takes the general way (`store_batch`), then its devices' gaps are worked out again
    over its span.
    """
    also_lock = set(also_lock)
    if not rows:
        if also_lock:
            lock_devices(cursor, also_lock)
        return 0, []
    ordered = sorted(rows, key=_KEY)
    gaps, bounds, repeats = batch_gaps(ordered)
    # Compacted samples the batch falls among go back into `billing_sample` first, under the
    # devices' locks (`metering.blocks`); a batch of the last days (the usual one) skips it
    # without a query.
    if repeats:
        lock_devices(cursor, bounds.keys() | also_lock)
        thaw_samples(cursor, bounds)
    else:
        neighbours = lock_and_find_neighbours(cursor, bounds, also_lock=also_lock)
        if thaw_samples(cursor, bounds):
            neighbours = find_neighbours(cursor, bounds)  # among the thawed ones now
        if all(
            found.after_ms is None or found.after_ms > bounds[uuid].last_ms
            for uuid, found in neighbours.items()
        ):
            for index, (row, gap) in enumerate(zip(ordered, gaps, strict=True)):
                if gap is None:
                    after = neighbours[row[0]].after_ms
                    if after is not None:
                        gaps[index] = after - row[1]
            tail = (node, received_at)
            try:
                with transaction.atomic():
                    copy_rows(
                        cursor,
                        f"{table_name(Sample)} ({ROW_COLUMNS}, node, received_at, gap_ms)",
                        # Made as written, not held: thousands of live tuples would wake the
                        # garbage collector, over and over, to walk everything the batch holds.
                        (
                            row[:_STORED] + tail + (gap,)
                            for row, gap in zip(ordered, gaps, strict=True)
                        ),
                        (*_ROW_TYPES, "text", "timestamptz", "int8"),
                    )
            except UniqueViolation:
                pass
            else:
                set_previous_gaps(cursor, bounds, neighbours)
                return len(rows), latest_per_hour(row[1] for row in rows)
    stored, instants = store_batch(
        cursor, Sample, ordered, node=node, received_at=received_at, gaps=gaps
    )
    if stored:
        refresh_gaps(cursor, bounds)
    return stored, instants


class Place(NamedTuple):
    """Where the inventory puts a device: its cluster and node (None: on no node), and the
    GPU it is part of (a MIG device's or partition's `parent_uuid`; "" for none)."""

    cluster_id: int
    node: str | None
    parent: str = ""


# The devices samples name by their ids: by meter id (`Device.meter_id`: a NVIDIA device's
# UUID, a formed identity for one without); a device imported before meter ids were formed
# (meter id empty) by its UUID. Written once rather than built by the ORM for every batch.
_PLACES_SQL = f"""
SELECT d.meter_id, d.uuid, d.cluster_id, n.name, d.parent_uuid, d.gone_at
FROM {Device._meta.db_table} AS d LEFT JOIN {Node._meta.db_table} AS n ON n.id = d.node_id
WHERE d.meter_id = ANY(%s) OR (d.meter_id = '' AND d.uuid = ANY(%s))
"""


def device_places(uuids: set[str]) -> dict[str, set[Place]]:
    """Where the devices carrying `uuids` are, per UUID the inventory knows: the present
    devices' places if any carries it, else the gone ones'. A MIG device published without a
    node of its own is where its parent GPU is."""
    ids = sorted(uuids)
    with connection.cursor() as cursor:
        cursor.execute(_PLACES_SQL, [ids, ids])
        rows = [
            (meter_id or uuid, cluster_id, node, parent, gone_at)
            for meter_id, uuid, cluster_id, node, parent, gone_at in cursor.fetchall()
        ]
    orphans = {parent for _, _, node, parent, _ in rows if node is None and parent}
    parents: dict[tuple[str, int], str] = {}
    if orphans:
        parents = {
            (uuid, cluster_id): node
            for uuid, cluster_id, node in Device.objects.filter(
                uuid__in=orphans, node__isnull=False
            )
            .order_by("gone_at")  # a present parent (null sorts last) wins
            .values_list("uuid", "cluster_id", "node__name")
        }
    present: dict[str, set[Place]] = defaultdict(set)
    gone: dict[str, set[Place]] = defaultdict(set)
    for uuid, cluster_id, node, parent, gone_at in rows:
        if node is None and parent:
            node = parents.get((parent, cluster_id))
        (present if gone_at is None else gone)[uuid].add(Place(cluster_id, node, parent or ""))
    return {uuid: present.get(uuid) or gone[uuid] for uuid in present.keys() | gone.keys()}


def inventory_nodes(uuids: set[str]) -> dict[str, set[str]]:
    """The nodes the inventory puts the devices carrying `uuids` on (a MIG device: its GPU's),
    per UUID it knows; an empty set for a device on no node."""
    return {
        uuid: {place.node for place in places if place.node}
        for uuid, places in device_places(uuids).items()
    }


def why_misplaced(places: set[Place], agent: AgentToken) -> str:
    """Why `agent` may not send samples of a device at `places`; "" when it may: the device
    is on the token's node (a cluster-wide token's: any device of its cluster)."""
    mine = [place for place in places if place.cluster_id == agent.cluster_id]
    if agent.node == "*" and mine:
        return ""
    if any(place.node == agent.node for place in mine):
        return ""
    if not mine:
        return f"is in another cluster than this token's ({agent.cluster})"
    nodes = sorted(place.node for place in mine if place.node)
    where = f"on node {nodes[0]!r}" if nodes else "on no node (only a cluster-wide token's)"
    return f"is {where}, not on this token's node {agent.node!r}"
