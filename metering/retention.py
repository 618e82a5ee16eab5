"""Raw samples age out: `billing_sample` is partitioned by UTC day, and a day is dropped whole.

Each UTC day's samples are one partition, `billing_sample_pYYYYMMDD` (`[day, day + 1)` in
milliseconds since the epoch, migration 0007). Beat's `billing.tasks.sample_retention` keeps
the partitions of today and TALLY_SAMPLE_PARTITIONS_AHEAD_DAYS days ahead made, so ingest
writes into a day's own table; rows of a day without one go to `billing_sample_default` and
are moved into their day's partition, made for them, on the next run (a clock far ahead, past
the days made, is left there and reported). A day is dropped, as one table, once it is older
than TALLY_SAMPLE_RETENTION_DAYS, and only when

- every billing period it overlaps is closed (closing rolls the period's hours up one last
  time and freezes its statements; a day no period was stored for yet is not billed yet):
  billing says so, through `RETENTION_HOLDS` (billing's AppConfig adds
  `billing.services.why_samples_kept`), metering knowing no period, and
- none of the hours its samples count in is marked dirty (`billing.models.DirtyHour`): late
  samples or allocations waiting for the rollup still need them. A sample holds into the
  next hour, so the first hour of the next day counts too.

Partitions are made with ATTACH PARTITION, which locks the parent table only against schema
changes: ingest goes on writing meanwhile. Dropping one locks the parent for a moment; each
schema change waits at most TALLY_SAMPLE_PARTITION_LOCK_SECONDS for its locks, and one that
cannot have them is left to the next run.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from django.conf import settings
from django.db import connection, models, transaction
from django.db.backends.utils import CursorWrapper
from django.db.models import Q
from django.utils import timezone
from psycopg.errors import LockNotAvailable

from db.locks import advisory_xact_lock
from metering.hoursums import refill_sums
from metering.models import DirtyHour, SampleBlock, UnknownDeviceSample

log = logging.getLogger(__name__)

PARENT = "billing_sample"
DEFAULT_PARTITION = "billing_sample_default"
MS_PER_DAY = 86_400_000
_EPOCH_DAY = date(1970, 1, 1)
_BOUNDS = re.compile(r"FOR VALUES FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")

# What else keeps a day's samples past TALLY_SAMPLE_RETENTION_DAYS: each is asked about the
# day's `[start, end)` and answers why its samples must stay ("" when they may go). The apps
# above metering add theirs when ready: billing, that the day is not billed by closed periods
# yet (`billing.services.why_samples_kept`).
RETENTION_HOLDS: list[Callable[[datetime, datetime], str]] = []


def partition_name(day: date) -> str:
    """The partition that holds `day`'s samples: `billing_sample_p20261204`."""
    return f"{PARENT}_p{day:%Y%m%d}"


def day_bounds_ms(day: date) -> tuple[int, int]:
    """The UTC day `[start, end)` in milliseconds since the epoch: a partition's bounds."""
    start = (day - _EPOCH_DAY).days * MS_PER_DAY
    return start, start + MS_PER_DAY


def day_of_ms(ts_ms: int) -> date:
    """The UTC day holding the instant `ts_ms`."""
    return _EPOCH_DAY + timedelta(days=ts_ms // MS_PER_DAY)


def sample_partitions() -> dict[date, str]:
    """The day partitions of `billing_sample`, by day (DEFAULT left out), read from the
    catalogue: a partition whose bounds are not one UTC day is not one of ours, and ignored."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits AS i "
            "JOIN pg_class AS c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
            [PARENT],
        )
        rows = cursor.fetchall()
    days = {}
    for name, bound in rows:
        found = _BOUNDS.search(bound)
        if found is None:
            continue
        start, end = int(found[1]), int(found[2])
        if start % MS_PER_DAY == 0 and end - start == MS_PER_DAY:
            days[day_of_ms(start)] = name
    return days


def lock_timeout(cursor: CursorWrapper) -> None:
    seconds = int(settings.TALLY_SAMPLE_PARTITION_LOCK_SECONDS)
    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{seconds}s"])


def create_day_partition(day: date) -> int:
    """Make `day`'s partition unless it exists, moving the day's rows out of DEFAULT into it;
    how many rows moved (0 when it existed).

    One transaction: the new table is filled from DEFAULT, whose inserts wait meanwhile,
    then attached. Ingest into every other partition goes on (ATTACH locks the parent only
    against schema changes). `LockNotAvailable` when the locks are not had within
    TALLY_SAMPLE_PARTITION_LOCK_SECONDS.
    """
    name = partition_name(day)
    start, end = day_bounds_ms(day)
    with transaction.atomic(), connection.cursor() as cursor:
        lock_timeout(cursor)
        # The parent first, then DEFAULT: every run takes them in this order, and ingest
        # holds nothing a run waits for while waiting itself.
        cursor.execute(f"LOCK TABLE {PARENT} IN SHARE UPDATE EXCLUSIVE MODE")
        if day in sample_partitions():
            return 0
        cursor.execute(f"LOCK TABLE {DEFAULT_PARTITION} IN ACCESS EXCLUSIVE MODE")
        # The check lets ATTACH skip scanning the new table; it is dropped once attached.
        cursor.execute(
            f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS, "
            f"CONSTRAINT {name}_range CHECK (ts_ms >= {start} AND ts_ms < {end}))"
        )
        cursor.execute(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} "
            f"WHERE ts_ms >= {start} AND ts_ms < {end} RETURNING *) "
            f"INSERT INTO {name} SELECT * FROM moved"
        )
        moved = cursor.rowcount
        cursor.execute(
            f"ALTER TABLE {PARENT} ATTACH PARTITION {name} FOR VALUES FROM ({start}) TO ({end})"
        )
        cursor.execute(f"ALTER TABLE {name} DROP CONSTRAINT {name}_range")
    if moved:
        log.info("moved %d samples of %s out of %s into %s", moved, day, DEFAULT_PARTITION, name)
    return moved


def why_kept(day: date, *, now: datetime) -> str:
    """Why `day`'s samples may not be dropped at `now`; "" when they may (see the module)."""
    cutoff = retention_cutoff(now)
    if day >= cutoff:
        return f"younger than TALLY_SAMPLE_RETENTION_DAYS ({cutoff} and later are kept)"
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    end = start + timedelta(days=1)
    for hold in RETENTION_HOLDS:
        if why := hold(start, end):
            return why
    # A sample holds into the next hour: the next day's first hour counts it too.
    dirty = DirtyHour.objects.filter(hour__gte=start, hour__lte=end).order_by("hour").first()
    if dirty is not None:
        return f"hour {dirty} is still to be rolled up"
    return ""


def retention_cutoff(now: datetime) -> date:
    """The oldest day kept whatever else holds: days before it may be dropped."""
    return now.astimezone(UTC).date() - timedelta(days=int(settings.TALLY_SAMPLE_RETENTION_DAYS))


def lock_day(day: date, cursor: CursorWrapper) -> None:
    """Hold `day`'s lock to the end of the transaction: compaction's batches, its rewrite of
    the day's partition and retention's drop of the day take it, one after another."""
    advisory_xact_lock("metering.compact.day", {day_bounds_ms(day)[0] // MS_PER_DAY}, cursor=cursor)


def drop_day_partition(day: date) -> bool:
    """Drop `day`'s partition, its samples with it, its compacted samples' blocks
    (`metering.compaction`) and its per device-hour sums (`metering.hoursums`), in one
    transaction; False when neither was there.
    `LockNotAvailable` when the parent's lock is not had in time."""
    start, end = day_bounds_ms(day)
    with transaction.atomic(), connection.cursor() as cursor:
        lock_timeout(cursor)
        # After a compaction of the day that holds it, whose blocks are then deleted here.
        lock_day(day, cursor)
        cursor.execute(f"LOCK TABLE {PARENT} IN ACCESS EXCLUSIVE MODE")
        cursor.execute(f"DELETE FROM {SampleBlock._meta.db_table} WHERE day_ms = %s", [start])
        blocks = cursor.rowcount
        dropped = day in sample_partitions()
        if dropped:
            cursor.execute(f"DROP TABLE {partition_name(day)}")
        # The day's per device-hour sums go with its samples (a DROP fires no trigger).
        if dropped or blocks:
            refill_sums(cursor, start, end)
    return dropped or blocks > 0


def _block_days(*, before: date) -> set[date]:
    """The days before `before` that compacted samples' blocks are of."""
    end, _ = day_bounds_ms(before)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT DISTINCT day_ms FROM {SampleBlock._meta.db_table} WHERE day_ms < %s", [end]
        )
        return {day_of_ms(day_ms) for (day_ms,) in cursor.fetchall()}


def default_days() -> dict[date, int]:
    """The days that rows in DEFAULT fall in, and how many rows each."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT floor(ts_ms / {MS_PER_DAY}.0)::bigint, count(*) FROM {DEFAULT_PARTITION} "
            "GROUP BY 1 ORDER BY 1"
        )
        return {_EPOCH_DAY + timedelta(days=days): count for days, count in cursor.fetchall()}


@dataclass
class PartitionReport:
    """What one `maintain_sample_partitions` did, and what it left."""

    created: list[date] = field(default_factory=list)
    dropped: list[date] = field(default_factory=list)
    moved_from_default: int = 0
    # Rows left in DEFAULT (a clock past the days made ahead), by day.
    left_in_default: dict[date, int] = field(default_factory=dict)
    # Days past retention kept, and why (`why_kept`).
    kept: dict[date, str] = field(default_factory=dict)
    # Partitions whose locks were not had in time: left to the next run.
    busy: list[date] = field(default_factory=list)
    unknown_device_samples_deleted: int = 0


def maintain_sample_partitions(*, now: datetime | None = None) -> PartitionReport:
    """Make the partitions of today and TALLY_SAMPLE_PARTITIONS_AHEAD_DAYS ahead; move rows
    DEFAULT holds into their day's partition (made for them), up to that horizon; drop the
    days past TALLY_SAMPLE_RETENTION_DAYS that may go (`why_kept`). Idempotent; each
    partition is its own transaction, and one whose locks are busy is left for the next run.
    """
    now = now or timezone.now()
    report = PartitionReport()
    today = now.astimezone(UTC).date()
    horizon = today + timedelta(days=int(settings.TALLY_SAMPLE_PARTITIONS_AHEAD_DAYS))
    existing = sample_partitions()
    wanted = {today + timedelta(days=ahead) for ahead in range((horizon - today).days + 1)}
    stray = default_days()
    for day, count in stray.items():
        if day > horizon:
            report.left_in_default[day] = count
        else:
            wanted.add(day)
    for day in sorted(wanted):
        if day in existing:
            continue
        try:
            report.moved_from_default += create_day_partition(day)
        except LockNotAvailable:
            report.busy.append(day)
            continue
        report.created.append(day)
        existing[day] = partition_name(day)
    # A compacted day keeps its partition (each device's first and last sample); blocks of a
    # day without one (none is made so, but a partition dropped by hand) go the same way.
    for day in sorted(existing.keys() | _block_days(before=retention_cutoff(now))):
        if day >= retention_cutoff(now):
            break
        why = why_kept(day, now=now)
        if why:
            report.kept[day] = why
            continue
        try:
            if drop_day_partition(day):
                report.dropped.append(day)
        except LockNotAvailable:
            report.busy.append(day)
    if report.created or report.dropped:
        # Autovacuum analyses partitions, never the partitioned table: the planner's row
        # counts and (device, hour) groups for the rollup's scans are the parent's.
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {PARENT}")
    if report.left_in_default:
        log.warning(
            "%d samples in %s are dated past the partitions made ahead (%s): a clock "
            "running fast? They stay there until their day comes",
            sum(report.left_in_default.values()),
            DEFAULT_PARTITION,
            ", ".join(str(day) for day in report.left_in_default),
        )
    if report.dropped:
        log.info("dropped the samples of %s", ", ".join(str(day) for day in report.dropped))
    return report


def delete_in_batches(rows: Q, *, model: type[models.Model], batch: int | None = None) -> int:
    """Delete the rows of `model` matching `rows`, `batch` (default
    TALLY_RETENTION_BATCH) at a time, each batch its own transaction (so a large backlog never
    holds its locks, or one huge transaction's WAL, for long); how many. Django's delete, so
    what cascades from them goes too."""
    size = int(batch or settings.TALLY_RETENTION_BATCH)
    deleted = 0
    while True:
        with transaction.atomic():
            ids = list(
                model._default_manager.filter(rows)
                .order_by("pk")
                .values_list("pk", flat=True)[:size]
            )
            if not ids:
                return deleted
            model._default_manager.filter(pk__in=ids).delete()
            deleted += len(ids)
        if len(ids) < size:
            return deleted


def purge_unknown_device_samples(*, now: datetime) -> int:
    """Delete, in batches, the samples set aside (`UnknownDeviceSample`) that no device
    claimed within TALLY_INGEST_UNKNOWN_RETENTION_DAYS of their arrival; how many. Beat's
    rollup (`services.refresh_usage`) and `sample_retention` run it."""
    cutoff = now - timedelta(days=int(settings.TALLY_INGEST_UNKNOWN_RETENTION_DAYS))
    return delete_in_batches(Q(received_at__lt=cutoff), model=UnknownDeviceSample)


def apply_sample_retention(*, now: datetime) -> PartitionReport:
    """What beat's `sample_retention` does: `maintain_sample_partitions`, then
    `purge_unknown_device_samples`; both idempotent."""
    report = maintain_sample_partitions(now=now)
    report.unknown_device_samples_deleted = purge_unknown_device_samples(now=now)
    return report
