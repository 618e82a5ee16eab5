"""MIG placement: the GPU instances of stored MIG samples recorded as spells
(`metering.mig_instances`), and DCGM's samples named `<parent UUID>::gi<N>` stored under the
device their GPU instance was at their instant, set aside while no spell says, and moved
where the spells change, whatever order DCGM's and NVML's batches come in.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from django.db.backends.utils import CursorWrapper

from db.copy import json_rows
from metering.blocks import thaw_samples
from metering.hours import sample_hold_ms
from metering.ingest.gaps import Bounds, latest_per_hour, refresh_gaps
from metering.ingest.rows import COLUMNS, UNIQUE_SET_ASIDE, SampleRow
from metering.ingest.store import Place, device_places, fields_json
from metering.ingest.validation import instance_key
from metering.mig_instances import (
    InstanceKey,
    Point,
    Respelled,
    covering,
    covering_any,
    spells_covering,
    spells_of_any_cluster,
)
from metering.mig_samples import GpuInstance, partitions_at
from metering.models import AgentToken, DcgmInstance, Sample, UnknownDeviceSample


class InstanceSample(NamedTuple):
    """A stored MIG sample's GPU instance, to be recorded (`metering.mig_instances`): the device
    it was stored under, when, and who sent it: the agent token's cluster (None: an operator's
    backfill) and the node it sent for."""

    meter_id: str
    ts_ms: int
    instance: GpuInstance
    cluster_id: int | None
    node: str


def _instance_place(
    places: set[Place], *, cluster_id: int | None, node: str
) -> tuple[int, str] | None:
    """Where a MIG device's GPU instance is recorded: the cluster and node the inventory puts
    the device on (a MIG device without a node: its GPU's; none: ""), in the sender's cluster
    (any, for a backfill), so that an agent's, a backfill's and an adopted sample of one GPU
    instance are one GPU instance's, whatever node the sender named. Where the inventory has
    it on several, the sender's node among them; None where that does not settle it."""
    where = {
        (place.cluster_id, place.node or "")
        for place in places
        if cluster_id is None or place.cluster_id == cluster_id
    }
    if len(where) > 1:
        where = {place for place in where if place[1] == node}
    return where.pop() if len(where) == 1 else None


def instance_points(
    samples: Sequence[InstanceSample], *, places: dict[str, set[Place]] | None = None
) -> dict[InstanceKey, set[Point]]:
    """What to record (`record_instances`) of the GPU instances of stored MIG samples, per
    device they were stored under (a dynamic MIG device's: its partition), duplicates included
    (the instant was seen either way), at the device's place (`_instance_place`; `places`
    those known already). A device the inventory cannot place records nothing, nor a sample
    naming another GPU than the device's own: DCGM's series of that GPU's instance would be
    given to the device (another cluster's GPU, named by a token of this one)."""
    if not samples:
        return {}
    places = places or {}
    missing = {sample.meter_id for sample in samples} - places.keys()
    if missing:
        places = {**places, **device_places(missing)}
    points: dict[InstanceKey, set[Point]] = defaultdict(set)
    where: dict[tuple[str, int | None, str], tuple[int, str] | None] = {}
    for sample in samples:
        sender = (sample.meter_id, sample.cluster_id, sample.node)
        if sender not in where:
            where[sender] = _instance_place(
                places.get(sample.meter_id, set()), cluster_id=sample.cluster_id, node=sample.node
            )
        place = where[sender]
        parents = {known.parent for known in places.get(sample.meter_id, set())}
        if place is not None and sample.instance.parent_uuid in parents:
            key = InstanceKey(*place, *sample.instance)
            points[key].add(Point(sample.ts_ms, sample.meter_id))
    return points


# DCGM's samples named by their GPU instance

# The placement of an agent's DCGM samples of MIG devices it could not tell, named
# `<parent UUID>::gi<N>` (`agent.dcgm`): each is stored in `billing_sample` under the device
# that GPU instance was at its instant, by the spells the NVML agents' samples record
# (`metering.mig_instances.covering`, the Prometheus source's rule), and kept aside while no
# spell says (`UnknownDeviceSample`). Where the spells change (a late batch, an id reused A,
# B, A whose B comes last), the samples whose device changed are moved: out of `billing_sample`
# or out of the aside, to their new device or aside. So what is stored is what all the
# samples give at once, whatever order the DCGM and NVML batches came in (the spells are).


def is_keyed(row: SampleRow) -> bool:
    """Whether `row` is a DCGM sample named by its GPU instance (`<parent UUID>::gi<N>`)."""
    return (
        row.instance is not None
        and "::gi" in row.device_uuid
        and row.device_uuid == instance_key(row.instance)
    )


class _Keyed(NamedTuple):
    """A DCGM sample named by its GPU instance, arriving: its position in the batch, the
    sample, and its GPU instance; `anywhere`: an operator's, of no cluster, placed by the one
    cluster whose spells cover its instant (`key.cluster_id` is then no cluster's)."""

    position: int
    row: SampleRow
    key: InstanceKey
    anywhere: bool


def keyed_samples(
    keyed: Sequence[tuple[int, SampleRow]], *, node: str, cluster_id: int | None
) -> list[_Keyed]:
    """The GPU instance of each DCGM sample named by one, sent for `node`: in the token's
    cluster (`cluster_id`), never another's, so that a token places nothing on another
    cluster's devices; an operator's (None), in whichever cluster's spells cover its instant
    (a node that moved clusters is each cluster's in its own time)."""
    found: list[_Keyed] = []
    for position, row in keyed:
        assert row.instance is not None  # `is_keyed`
        key = InstanceKey(cluster_id or 0, node, *row.instance)
        found.append(_Keyed(position, row, key, cluster_id is None))
    return found


class Held(NamedTuple):
    """A DCGM sample named by its GPU instance that is stored (`device` its meter id) or set
    aside (`device` ""), where its GPU instance's spells changed."""

    key: InstanceKey
    row_id: int
    ts_ms: int
    device: str
    # Set aside without a token or cluster (an operator's): placed as `_Keyed.anywhere`.
    anywhere: bool = False


class _Move(NamedTuple):
    """A DCGM sample to move from where it is (`held`) to `device` ("": aside)."""

    held: Held
    device: str


@dataclass
class Placements:
    """What a transaction does with DCGM's samples named by their GPU instance: those it
    moves (`moves`), and where the arriving ones go (`arriving`: with the device, or "" for
    aside, where `unplaced` lists them for `ingest` to set aside as unknown devices')."""

    moves: list[_Move] = field(default_factory=list)
    arriving: list[tuple[_Keyed, str]] = field(default_factory=list)

    @property
    def unplaced(self) -> list[tuple[int, SampleRow]]:
        return [(keyed.position, keyed.row) for keyed, device in self.arriving if not device]

    @property
    def devices(self) -> set[str]:
        """The devices whose samples this moves or adds: locked with the batch's."""
        found = {device for _, device in self.arriving if device}
        for move in self.moves:
            found |= {move.held.device, move.device}
        return found - {""}

    def store(
        self, cursor: CursorWrapper, *, node: str, received_at: datetime
    ) -> tuple[int, list[int]]:
        """Move the samples and store the arriving ones placed, under the devices' locks
        (taken with the batch's, `store_samples`). A device already holding a sample at that
        instant keeps it, its own taking the DCGM reading's utilisation where it has none
        (`_PLACE_SQL`); otherwise the DCGM one is dropped as a duplicate. Returns how many arriving
        ones were stored, and instants whose `touched_hours` are those of every sample moved
        or stored."""
        if not self.moves and not any(device for _, device in self.arriving):
            return 0, []
        rows = _take_held(cursor, [move.held for move in self.moves])
        placed: list[list[Any]] = []
        aside: list[list[Any]] = []
        for move in self.moves:
            taken = rows.get((move.held.device, move.held.row_id))
            if taken is None:
                continue
            key = move.held.key
            if move.device:
                placed.append([move.device, move.held.ts_ms, *taken, key.gpu_instance_id])
            else:
                # Without its token (a stored sample keeps none), in the cluster it was placed
                # in; received now, so that it waits its retention from the move, as one
                # arriving now would (`metering.retention`).
                gpu = GpuInstance(key.parent_uuid, key.gpu_instance_id)
                kept = [*taken[:4], received_at.isoformat(), *taken[5:]]
                aside.append(
                    [instance_key(gpu), move.held.ts_ms, *kept, fields_json(gpu), key.cluster_id]
                )
        arriving = [
            [
                device,
                keyed.row.ts_ms,
                keyed.row.gpu_util,
                keyed.row.mem_used_bytes,
                keyed.row.processes,
                node,
                received_at.isoformat(),
                keyed.row.covered_ms,
                keyed.row.instance.gpu_instance_id if keyed.row.instance else None,
            ]
            for keyed, device in self.arriving
            if device
        ]
        stored = _insert_placed(cursor, placed + arriving)
        if aside:
            cursor.execute(_SET_ASIDE_AGAIN_SQL, [json.dumps(aside)])
        accepted = len(stored & {(row[0], row[1]) for row in arriving})
        instants = [
            move.held.ts_ms for move in self.moves if (move.held.device, move.held.row_id) in rows
        ]
        instants.extend(ts_ms for _, ts_ms in stored)
        touched: dict[str, list[int]] = defaultdict(list)
        for move in self.moves:
            if move.held.device:
                touched[move.held.device].append(move.held.ts_ms)
        for device, ts_ms in stored:
            touched[device].append(ts_ms)
        refresh_gaps(cursor, {device: Bounds(min(at), max(at)) for device, at in touched.items()})
        return accepted, latest_per_hour(instants)


# The DCGM samples of each GPU instance and stretch [lo, hi] where its spells changed, stored
# under one of the devices it was there before (`m`) or set aside: an aside one of its
# cluster's token, or set aside without a token in its cluster, or an operator's of any. Each
# a subquery per stretch (and device): its index range, never a table hashed.
_HELD_SQL = f"""
WITH w(i, cluster_id, node, gpu_instance_id, key, lo, hi) AS MATERIALIZED (
    {json_rows("bigint", "bigint", "text", "integer", "text", "bigint", "bigint",
               placeholder="%(stretches)s")}
),
m(i, meter_id) AS MATERIALIZED ({json_rows("bigint", "text", placeholder="%(meters)s")})
SELECT w.i, s.id, s.ts_ms, s.device_uuid, false
FROM w JOIN m USING (i) CROSS JOIN LATERAL (
    SELECT id, ts_ms, device_uuid FROM {Sample._meta.db_table}
    WHERE device_uuid = m.meter_id AND ts_ms BETWEEN w.lo AND w.hi
      AND placed_gpu_instance = w.gpu_instance_id AND node = w.node
    OFFSET 0
) AS s
UNION ALL
SELECT w.i, u.id, u.ts_ms, '', t.cluster_id IS NULL AND u.cluster_id IS NULL
FROM w CROSS JOIN LATERAL (
    SELECT id, ts_ms, agent_token_id, cluster_id FROM {UnknownDeviceSample._meta.db_table}
    WHERE device_uuid = w.key AND node = w.node AND ts_ms BETWEEN w.lo AND w.hi
    OFFSET 0
) AS u
LEFT JOIN {AgentToken._meta.db_table} AS t ON t.id = u.agent_token_id
WHERE COALESCE(t.cluster_id, u.cluster_id, w.cluster_id) = w.cluster_id
"""  # fmt: skip
# What a moved sample keeps, in the order `Placements.store` writes them.
_KEPT = "gpu_util, mem_used_bytes, processes::text, node, received_at, covered_ms"
_TAKE_STORED_SQL = f"""
DELETE FROM {Sample._meta.db_table} AS s
USING ({json_rows("bigint", "bigint")}) AS m(id, ts_ms)
WHERE s.id = m.id AND s.ts_ms = m.ts_ms
RETURNING s.device_uuid, s.id, {", ".join(f"s.{column}" for column in _KEPT.split(", "))}
"""
_TAKE_ASIDE_SQL = f"""
DELETE FROM {UnknownDeviceSample._meta.db_table} AS u
WHERE u.id = ANY(%s)
RETURNING '', u.id, {", ".join(f"u.{column}" for column in _KEPT.split(", "))}
"""
# A device's own sample at that instant keeps it, taking the DCGM reading's utilisation and
# memory where it has none, as `_own_sample_wins` does the other way round; a DCGM sample
# placed there first keeps it.
_PLACE_SQL = f"""
INSERT INTO {Sample._meta.db_table} AS s
    ({COLUMNS}, covered_ms, placed_gpu_instance)
SELECT DISTINCT ON (1, 2) * FROM ({json_rows("text", "bigint", "double precision", "bigint",
                                             "jsonb", "text", "timestamptz", "bigint",
                                             "integer")}) AS placed
ORDER BY 1, 2
ON CONFLICT (device_uuid, ts_ms) DO UPDATE
SET gpu_util = COALESCE(s.gpu_util, excluded.gpu_util),
    covered_ms = CASE WHEN s.gpu_util IS NULL THEN excluded.covered_ms ELSE s.covered_ms END,
    mem_used_bytes = COALESCE(s.mem_used_bytes, excluded.mem_used_bytes)
WHERE s.placed_gpu_instance IS NULL
  AND (s.gpu_util IS NULL AND excluded.gpu_util IS NOT NULL
       OR s.mem_used_bytes IS NULL AND excluded.mem_used_bytes IS NOT NULL)
RETURNING device_uuid, ts_ms
"""  # fmt: skip
_SET_ASIDE_AGAIN_SQL = f"""
INSERT INTO {UnknownDeviceSample._meta.db_table}
    ({COLUMNS}, covered_ms, gpu_instance, cluster_id)
SELECT * FROM ({json_rows("text", "bigint", "double precision", "bigint", "jsonb", "text",
                          "timestamptz", "bigint", "jsonb", "bigint")}) AS aside
ORDER BY 1, 2
ON CONFLICT ({UNIQUE_SET_ASIDE}) DO NOTHING
"""  # fmt: skip


def _take_held(cursor: CursorWrapper, held: Sequence[Held]) -> dict[tuple[str, int], list[Any]]:
    """Delete the samples `held` from where they are; what each keeps (`_KEPT`, JSON-ready),
    by (device, id) as held."""
    taken: dict[tuple[str, int], list[Any]] = {}
    stored = [[one.row_id, one.ts_ms] for one in held if one.device]
    aside = [one.row_id for one in held if not one.device]
    if stored:
        cursor.execute(_TAKE_STORED_SQL, [json.dumps(stored)])
        rows = cursor.fetchall()
    else:
        rows = []
    if aside:
        cursor.execute(_TAKE_ASIDE_SQL, [aside])
        rows += cursor.fetchall()
    for device, row_id, *kept in rows:
        kept[4] = kept[4].isoformat()  # received_at
        taken[device, row_id] = kept
    return taken


def _insert_placed(cursor: CursorWrapper, rows: list[list[Any]]) -> set[tuple[str, int]]:
    """Store DCGM samples under the devices their spells give (rows as `_PLACE_SQL` takes
    them) unless that device has a sample at that instant; the (device, instant) stored."""
    if not rows:
        return set()
    # A device's compacted samples about these instants back in `billing_sample` first, so
    # that one at the same instant is found (`metering.blocks`).
    spans: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        spans[row[0]].append(row[1])
    thaw_samples(cursor, {device: (min(at), max(at)) for device, at in spans.items()})
    cursor.execute(_PLACE_SQL, [json.dumps(rows)])
    return {(device, ts_ms) for device, ts_ms in cursor.fetchall()}


def place_keyed(
    cursor: CursorWrapper,
    respelled: dict[InstanceKey, Respelled],
    arriving: Sequence[_Keyed],
    *,
    aside: Sequence[Held] = (),
) -> Placements:
    """Where DCGM's samples named by their GPU instance go, under the GPU instances' locks and
    after their spells were recorded: the arriving ones, those held (stored or aside) where
    the spells changed (`respelled`), and `aside` (set aside, looked at again), each to the
    device `covering` gives at its instant under the spells now ("", aside: none, or two that
    began at once); an operator's of no cluster by every cluster's spells (`covering_any`)."""
    held = [*_held(cursor, respelled), *aside]
    scoped: dict[InstanceKey, tuple[int, int]] = {}
    anywhere: dict[tuple[str, str, int], tuple[int, int]] = {}
    for key, ts_ms, any_cluster in [(one.key, one.ts_ms, one.anywhere) for one in held] + [
        (keyed.key, keyed.row.ts_ms, keyed.anywhere) for keyed in arriving
    ]:
        wanted: dict[Any, tuple[int, int]] = anywhere if any_cluster else scoped
        name = key.instance if any_cluster else key
        lo, hi = wanted.get(name, (ts_ms, ts_ms))
        wanted[name] = (min(lo, ts_ms), max(hi, ts_ms))
    spells = spells_covering(cursor, scoped)
    spells_anywhere = spells_of_any_cluster(cursor, anywhere)
    hold_ms = sample_hold_ms()

    def device_at(key: InstanceKey, ts_ms: int, any_cluster: bool) -> str:
        meters = (
            covering_any(spells_anywhere.get(key.instance, {}), ts_ms, hold_ms)
            if any_cluster
            else covering(spells.get(key, ()), ts_ms, hold_ms)
        )
        return next(iter(meters)) if len(meters) == 1 else ""

    moves = [
        _Move(one, device)
        for one in held
        if (device := device_at(one.key, one.ts_ms, one.anywhere)) != one.device
    ]
    return Placements(
        moves=moves,
        arriving=[
            (keyed, device_at(keyed.key, keyed.row.ts_ms, keyed.anywhere)) for keyed in arriving
        ],
    )


def _held(cursor: CursorWrapper, respelled: dict[InstanceKey, Respelled]) -> list[Held]:
    """The DCGM samples, stored or set aside, in the stretches where their GPU instance's
    spells changed (`record_instances`). One query."""
    stretches: list[list[Any]] = []
    meters: list[list[Any]] = []
    keys: list[InstanceKey] = []
    for key, change in respelled.items():
        for lo, hi in change.intervals:
            index = len(keys)
            keys.append(key)
            stretches.append(
                [index, key.cluster_id, key.node, key.gpu_instance_id,
                 instance_key(GpuInstance(key.parent_uuid, key.gpu_instance_id)), lo, hi]
            )  # fmt: skip
            meters.extend([index, meter] for meter in sorted(change.meters))
    if not stretches:
        return []
    cursor.execute(_HELD_SQL, {"stretches": json.dumps(stretches), "meters": json.dumps(meters)})
    found: dict[tuple[str, int], Held] = {}
    for index, row_id, ts_ms, device, anywhere in cursor.fetchall():
        # An operator's sample set aside may be held by the GPU instance of two clusters.
        found.setdefault((device, row_id), Held(keys[index], row_id, ts_ms, device, anywhere))
    return list(found.values())


# The span of the DCGM samples sent for each GPU instance, widened (`DcgmInstance`).
WIDEN_SQL = f"""
INSERT INTO {DcgmInstance._meta.db_table} AS d
    (node, parent_uuid, gpu_instance_id, first_ms, last_ms)
SELECT * FROM ({json_rows("text", "text", "integer", "bigint", "bigint")}) AS sent
ORDER BY 2, 3, 1
ON CONFLICT (parent_uuid, gpu_instance_id, node) DO UPDATE
SET first_ms = LEAST(d.first_ms, excluded.first_ms), last_ms = GREATEST(d.last_ms, excluded.last_ms)
WHERE excluded.first_ms < d.first_ms OR excluded.last_ms > d.last_ms
"""


def widen_dcgm_spans(cursor: CursorWrapper, rows: Sequence[SampleRow], *, node: str) -> None:
    """Record that DCGM sent samples of these GPU instances, from when to when, so that a
    change of their spells there looks for them (`record_instances`)."""
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for row in rows:
        assert row.instance is not None  # `is_keyed`
        first, last = spans.get(row.instance, (row.ts_ms, row.ts_ms))
        spans[row.instance] = (min(first, row.ts_ms), max(last, row.ts_ms))
    if spans:
        cursor.execute(
            WIDEN_SQL,
            [json.dumps([[node, *instance, *span] for instance, span in spans.items()])],
        )


def placed_mig_samples(
    unknown: list[tuple[int, SampleRow]], *, node: str, agent: AgentToken | None
) -> tuple[list[tuple[int, SampleRow]], list[SampleRow]]:
    """Of samples of devices the inventory does not know (with their positions), those of
    MIG devices NVIDIA's driver made for a claim (dynamic MIG), under the meter id of the
    partition device published for their placement when they were taken
    (`metering.mig_samples.partitions_at`), and the rest. Only a partition on `node`, in the
    token's cluster, is matched: a device `why_misplaced` allows the token, so naming a parent
    GPU elsewhere stores nothing there."""
    placements = {row.placement for _, row in unknown if row.placement is not None}
    if not placements:
        return unknown, []
    found = partitions_at(
        placements,
        node=node,
        cluster_id=agent.cluster_id if agent is not None else None,
        since_ms=min(row.ts_ms for _, row in unknown if row.placement is not None),
    )
    if not found:
        return unknown, []
    rest: list[tuple[int, SampleRow]] = []
    placed: list[SampleRow] = []
    for position, row in unknown:
        timeline = found.get(row.placement) if row.placement is not None else None
        meter_id = timeline.meter_id_at(row.ts_ms) if timeline is not None else None
        if meter_id is None:
            rest.append((position, row))
        else:
            placed.append(row._replace(device_uuid=meter_id))
    return rest, placed
