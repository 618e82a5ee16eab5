"""Compacted samples: each closed day's samples of a device become one row of arrays.

A stored sample costs ~590 bytes in `billing_sample` (a row's header and item pointer, the
JSON of its processes, the UUID, and its share of two btree indexes); a closed day of one
device, 1,440 samples taken a minute apart, is one `SampleBlock` row whose arrays PostgreSQL
compresses (pglz, in TOAST): tens of bytes a sample (figures: docs/benchmarks/billing.md).

The write path is unchanged: ingest writes `billing_sample`, and beat's `compact_samples`
(`compact_samples` the command) turns each day older than TALLY_SAMPLE_COMPACT_AFTER_DAYS into
blocks, one transaction per batch of TALLY_SAMPLE_COMPACT_DEVICES devices, under those
devices' ingest locks (`billing.ingest.device`), then rewrites the day's partition
(a new table with the rows left takes its place) to give its space back. Idempotent,
resumable: a device-day with a block is left as it is; a rerun picks up where one stopped.

What makes it safe for every writer and reader that reads `billing_sample` alone:

- A device's first and last sample of the day stay in `billing_sample`; the block holds the
  samples strictly between (`lo_ms`, `hi_ms`). A lookup of the sample before or after an
  instant outside a block's span, or of a device's first or latest sample, finds the same
  sample in `billing_sample` as it would with nothing compacted (the span's ends are there).
- A write inside a block's span (a late sample, a backfill, a sample adopted or placed by a
  GPU instance's spells) first thaws the blocks it touches back into `billing_sample`
  (`thaw_samples`, called by the writers under the devices' locks, before they read
  anything): so the duplicate check, the gaps (`metering.ingest.gaps`) and the neighbour
  lookups are worked out on every sample, as before. A thaw changes no sample (ids aside:
  thawed samples get new ones; nothing refers to a sample by id).
- Samples placed by a GPU instance's spells (`placed_gpu_instance`) are never compacted: the
  spells' moves (`metering.ingest.placement`) read and delete them in `billing_sample`.
- A reader of a window of samples (the rollup, the Prometheus source's mixed clusters, the
  MIG spells' own-sample spans) reads `metering_readings(lo, hi)`: both, as one table.
- Retention drops a day's blocks with its partition, in one transaction, under the same
  holds (`metering.retention`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from psycopg.errors import LockNotAvailable

from metering.blocks import BLOCKS, readings_between, thaw_samples
from metering.ingest.gaps import lock_devices
from metering.models import Sample
from metering.retention import (
    DEFAULT_PARTITION,
    PARENT,
    create_day_partition,
    day_bounds_ms,
    default_days,
    lock_day,
    lock_timeout,
    partition_name,
    sample_partitions,
)

log = logging.getLogger(__name__)

__all__ = ["BLOCKS", "compact_samples", "readings_between", "thaw_samples"]

# One batch of devices of one day's partition: each device's samples strictly between its
# first and last of the day, out of the partition and into one block; not a device-day that
# has a block already (a rerun), nor one holding a sample placed by the spells.
_COMPACT_SQL = """
WITH s AS MATERIALIZED (
    SELECT id, device_uuid, ts_ms,
           min(ts_ms) OVER w AS lo, max(ts_ms) OVER w AS hi,
           bool_or(placed_gpu_instance IS NOT NULL) OVER w AS placed
    FROM {partition} WHERE device_uuid = ANY(%(uuids)s)
    WINDOW w AS (PARTITION BY device_uuid)
),
moved AS (
    DELETE FROM {partition} AS t USING s
    WHERE t.id = s.id AND t.ts_ms = s.ts_ms AND s.ts_ms > s.lo AND s.ts_ms < s.hi
      AND NOT s.placed
      AND NOT EXISTS (SELECT 1 FROM {blocks} AS b
                      WHERE b.device_uuid = s.device_uuid AND b.day_ms = %(day)s)
    RETURNING t.*, s.lo, s.hi
)
INSERT INTO {blocks} (device_uuid, day_ms, lo_ms, hi_ms, ts_off, gpu_util, gap_ms, covered_ms,
                      mem_used_bytes, processes, node, received_at)
SELECT device_uuid, %(day)s, min(lo), min(hi),
       array_agg((ts_ms - %(day)s)::integer ORDER BY ts_ms),
       array_agg(gpu_util ORDER BY ts_ms), array_agg(gap_ms ORDER BY ts_ms),
       array_agg(covered_ms ORDER BY ts_ms), array_agg(mem_used_bytes ORDER BY ts_ms),
       array_agg(processes::text ORDER BY ts_ms), array_agg(node::text ORDER BY ts_ms),
       array_agg(received_at ORDER BY ts_ms)
FROM moved GROUP BY device_uuid
"""

# What a dry run would move: the samples strictly inside each eligible device-day's span.
_WOULD_MOVE_SQL = """
SELECT count(*) FROM (
    SELECT device_uuid, ts_ms, min(ts_ms) OVER w AS lo, max(ts_ms) OVER w AS hi,
           bool_or(placed_gpu_instance IS NOT NULL) OVER w AS placed
    FROM {partition}
    WINDOW w AS (PARTITION BY device_uuid)
) AS s
WHERE ts_ms > lo AND ts_ms < hi AND NOT placed
  AND NOT EXISTS (SELECT 1 FROM {blocks} AS b
                  WHERE b.device_uuid = s.device_uuid AND b.day_ms = %(day)s)
"""


@dataclass
class CompactionReport:
    """What one `compact_samples` did (or, dry, would do), by day."""

    moved: dict[date, int] = field(default_factory=dict)  # samples into blocks
    blocks: dict[date, int] = field(default_factory=dict)
    rewritten: list[date] = field(default_factory=list)  # partitions given their space back
    busy: list[date] = field(default_factory=list)  # the rewrite's lock not had: next run
    # Days whose samples were in DEFAULT (no partition of their own: a backfill, history
    # loaded before the partitions were made), given their partition first; dry: how many
    # samples each has there.
    partitioned: dict[date, int] = field(default_factory=dict)
    # DEFAULT given its space back (rows moved out of it, by this run or retention), or left
    # bloated, its rewrite's lock not had: the next run.
    default_rewritten: bool = False
    default_busy: bool = False


def compaction_horizon(now: datetime) -> date:
    """The first day not compacted: TALLY_SAMPLE_COMPACT_AFTER_DAYS before `now`'s. Older
    days are closed to agents in the usual run of things; a sample sent later for one (up to
    TALLY_INGEST_MAX_AGE_DAYS) thaws what it touches (`thaw_samples`)."""
    days = int(settings.TALLY_SAMPLE_COMPACT_AFTER_DAYS)
    return now.astimezone(UTC).date() - timedelta(days=days)


def compact_day(day: date, *, batch: int | None = None) -> tuple[int, int]:
    """Compact `day`'s partition (see the module); (samples moved, blocks made). Each batch
    of devices is one transaction under their ingest locks and the day's lock (which
    retention's drop takes too)."""
    name = partition_name(day)
    start, _ = day_bounds_ms(day)
    size = int(batch or settings.TALLY_SAMPLE_COMPACT_DEVICES)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT DISTINCT device_uuid FROM {name} ORDER BY 1")
        uuids = [uuid for (uuid,) in cursor.fetchall()]
    moved = made = 0
    sql = _COMPACT_SQL.format(partition=name, blocks=BLOCKS)
    for first in range(0, len(uuids), size):
        chunk = uuids[first : first + size]
        with transaction.atomic(), connection.cursor() as cursor:
            lock_day(day, cursor)
            lock_devices(cursor, chunk)
            cursor.execute(
                "SELECT set_config('jit', 'off', true), set_config('work_mem', '64MB', true)"
            )
            cursor.execute(sql + " RETURNING cardinality(ts_off)", {"uuids": chunk, "day": start})
            sizes = [n for (n,) in cursor.fetchall()]
        moved += sum(sizes)
        made += len(sizes)
    return moved, made


def rewrite_partition(day: date | None) -> bool:
    """Give back the space of the samples moved out of `day`'s partition (None: DEFAULT, once
    its days' rows went to their own partitions): its rows left (a compacted day's: each
    device's first and last) copied into a new table that takes its place, the old one
    dropped, as retention drops a day (`metering.retention`). Neither a plain vacuum (the few
    rows left are spread over every page) nor VACUUM FULL or CLUSTER would do: those keep
    what any older snapshot may see, and a snapshot's horizon counts the transactions of
    every database on the server. Under the parent's lock, as a drop (ingest into every day
    waits for the moment it takes to copy the rows left), waiting at most
    TALLY_SAMPLE_PARTITION_LOCK_SECONDS for it; False when it could not have it."""
    name = partition_name(day) if day is not None else DEFAULT_PARTITION
    new = f"{name}_c"
    columns = ", ".join(field.column for field in Sample._meta.concrete_fields)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            lock_timeout(cursor)
            if day is None:
                bounds, check = "DEFAULT", ""
            else:
                start, end = day_bounds_ms(day)
                lock_day(day, cursor)
                bounds = f"FOR VALUES FROM ({start}) TO ({end})"
                # The check lets ATTACH skip scanning the new table (`create_day_partition`).
                check = f", CONSTRAINT {new}_range CHECK (ts_ms >= {start} AND ts_ms < {end})"
            cursor.execute(f"LOCK TABLE {PARENT} IN ACCESS EXCLUSIVE MODE")
            if day is not None and day not in sample_partitions():
                return True
            cursor.execute(f"CREATE TABLE {new} (LIKE {PARENT} INCLUDING DEFAULTS{check})")
            cursor.execute(
                f"INSERT INTO {new} ({columns}) SELECT {columns} FROM {name} ORDER BY "
                "device_uuid, ts_ms"
            )
            cursor.execute(f"DROP TABLE {name}")
            cursor.execute(f"ALTER TABLE {new} RENAME TO {name}")
            cursor.execute(f"ALTER TABLE {PARENT} ATTACH PARTITION {name} {bounds}")
            if check:
                cursor.execute(f"ALTER TABLE {name} DROP CONSTRAINT {new}_range")
            cursor.execute(f"ANALYZE {name}")
    except LockNotAvailable:
        return False
    return True


def partition_bloated(day: date | None) -> bool:
    """Whether `day`'s partition (None: DEFAULT) holds far more pages than its rows need: a
    compaction whose rewrite did not run (interrupted, or its lock busy), or DEFAULT once
    its days' rows were moved to their own partitions."""
    name = partition_name(day) if day is not None else DEFAULT_PARTITION
    with connection.cursor() as cursor:
        # Bloated: over a MiB, and more than twice what its rows take (each with its header
        # and item pointer, ~28 bytes).
        cursor.execute(
            f"SELECT pg_relation_size(%s), (SELECT coalesce(sum(pg_column_size(t.*) + 28), 0) "
            f"FROM {name} AS t)",
            [name],
        )
        size, used = cursor.fetchone()
    return bool(size > 1024 * 1024 and size > 2 * used)


def compact_samples(
    *, now: datetime | None = None, dry_run: bool = False, limit: int | None = None
) -> CompactionReport:
    """Compact every day partition before `compaction_horizon` (oldest first), at most
    `limit` days that have samples to move; dry, count what would move and change nothing.
    Idempotent, and safe to interrupt or run beside ingest, the rollup and retention."""
    now = now or timezone.now()
    report = CompactionReport()
    horizon = compaction_horizon(now)
    # A closed day's samples in DEFAULT are compacted too, once in a partition of their own
    # (what beat's `sample_retention` would make them hourly, `create_day_partition`).
    for day, count in sorted(default_days().items()):
        if day >= horizon or (limit is not None and len(report.partitioned) >= limit):
            continue
        if dry_run:
            report.partitioned[day] = count
            continue
        try:
            report.partitioned[day] = create_day_partition(day)
        except LockNotAvailable:
            report.busy.append(day)
    if not dry_run and partition_bloated(None):
        if rewrite_partition(None):
            report.default_rewritten = True
        else:
            report.default_busy = True
    days = sorted(day for day in sample_partitions() if day < horizon)
    done = 0
    for day in days:
        if limit is not None and done >= limit:
            break
        if dry_run:
            with connection.cursor() as cursor:
                cursor.execute(
                    _WOULD_MOVE_SQL.format(partition=partition_name(day), blocks=BLOCKS),
                    {"day": day_bounds_ms(day)[0]},
                )
                (count,) = cursor.fetchone()
            if count:
                report.moved[day] = count
                done += 1
            continue
        moved, made = compact_day(day)
        if moved:
            report.moved[day], report.blocks[day] = moved, made
            done += 1
        if moved or partition_bloated(day):
            (report.rewritten if rewrite_partition(day) else report.busy).append(day)
    if report.blocks:
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {BLOCKS}")
    if report.moved and not dry_run:
        log.info(
            "compacted %d sample(s) into %d block(s): %s",
            sum(report.moved.values()),
            sum(report.blocks.values()),
            ", ".join(str(day) for day in report.moved),
        )
    return report
