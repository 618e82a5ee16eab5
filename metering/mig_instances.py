"""Which MIG device each GPU instance id of a GPU was, and when, kept as spells
(`billing.models.MigInstance`) from the samples that carry a GPU instance.

A GPU instance id is reused: MIG device A is destroyed, B created under the same id, then A's
id again, and so on. A span per device, widened to its first and last sample, would let A's
cover B's spell and B's cover A's second, so a DCGM reading between would be claimed by both.
So a GPU instance (its cluster, node, parent GPU and id) keeps *spells*: the runs of all its
samples in time order (then by meter id, so two at one instant are ordered too), each the
first and last sample of an uninterrupted run of one device's. They are what its samples
give all at once, whatever order, or however concurrently, their batches come in:

- each batch's samples are merged into the GPU instance's stored spells about them (the ones
  its samples fall in or next to), under a lock per GPU instance taken in key order;
- where a sample of one device falls inside a stored spell of another (a late batch filling a
  gap, two agents' batches), that spell is split at its own device's samples on either side,
  read from `billing_sample`, where every sample recorded here was stored first (the samples
  between a spell's ends are not kept here). So a split is exact where a device's meter id is
  one GPU instance for all its samples (a MIG UUID always is; a dynamic MIG partition's meter
  id made again under another id within one of its spells would have that spell split at its
  samples under the other id too), and while those samples are kept (`metering.retention`).

Rows written before spells, one per device widened over the others', are split the same way
at each other's ends by migration 0012 (`split_overlapping_spells`).

Which device a GPU instance was at an instant (`covering`) is one rule for both readers of
the spells: the Prometheus source's DCGM MIG series (`metering.prometheus`) and the agents'
DCGM samples named `<parent UUID>::gi<N>` (`metering.ingest`). The device is the one whose spell
covers the instant, from its first sample to a hold (TALLY_SAMPLE_HOLD_SECONDS) past its last,
as a sample's utilisation holds; of two covering it (a hold reaching into the next spell), the
one that began last, so an id handed on goes to the new device from its first sample. Between
spells further apart than the hold, no device: the readings there are not anyone's. A change
of the spells changes the device at some instants only; `record_instances` says where, for the
GPU instances DCGM sent samples of (`DcgmInstance`), so that those samples are placed again.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any, NamedTuple

from django.db import connection
from django.db.backends.utils import CursorWrapper
from django.db.transaction import TransactionManagementError

from db.bulk import update_rows
from db.copy import json_rows
from db.locks import text_key, xact_lock_sql
from metering.hours import sample_hold_ms
from metering.models import DcgmInstance, MigInstance

_TABLE = MigInstance._meta.db_table
_KEY_COLUMNS = "cluster_id, node, parent_uuid, gpu_instance_id"


class InstanceKey(NamedTuple):
    """One GPU instance: its GPU's cluster and node (the inventory's), the GPU's UUID and the
    GPU instance id on it."""

    cluster_id: int
    node: str
    parent_uuid: str
    gpu_instance_id: int

    @property
    def instance(self) -> tuple[str, str, int]:
        """(node, GPU UUID, GPU instance id): what its lock and DCGM's samples name it by."""
        return self.node, self.parent_uuid, self.gpu_instance_id


class Point(NamedTuple):
    """A sample of a GPU instance: when, and the device it was stored under. Ordered by time,
    then meter id: the order spells are runs in."""

    ts_ms: int
    meter_id: str


class Spell(NamedTuple):
    """One device's uninterrupted run of samples under a GPU instance: its first and last."""

    meter_id: str
    first_ms: int
    last_ms: int


class _Stored(NamedTuple):
    """A spell as stored, with its row's id."""

    id: int
    meter_id: str
    first_ms: int
    last_ms: int


class Respelled(NamedTuple):
    """Where a change of a GPU instance's spells changed the device it was (`covering`): the
    instants `[lo, hi]` of each stretch, within the span of the DCGM samples sent for it, and
    the devices it was there before the change."""

    intervals: tuple[tuple[int, int], ...]
    meters: frozenset[str]


def covering(spans: Iterable[tuple[int, int, str]], ts_ms: int, hold_ms: int) -> frozenset[str]:
    """The device a GPU instance was at `ts_ms`, by its spells `spans` ((first ms, last ms,
    meter id)): of the spells covering it, from their first sample to `hold_ms` past their
    last, the one that began last. Empty: none covers it; two: two began at that same instant
    and cannot be told apart."""
    latest: int | None = None
    meters: set[str] = set()
    for first, last, meter in spans:
        if first <= ts_ms <= last + hold_ms:
            if latest is None or first > latest:
                latest, meters = first, {meter}
            elif first == latest:
                meters.add(meter)
    return frozenset(meters)


def _changed(old: Sequence[Spell], new: Sequence[Spell], hold_ms: int) -> list[tuple[int, int]]:
    """The instants where `covering` tells another device over the spells `new` than over
    `old`, as `[lo, hi]` stretches. The device is the same between two consecutive instants
    where a spell begins or stops covering, so it is compared at those only."""
    spans = {
        name: [(spell.first_ms, spell.last_ms, spell.meter_id) for spell in spells]
        for name, spells in (("old", old), ("new", new))
    }
    both = spans["old"] + spans["new"]
    cuts = sorted({first for first, _, _ in both} | {last + hold_ms + 1 for _, last, _ in both})
    stretches: list[tuple[int, int]] = []
    # After the last cut no spell covers anything: the same on both sides.
    for cut, following in pairwise(cuts):
        if covering(spans["old"], cut, hold_ms) != covering(spans["new"], cut, hold_ms):
            if stretches and stretches[-1][1] == cut - 1:
                stretches[-1] = (stretches[-1][0], following - 1)
            else:
                stretches.append((cut, following - 1))
    return stretches


def spells_of(points: Iterable[Point]) -> list[Spell]:
    """The spells of a GPU instance's samples: the runs of one device in their order."""
    spells: list[Spell] = []
    for ts_ms, meter_id in sorted(set(points)):
        if spells and spells[-1].meter_id == meter_id:
            spells[-1] = spells[-1]._replace(last_ms=ts_ms)
        else:
            spells.append(Spell(meter_id, ts_ms, ts_ms))
    return spells


class _Gap(NamedTuple):
    """Instants `[lo, hi]` inside a stored spell of `meter_id`, between two samples of other
    devices (or the spell's own ends): its samples there, if any, are a run of their own."""

    meter_id: str
    lo: int
    hi: int


def _gaps(stored: Sequence[_Stored], known: Sequence[Point]) -> list[_Gap]:
    """Where stored spells must be split: per spell with samples of other devices inside
    (`known`, sorted: the batch's and the other spells' ends), the stretches between them,
    bounds included as far as the (time, meter id) order allows."""
    gaps: list[_Gap] = []
    for spell in stored:
        first, last = Point(spell.first_ms, spell.meter_id), Point(spell.last_ms, spell.meter_id)
        inside = [
            point
            for point in known[bisect_left(known, first) : bisect_left(known, last)]
            if point.meter_id != spell.meter_id and first < point
        ]
        if not inside:
            continue
        for after, before in zip([first, *inside], [*inside, last], strict=True):
            # The instants t with after < (t, meter) < before.
            lo = after.ts_ms if spell.meter_id > after.meter_id else after.ts_ms + 1
            hi = before.ts_ms if spell.meter_id < before.meter_id else before.ts_ms - 1
            if lo <= hi:
                gaps.append(_Gap(spell.meter_id, lo, hi))
    return gaps


def _merged(
    stored: Sequence[_Stored], points: Iterable[Point], found: Iterable[Point]
) -> list[Spell]:
    """The spells of a GPU instance's stored spells about a batch with the batch's `points`,
    given the samples `found` at the ends of each gap (`_gaps`): every run boundary is then
    a known point, so the runs of the known points are the runs of all."""
    known = {point for spell in stored for point in _ends(spell)}
    known.update(points)
    known.update(found)
    return spells_of(known)


def _ends(spell: _Stored) -> tuple[Point, Point]:
    return Point(spell.first_ms, spell.meter_id), Point(spell.last_ms, spell.meter_id)


def lock_instances(cursor: CursorWrapper, instances: Iterable[tuple[str, str, int]]) -> None:
    """Hold the GPU instances' locks to the end of the transaction, in key order; and for the
    rest of it no JIT compilation (as the rollup): guessing a hundred GPU instances per batch
    and each one's share of the table, the planner would compile every batch's read of its
    spells (20-30 ms) to save nothing. One round trip.

    A GPU instance is named here by its node, GPU UUID and id (`InstanceKey.instance`), not
    its cluster: an operator's DCGM sample, whose cluster its spells tell, waits for every
    writer of them. Taken before the devices' locks (`metering.ingest`), by every writer that
    takes both."""
    if not connection.in_atomic_block:
        raise TransactionManagementError("GPU instances' spells are merged in a transaction")
    lock, params = xact_lock_sql(
        "billing.ingest.mig_instance", {text_key(*instance) for instance in instances}
    )
    cursor.execute(f"{lock}; SELECT set_config('jit', 'off', true)", params)


# Per GPU instance and its batch's instants [lo, hi]: its stored spells from the last one that
# ends before lo (with any ending then) to the first that starts after hi (with any starting
# then): those the batch's samples fall in or next to; all of them where lo is null. The
# bounds first, then each GPU instance's spells between them, one index range (by last_ms).
# With `{dcgm}`: and a row without a spell (id null) giving the span of the DCGM samples sent
# for the GPU instance, if any.
_ABOUT_SQL = f"""
WITH r(i, cluster_id, node, parent_uuid, gpu_instance_id, lo, hi) AS (
    {json_rows("bigint", "bigint", "text", "text", "integer", "bigint", "bigint")}
),
bounds AS MATERIALIZED (
    SELECT r.*,
           COALESCE(
               (SELECT max(b.last_ms) FROM {_TABLE} AS b
                WHERE ({_KEY_COLUMNS}) = (r.cluster_id, r.node, r.parent_uuid, r.gpu_instance_id)
                  AND b.last_ms < r.lo),
               r.lo, {-(2**63)}) AS from_ms,
           COALESCE(
               (SELECT min(a.first_ms) FROM {_TABLE} AS a
                WHERE ({_KEY_COLUMNS}) = (r.cluster_id, r.node, r.parent_uuid, r.gpu_instance_id)
                  AND a.first_ms > r.hi),
               r.hi, {2**63 - 1}) AS to_ms
    FROM r
)
SELECT bounds.i, m.id, m.meter_id, m.first_ms, m.last_ms
FROM bounds CROSS JOIN LATERAL (
    SELECT id, meter_id, first_ms, last_ms FROM {_TABLE}
    WHERE ({_KEY_COLUMNS})
          = (bounds.cluster_id, bounds.node, bounds.parent_uuid, bounds.gpu_instance_id)
      AND last_ms >= bounds.from_ms AND first_ms <= bounds.to_ms
    OFFSET 0  -- kept a subquery per GPU instance: its index range, never the table hashed
) AS m
{{dcgm}}"""
_DCGM_SPAN_SQL = f"""
UNION ALL
SELECT r.i, NULL, NULL, d.first_ms, d.last_ms
FROM r JOIN {DcgmInstance._meta.db_table} AS d
  ON (d.parent_uuid, d.gpu_instance_id, d.node) = (r.parent_uuid, r.gpu_instance_id, r.node)
"""
# Per gap: the device's first and last sample stored in it, of its own (`{own}`: not a DCGM
# sample placed by the spells, which must not make them).
_FOUND_SQL = f"""
SELECT g.i, s.first_ms, s.last_ms
FROM ({json_rows("bigint", "text", "bigint", "bigint")}) AS g(i, meter_id, lo, hi)
CROSS JOIN LATERAL (
    SELECT min(ts_ms) AS first_ms, max(ts_ms) AS last_ms FROM metering_readings(g.lo, g.hi + 1)
    WHERE device_uuid = g.meter_id{{own}}
) AS s
WHERE s.first_ms IS NOT NULL
"""
_OWN_SQL = " AND placed_gpu_instance IS NULL"
# Per gap: its device's spells under the GPU's other GPU instances there (a dynamic MIG
# partition's meter id is one GPU instance, then another): its samples there are not this
# GPU instance's. The GPU's spells, one index range.
_ELSEWHERE_SQL = f"""
SELECT g.i, m.first_ms, m.last_ms
FROM ({json_rows("bigint", "bigint", "text", "text", "integer", "text", "bigint", "bigint")})
     AS g(i, cluster_id, node, parent_uuid, gpu_instance_id, meter_id, lo, hi)
JOIN {_TABLE} AS m
  ON (m.cluster_id, m.node, m.parent_uuid) = (g.cluster_id, g.node, g.parent_uuid)
 AND m.gpu_instance_id <> g.gpu_instance_id AND m.meter_id = g.meter_id
 AND m.last_ms >= g.lo AND m.first_ms <= g.hi
"""
# Per GPU instance and instants [lo, hi]: its spells that may cover one of them (`covering`),
# those beginning by hi and ending at lo or later (lo given a hold early).
_COVERING_SQL = f"""
SELECT w.i, m.first_ms, m.last_ms, m.meter_id
FROM ({json_rows("bigint", "bigint", "text", "text", "integer", "bigint", "bigint")})
     AS w(i, cluster_id, node, parent_uuid, gpu_instance_id, lo, hi)
JOIN {_TABLE} AS m
  ON (m.cluster_id, m.node, m.parent_uuid, m.gpu_instance_id)
     = (w.cluster_id, w.node, w.parent_uuid, w.gpu_instance_id)
 AND m.last_ms >= w.lo AND m.first_ms <= w.hi
"""
# Per (node, GPU, GPU instance id) and instants [lo, hi]: every cluster's spells that may
# cover one of them. The GPU's spells ending from lo on, one index range.
_ANY_COVERING_SQL = f"""
SELECT w.i, m.cluster_id, m.first_ms, m.last_ms, m.meter_id
FROM ({json_rows("bigint", "text", "text", "integer", "bigint", "bigint")})
     AS w(i, node, parent_uuid, gpu_instance_id, lo, hi)
JOIN {_TABLE} AS m
  ON m.parent_uuid = w.parent_uuid AND m.last_ms >= w.lo
 AND (m.node, m.gpu_instance_id) = (w.node, w.gpu_instance_id) AND m.first_ms <= w.hi
"""
# GPU instances two of whose devices' spells overlap (rows written before spells).
_OVERLAPPING_SQL = f"""
SELECT DISTINCT {", ".join(f"m.{column}" for column in _KEY_COLUMNS.split(", "))}
FROM {_TABLE} AS m JOIN {_TABLE} AS o USING ({_KEY_COLUMNS})
WHERE m.meter_id <> o.meter_id AND m.first_ms <= o.last_ms AND o.first_ms <= m.last_ms
"""


def record_instances(
    cursor: CursorWrapper, points: Mapping[InstanceKey, Iterable[Point]]
) -> dict[InstanceKey, Respelled]:
    """Merge each GPU instance's `points` (a batch's samples, stored in `billing_sample`
    already, or being stored in the same transaction) into its spells; the caller holds the
    GPU instances' locks (`lock_instances`). Order independent: the spells are those of all
    the samples recorded, however their batches were split, ordered or run at once (each GPU
    instance's spells are read and written under its lock). A batch that only extends a
    device's latest spell, the usual case, updates that one row.

    Returns, for the GPU instances DCGM sent samples of (`DcgmInstance`), where the device
    they were changed, within those samples' span: where they are to be placed again."""
    return _respell(cursor, {key: set(found) for key, found in points.items() if found})


def _windows(keys: Sequence[tuple[Any, ...]], wanted: Mapping[Any, tuple[int, int]]) -> str:
    """The JSON parameter of `_COVERING_SQL` and `_ANY_COVERING_SQL`: each of `keys` by its place,
    its fields, and its instants `[lo, hi]` widened back by the hold (a spell that ended that
    long before `lo` still covers it)."""
    hold_ms = sample_hold_ms()
    return json.dumps(
        [[index, *key, wanted[key][0] - hold_ms, wanted[key][1]] for index, key in enumerate(keys)]
    )


def spells_covering(
    cursor: CursorWrapper, wanted: Mapping[InstanceKey, tuple[int, int]]
) -> dict[InstanceKey, list[tuple[int, int, str]]]:
    """Per GPU instance and instants `[lo, hi]`, its spells (first ms, last ms, meter id) that
    may cover one of them, for `covering`. One query."""
    if not wanted:
        return {}
    keys = sorted(wanted)
    cursor.execute(_COVERING_SQL, [_windows(keys, wanted)])
    spells: dict[InstanceKey, list[tuple[int, int, str]]] = defaultdict(list)
    for index, first_ms, last_ms, meter_id in cursor.fetchall():
        spells[keys[index]].append((first_ms, last_ms, meter_id))
    return spells


def spells_of_any_cluster(
    cursor: CursorWrapper, wanted: Mapping[tuple[str, str, int], tuple[int, int]]
) -> dict[tuple[str, str, int], dict[int, list[tuple[int, int, str]]]]:
    """Per (node, GPU UUID, GPU instance id) and instants `[lo, hi]`, each cluster's spells
    (first ms, last ms, meter id) that may cover one of them: for an operator's DCGM sample,
    of no cluster, whose cluster is the one whose spell covers its instant (`covering_any`).
    One query."""
    if not wanted:
        return {}
    triples = sorted(wanted)
    cursor.execute(_ANY_COVERING_SQL, [_windows(triples, wanted)])
    spells: dict[tuple[str, str, int], dict[int, list[tuple[int, int, str]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for index, cluster_id, first_ms, last_ms, meter_id in cursor.fetchall():
        spells[triples[index]][cluster_id].append((first_ms, last_ms, meter_id))
    return spells


def covering_any(
    by_cluster: Mapping[int, Iterable[tuple[int, int, str]]], ts_ms: int, hold_ms: int
) -> frozenset[str]:
    """`covering` over several clusters' spells of one GPU instance (a node that moved from
    one cluster to another): the device of the one cluster whose spells cover `ts_ms`; empty
    where none does or two do (the instant cannot be given to either)."""
    found = [meters for spans in by_cluster.values() if (meters := covering(spans, ts_ms, hold_ms))]
    return found[0] if len(found) == 1 else frozenset()


def split_overlapping_spells(cursor: CursorWrapper) -> int:
    """Split the spells of GPU instances where two devices' overlap (each device one span,
    as rows were recorded before spells: migration 0012) at each other's ends and their own
    samples between, as if their samples had come in again; how many GPU instances. Run
    before migration 0013, whose table and column of DCGM samples it does not read."""
    cursor.execute(_OVERLAPPING_SQL)
    keys = [InstanceKey(*row) for row in cursor.fetchall()]
    if keys:
        lock_instances(cursor, [key.instance for key in keys])
    _respell(cursor, {key: set() for key in keys}, dcgm=False)
    return len(keys)


def _respell(
    cursor: CursorWrapper, batch: Mapping[InstanceKey, set[Point]], *, dcgm: bool = True
) -> dict[InstanceKey, Respelled]:
    """Merge each GPU instance's new points into its stored spells about them (all of them,
    for a GPU instance given none); where the device changed, as `record_instances` says
    (with `dcgm`: DCGM samples may have been placed by them)."""
    if not batch:
        return {}
    keys = sorted(batch)
    # Each GPU instance's new points' first and last instants (null: all its spells).
    about = [
        [index, *key, *(_bounds(batch[key]) if batch[key] else (None, None))]
        for index, key in enumerate(keys)
    ]
    cursor.execute(_ABOUT_SQL.format(dcgm=_DCGM_SPAN_SQL if dcgm else ""), [json.dumps(about)])
    stored: dict[InstanceKey, list[_Stored]] = defaultdict(list)
    dcgm_spans: dict[InstanceKey, tuple[int, int]] = {}
    for index, row_id, meter_id, first_ms, last_ms in cursor.fetchall():
        if row_id is None:
            dcgm_spans[keys[index]] = (first_ms, last_ms)
        else:
            stored[keys[index]].append(_Stored(row_id, meter_id, first_ms, last_ms))
    gaps = {
        key: _gaps(stored[key], sorted(batch[key].union(*map(_ends, stored[key])))) for key in keys
    }
    found = _found_as(cursor, gaps, own=dcgm)
    deleted: list[int] = []
    updated: list[list[int]] = []
    inserted: list[list[object]] = []
    respelled: dict[InstanceKey, Respelled] = {}
    hold_ms = sample_hold_ms()
    for key in keys:
        ends = [point for gap in gaps[key] for point in found.get(gap, ())]
        spells = _merged(stored[key], batch[key], ends)
        kept, new, gone = _changes(stored[key], spells)
        deleted.extend(gone)
        updated.extend([row_id, spell.first_ms, spell.last_ms] for row_id, spell in kept)
        inserted.extend([*key, *spell] for spell in new)
        if key in dcgm_spans and (kept or new or gone):
            sent_from, sent_to = dcgm_spans[key]
            before = [Spell(row.meter_id, row.first_ms, row.last_ms) for row in stored[key]]
            intervals = tuple(
                (max(lo, sent_from), min(hi, sent_to))
                for lo, hi in _changed(before, spells, hold_ms)
                if lo <= sent_to and hi >= sent_from
            )
            if intervals:
                respelled[key] = Respelled(intervals, frozenset(row.meter_id for row in before))
    _write(cursor, deleted=deleted, updated=updated, inserted=inserted)
    return respelled


def _bounds(points: set[Point]) -> tuple[int, int]:
    return min(points).ts_ms, max(points).ts_ms


def _found_as(
    cursor: CursorWrapper, gaps: Mapping[InstanceKey, Sequence[_Gap]], *, own: bool
) -> dict[_Gap, tuple[Point, Point]]:
    """`_found`, of the samples each gap's device has as that gap's GPU instance: the stretches
    where its spells under another GPU instance of the GPU lie are left out, so that a dynamic
    MIG partition that was another GPU instance between does not extend this one's spell (as
    its samples all at once would not). One more query, where there are gaps."""
    listed = [(key, gap) for key, key_gaps in gaps.items() for gap in key_gaps]
    if not listed:
        return {}
    cursor.execute(
        _ELSEWHERE_SQL,
        [json.dumps([[index, *key, *gap] for index, (key, gap) in enumerate(listed)])],
    )
    elsewhere: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for index, first_ms, last_ms in cursor.fetchall():
        elsewhere[index].append((first_ms, last_ms))
    parts: dict[_Gap, list[_Gap]] = {}
    for index, (_, gap) in enumerate(listed):
        pieces = [gap]
        for first_ms, last_ms in elsewhere.get(index, ()):
            pieces = [
                piece
                for whole in pieces
                for piece in (
                    whole._replace(hi=min(whole.hi, first_ms - 1)),
                    whole._replace(lo=max(whole.lo, last_ms + 1)),
                )
                if piece.lo <= piece.hi
            ]
        parts[gap] = pieces
    found = _found(cursor, [piece for pieces in parts.values() for piece in pieces], own=own)
    joined: dict[_Gap, tuple[Point, Point]] = {}
    for gap, pieces in parts.items():
        ends = [found[piece] for piece in pieces if piece in found]
        if ends:
            joined[gap] = (min(first for first, _ in ends), max(last for _, last in ends))
    return joined


def _found(
    cursor: CursorWrapper, gaps: Sequence[_Gap], *, own: bool
) -> dict[_Gap, tuple[Point, Point]]:
    """Per gap its device has samples stored in, the first and last of them (`own`: of its
    own samples, not DCGM samples the spells placed under it)."""
    if not gaps:
        return {}
    unique = sorted(set(gaps))
    cursor.execute(
        _FOUND_SQL.format(own=_OWN_SQL if own else ""),
        [json.dumps([[index, *gap] for index, gap in enumerate(unique)])],
    )
    return {
        unique[index]: (
            Point(first_ms, unique[index].meter_id),
            Point(last_ms, unique[index].meter_id),
        )
        for index, first_ms, last_ms in cursor.fetchall()
    }


def _changes(
    stored: Sequence[_Stored], spells: Sequence[Spell]
) -> tuple[list[tuple[int, Spell]], list[Spell], list[int]]:
    """What turns `stored` into `spells`: rows kept (each the first new spell of its device it
    overlaps; changed or not), spells to insert, and the ids of rows to delete. A row whose
    spell stays as it was is left out."""
    unused = {spell.id: spell for spell in stored}
    kept: list[tuple[int, Spell]] = []
    new: list[Spell] = []
    for spell in spells:
        row = next(
            (
                row
                for row in unused.values()
                if row.meter_id == spell.meter_id
                and row.first_ms <= spell.last_ms
                and spell.first_ms <= row.last_ms
            ),
            None,
        )
        if row is None:
            new.append(spell)
            continue
        del unused[row.id]
        if (row.first_ms, row.last_ms) != (spell.first_ms, spell.last_ms):
            kept.append((row.id, spell))
    return kept, new, list(unused)


def _write(
    cursor: CursorWrapper,
    *,
    deleted: Sequence[int],
    updated: Sequence[Sequence[int]],
    inserted: Sequence[Sequence[object]],
) -> None:
    """Deletions first, so that neither an update nor an insert meets a row on its way out."""
    if deleted:
        cursor.execute(f"DELETE FROM {_TABLE} WHERE id = ANY(%s)", [list(deleted)])
    update_rows(MigInstance, ["first_ms", "last_ms"], updated)
    if inserted:
        cursor.execute(
            f"INSERT INTO {_TABLE} ({_KEY_COLUMNS}, meter_id, first_ms, last_ms) "
            + json_rows("bigint", "text", "text", "integer", "text", "bigint", "bigint"),
            [json.dumps(inserted)],
        )
