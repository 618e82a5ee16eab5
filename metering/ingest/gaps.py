"""Each sample's gap to its device's next sample (`Sample.gap_ms`), kept right whatever
order samples arrive in, under the devices' advisory locks; and the hours a batch touches.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connection, models, transaction
from django.db.backends.utils import CursorWrapper
from django.db.transaction import TransactionManagementError

from db.copy import json_rows
from db.locks import LockName, advisory_xact_lock, text_key, xact_lock_sql
from metering.blocks import thaw_samples
from metering.hours import MS_PER_HOUR, hour_at, sample_hold_ms
from metering.ingest.rows import SampleRow
from metering.models import Sample

# Storage


def touched_hours(timestamps_ms: Sequence[int]) -> set[datetime]:
    """The UTC hour starts that samples at these instants count in.

    A sample holds forward only, over `[ts, ts + TALLY_SAMPLE_HOLD_SECONDS)`: its own hour,
    and the next one too when it reaches past the hour's end.
    """
    last_ms = max(sample_hold_ms(), 1) - 1
    hours: set[int] = set()
    for ts_ms in timestamps_ms:
        hours.update(range(ts_ms // MS_PER_HOUR, (ts_ms + last_ms) // MS_PER_HOUR + 1))
    return {hour_at(hour) for hour in hours}


def latest_per_hour(timestamps_ms: Iterable[int]) -> list[int]:
    """The latest of `timestamps_ms` in each UTC hour: their `touched_hours` are those of all
    of them (every instant of an hour starts in it, and the latest reaches furthest)."""
    ordered = sorted(timestamps_ms)
    # A dict keeps the last value given for a key: in ascending order, each hour's latest.
    return list(
        dict(zip([ts_ms // MS_PER_HOUR for ts_ms in ordered], ordered, strict=True)).values()
    )


# Gaps


class Bounds(NamedTuple):
    """One device's samples in a batch: its first and last instants."""

    first_ms: int
    last_ms: int


def batch_gaps(ordered: Sequence[SampleRow]) -> tuple[list[int | None], dict[str, Bounds], bool]:
    """For rows in (device, instant) order: each row's gap to the next later row of its
    device (None for a device's latest), each device's bounds, and whether a device and
    instant repeats."""
    gaps: list[int | None] = [None] * len(ordered)
    bounds: dict[str, Bounds] = {}
    repeats = False
    following_uuid, following_ms = None, 0  # the nearest later row seen (walking backwards)
    for index in range(len(ordered) - 1, -1, -1):
        uuid, ts_ms = ordered[index][0], ordered[index][1]
        if uuid == following_uuid:
            if following_ms == ts_ms:
                repeats = True
                gaps[index] = gaps[index + 1]  # the same instant: the same next one
            else:
                gaps[index] = following_ms - ts_ms
            bounds[uuid] = Bounds(ts_ms, bounds[uuid].last_ms)
        else:
            bounds[uuid] = Bounds(ts_ms, ts_ms)
        following_uuid, following_ms = uuid, ts_ms
    return gaps, bounds, repeats


_DEVICE_LOCK: LockName = "billing.ingest.device"


def lock_devices(cursor: CursorWrapper, uuids: Iterable[str]) -> None:
    """Hold the devices' advisory locks to the end of the transaction, taken in key order so
    that two writers never wait on each other in a cycle; the key is a hash of the UUID (a
    collision only makes two devices wait on each other)."""
    advisory_xact_lock(_DEVICE_LOCK, {text_key(uuid) for uuid in uuids}, cursor=cursor)


# Per device (`r`, with the first instant of its samples in a batch): its latest sample stored
# before that instant, and its first stored at or after it (an index probe each).
_NEIGHBOURS_SQL = """
SELECT r.uuid,
       (SELECT MAX(p.ts_ms) FROM billing_sample AS p WHERE p.device_uuid = r.uuid AND p.ts_ms < r.lo),
       (SELECT MIN(n.ts_ms) FROM billing_sample AS n WHERE n.device_uuid = r.uuid AND n.ts_ms >= r.lo)
FROM unnest(%s::text[], %s::bigint[]) AS r(uuid, lo)
"""  # noqa: E501


class Neighbours(NamedTuple):
    """A device's samples stored nearest a batch's first instant of it: the latest before it
    and the first at or after it (None: none)."""

    before_ms: int | None
    after_ms: int | None


def lock_and_find_neighbours(
    cursor: CursorWrapper, bounds: dict[str, Bounds], *, also_lock: Iterable[str] = ()
) -> dict[str, Neighbours]:
    """Lock the devices of `bounds` (with `also_lock`, as `lock_devices`), then read each one's
    `Neighbours` around its first instant: in one round trip, the read a statement of its own
    after the locks (so it sees every sample committed before they were granted). JIT is off
    for the rest of the transaction, as in `refresh_gaps`."""
    if not connection.in_atomic_block:  # as `advisory_xact_lock`: let go at once otherwise
        raise TransactionManagementError("the devices' locks are held by a transaction: open one")
    lock, lock_params = xact_lock_sql(
        _DEVICE_LOCK, {text_key(uuid) for uuid in bounds.keys() | set(also_lock)}
    )
    cursor.execute(
        f"SELECT set_config('jit', 'off', true); {lock}; {_NEIGHBOURS_SQL}",
        [*lock_params, *_firsts(bounds)],
    )
    cursor.nextset()
    cursor.nextset()
    return _neighbours_read(cursor)


def find_neighbours(cursor: CursorWrapper, bounds: dict[str, Bounds]) -> dict[str, Neighbours]:
    """Each device's `Neighbours` around its first instant in `bounds`, read again under the
    locks `lock_and_find_neighbours` took (after compacted samples were thawed among them)."""
    cursor.execute(_NEIGHBOURS_SQL, _firsts(bounds))
    return _neighbours_read(cursor)


def _firsts(bounds: dict[str, Bounds]) -> list[list[Any]]:
    """`_NEIGHBOURS_SQL`'s parameters: the devices, and each one's first instant in `bounds`."""
    uuids = sorted(bounds)
    return [uuids, [bounds[uuid].first_ms for uuid in uuids]]


def _neighbours_read(cursor: CursorWrapper) -> dict[str, Neighbours]:
    return {uuid: Neighbours(before, after) for uuid, before, after in cursor.fetchall()}


# Each device's sample just before a batch appended after it gets its gap to the batch's
# first: one UPDATE by the unique key. The instants are also given as constants, so that the
# planner keeps only the day partitions holding them.
_PREVIOUS_GAPS_SQL = """
UPDATE billing_sample AS s SET gap_ms = p.gap
FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) AS p(uuid, ts_ms, gap)
WHERE s.device_uuid = p.uuid AND s.ts_ms = p.ts_ms AND s.ts_ms = ANY(%s::bigint[])
  AND s.gap_ms IS DISTINCT FROM p.gap
"""


def set_previous_gaps(
    cursor: CursorWrapper, bounds: dict[str, Bounds], neighbours: dict[str, Neighbours]
) -> None:
    """After a batch (`bounds`, per device) was stored with its own gaps right, under the
    devices' locks: set the gap of each device's sample stored just before it (`neighbours`,
    read under the same locks) to the batch's first. The only gap the batch changes: what
    `refresh_gaps` over each device's first instant works out, in one statement."""
    previous = sorted(
        (uuid, found.before_ms, bounds[uuid].first_ms - found.before_ms)
        for uuid, found in neighbours.items()
        if found.before_ms is not None
    )
    if previous:
        uuids, instants, gaps = (list(column) for column in zip(*previous, strict=True))
        cursor.execute(_PREVIOUS_GAPS_SQL, [uuids, instants, gaps, sorted(set(instants))])


# Per device in `r`: its samples from the one before `lo` to the one after `hi`, their gaps
# worked out again; the rows whose gap changed, with their new gap. The sample after `hi`
# keeps its own (its next sample is not read).
_REFRESH_GAPS_SQL = """
WITH r(uuid, lo, hi) AS ({bounds}),
span AS (
    SELECT r.uuid, r.hi AS last_ms,
           COALESCE((SELECT MAX(p.ts_ms) FROM billing_sample AS p
                     WHERE p.device_uuid = r.uuid AND p.ts_ms < r.lo), r.lo) AS lo,
           COALESCE((SELECT MIN(n.ts_ms) FROM billing_sample AS n
                     WHERE n.device_uuid = r.uuid AND n.ts_ms > r.hi), r.hi) AS hi
    FROM r
),
near AS (
    -- The ends worked out first, so each device's samples are one index range.
    SELECT s.id, s.device_uuid, s.ts_ms, s.gap_ms, span.last_ms
    FROM span JOIN billing_sample AS s
      ON s.device_uuid = span.uuid AND s.ts_ms >= span.lo AND s.ts_ms <= span.hi
),
following AS (
    SELECT id, ts_ms, gap_ms AS stored, last_ms,
           LEAD(ts_ms) OVER (PARTITION BY device_uuid ORDER BY ts_ms) - ts_ms AS gap
    FROM near
)
-- A sample with none after it in range has no next one only when it is not the first after
-- the range (whose next one lies beyond): its gap is then cleared, as when the sample after
-- it was moved to another device.
SELECT id, ts_ms, gap FROM following
WHERE (gap IS NOT NULL OR ts_ms <= last_ms) AND stored IS DISTINCT FROM gap
"""
# The changed gaps, by primary key. A separate statement: joined to the samples within one
# UPDATE, the planner expects many rows from the window and hashes the whole table. The key
# is (id, ts_ms), the partitioned table's: by id alone, a day's partition not yet analysed
# looks as if an id matched half its rows, and is hashed whole.
_SET_GAPS_SQL = """
WITH changed(id, ts_ms, gap) AS ({changed})
UPDATE billing_sample SET gap_ms = changed.gap
FROM changed
WHERE billing_sample.id = changed.id AND billing_sample.ts_ms = changed.ts_ms
"""


def refresh_gaps(cursor: CursorWrapper, bounds: dict[str, Bounds]) -> None:
    """Work out again the gaps of the devices' samples from the one before `first_ms` to
    `last_ms`: after samples were stored between them, in any order."""
    if not bounds:
        return
    # Compacted samples in the span back in `billing_sample`, so that its gaps are worked out
    # on every sample (`metering.blocks`); nothing when none are there.
    thaw_samples(cursor, bounds)
    # Over a partition of millions of samples (a day of 1,000 GPUs is 1.4 million) the
    # planner's cost for these few index ranges passes `jit_above_cost`, and compiling the
    # statement took ~0.5 s of a call it runs in 2 ms: ingest fell from 60,000 samples a
    # second to 20,000 as the partition grew. Off for the caller's transaction (each holds
    # one), the update below included.
    cursor.execute(
        "SELECT set_config('jit', 'off', true); "
        + _REFRESH_GAPS_SQL.format(bounds=json_rows("text", "bigint", "bigint")),
        [json.dumps([[uuid, *bound] for uuid, bound in sorted(bounds.items())])],
    )
    cursor.nextset()
    changed = cursor.fetchall()
    if changed:
        cursor.execute(
            _SET_GAPS_SQL.format(changed=json_rows("bigint", "bigint", "bigint")),
            [json.dumps([list(row) for row in changed])],
        )


def fill_gaps(uuids: Iterable[str]) -> None:
    """Work out the gaps of every sample of these devices: for samples written other than by
    `ingest` (the demo's, a test's)."""
    uuids = sorted(set(uuids))
    if not uuids:
        return
    bounds = {
        uuid: Bounds(first, last)
        for uuid, first, last in Sample.objects.filter(device_uuid__in=uuids)
        .values("device_uuid")
        .annotate(first=models.Min("ts_ms"), last=models.Max("ts_ms"))
        .values_list("device_uuid", "first", "last")
    }
    with transaction.atomic(), connection.cursor() as cursor:
        lock_devices(cursor, bounds)
        refresh_gaps(cursor, bounds)
