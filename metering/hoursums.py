"""Per device-hour sums kept as samples are written (`HourSum`), which the rollup reads for
every hour that has ended instead of scanning that hour's samples.

The rollup's per-hour sums (`metering.rollup._PER_HOUR_SQL`) of an hour that has ended depend
only on the samples whose own hour it is (and the hour before's, for what spills over): so
they can be added up as samples are written, and a sum only ever changes by what a statement
writes. Statement triggers on `billing_sample` (migration 0005) do that, in the writer's
transaction, from the statement's transition tables: each INSERT (and COPY), UPDATE (the gaps
ingest sets, a placement's merge) and DELETE (a placement's move) through the partitioned
table adds its new rows' spans and takes away its old rows'. Integer sums, as the rollup
makes them: the same whatever order the samples and their gaps arrive in.

What writes samples without changing a sum says so, or is not seen:

- a thaw (`metering.blocks.thaw_samples`) puts compacted samples back through the parent,
  setting `SKIP_SETTING` (transaction-local) as its rows go in: the trigger then skips that
  statement, and clears the setting, so the next statement is counted;
- compaction's moves into blocks, a day's rows moved out of DEFAULT
  (`metering.retention.create_day_partition`) and a partition's rewrite
  (`metering.compaction.rewrite_partition`) write the partitions themselves, which fires no
  trigger of the parent;
- retention's drop of a day (`metering.retention.drop_day_partition`) makes its hours'
  sums again from what is left of them (`refill_sums`: usually nothing);
- a TRUNCATE of `billing_sample` (tests, benchmarks) makes the sums again from what is left.

The sums are made under one hold (TALLY_SAMPLE_HOLD_SECONDS when they were made, recorded in
`HourSumState`). While the setting says another, the rollup scans samples as it did before
the sums (right, slower) and logs a warning once; `manage.py rebuild_sample_sums` makes the
sums again under the setting's hold, holding off every writer of samples meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from django.db import OperationalError, connection, transaction
from django.db.backends.utils import CursorWrapper

from metering.hours import sample_hold_ms
from metering.models import HourSum, HourSumState, Sample

log = logging.getLogger(__name__)

SUMS = HourSum._meta.db_table
STATE = HourSumState._meta.db_table
PARENT = Sample._meta.db_table
# The transaction-local setting the triggers read: 'on' while a statement moves samples
# without changing them (a thaw); the trigger that skips the statement clears it.
SKIP_SETTING = "tally.hoursum_skip"

_warned_hold: tuple[int | None, int] | None = None


def recorded_hold_ms(*, share: bool = False) -> int | None:
    """The hold the sums are made with; None when none is recorded (no sums are kept).

    `share`: the state's row locked FOR SHARE until the transaction ends, so that a rebuild
    (which rewrites that row) cannot commit sums made under another hold while the caller
    reads them; a rebuild already under way is waited for, and its hold read."""
    if not share:
        return HourSumState.objects.filter(id=1).values_list("hold_ms", flat=True).first()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT hold_ms FROM {STATE} WHERE id = 1 FOR SHARE")
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def sums_usable() -> bool:
    """Whether the sums are made under the hold the rollup works with now
    (`sample_hold_ms`); if not, a warning, once per process and pair of holds. Called in the
    rollup's transaction: the hold is read under a share lock (`recorded_hold_ms`), so the
    sums it then reads are the ones made under that hold."""
    global _warned_hold
    recorded, wanted = recorded_hold_ms(share=True), sample_hold_ms()
    if recorded == wanted:
        return True
    if _warned_hold != (recorded, wanted):
        _warned_hold = (recorded, wanted)
        log.warning(
            "per device-hour sums are made with a hold of %s ms, TALLY_SAMPLE_HOLD_SECONDS "
            "says %d ms: the rollup scans the samples instead (slower) until "
            "`manage.py rebuild_sample_sums` makes them again",
            recorded,
            wanted,
        )
    return False


def refill_sums(cursor: CursorWrapper, start_ms: int, end_ms: int) -> int:
    """Make the sums of the hours in `[start_ms, end_ms)` (hour-aligned) again from the
    samples stored in them now; how many rows. After a day's samples are dropped (a DROP
    fires no trigger): its sums go with them (what they spilled into the next day too, as the
    samples' spans do), but for samples of the day kept elsewhere (DEFAULT), usually none."""
    cursor.execute("SELECT metering_hoursum_fill(%s, %s)", [start_ms, end_ms])
    (made,) = cursor.fetchone()
    return int(made)


@dataclass
class RebuildReport:
    """What `rebuild_sums` did (or, dry, would do)."""

    recorded_hold_ms: int | None
    hold_ms: int
    rows_before: int
    rows_after: int | None  # None: a dry run


def rebuild_sums(*, dry_run: bool = False) -> RebuildReport:
    """Make every sum again from every sample stored (`billing_sample` and the compacted
    blocks) under the setting's hold, and record that hold; dry, say what is recorded and
    what would be, and change nothing.

    One transaction, holding `billing_sample` (every partition) and the blocks against
    writers (ingest, compaction, retention wait; readers go on): no statement can change a
    sample between the sums' delete and their remaking."""
    hold = sample_hold_ms()
    if dry_run:
        return _rebuild(hold, dry_run=True)
    for attempt in itertools.count(1):
        try:
            return _rebuild(hold, dry_run=False)
        except OperationalError as error:
            if getattr(error.__cause__, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            if attempt >= REBUILD_LOCK_TRIES:
                raise RebuildBusy(
                    f"could not lock the samples against writers in {attempt} tries of "
                    f"{REBUILD_LOCK_TIMEOUT_MS} ms each; run it again when ingest is quieter"
                ) from error
            time.sleep(min(0.1 * attempt, 2.0))
    raise AssertionError("unreachable")


# A rebuild takes its locks with a short timeout and tries again, rather than wait: a thaw
# locks the blocks and then `billing_sample` (and so does the rebuild, in that order), but
# compaction locks a day's partition and then the blocks, so a rebuild that waited could
# deadlock with it; giving up within the timeout, before PostgreSQL's deadlock check (1 s by
# default), leaves the other transaction to go on.
REBUILD_LOCK_TIMEOUT_MS = 500
REBUILD_LOCK_TRIES = 20
_LOCK_NOT_AVAILABLE = "55P03"


class RebuildBusy(Exception):
    """The rebuild could not lock the samples against writers in its tries."""


def _rebuild(hold: int, *, dry_run: bool) -> RebuildReport:
    with transaction.atomic(), connection.cursor() as cursor:
        if not dry_run:
            cursor.execute(
                "SELECT set_config('lock_timeout', %s, true)", [f"{REBUILD_LOCK_TIMEOUT_MS}ms"]
            )
            cursor.execute(
                f"LOCK TABLE metering_sampleblock, {PARENT}, {SUMS}, {STATE} "
                "IN SHARE ROW EXCLUSIVE MODE"
            )
            cursor.execute("SELECT set_config('lock_timeout', '0', true)")
        recorded = recorded_hold_ms()
        cursor.execute(f"SELECT count(*) FROM {SUMS}")
        (before,) = cursor.fetchone()
        if dry_run:
            return RebuildReport(recorded, hold, before, None)
        cursor.execute(
            f"INSERT INTO {STATE} (id, hold_ms) VALUES (1, %s) "
            "ON CONFLICT (id) DO UPDATE SET hold_ms = EXCLUDED.hold_ms",
            [hold],
        )
        cursor.execute("SELECT set_config('work_mem', '256MB', true)")
        cursor.execute("SELECT metering_hoursum_fill(NULL, NULL)")
        (after,) = cursor.fetchone()
    log.info(
        "per device-hour sums made again under a hold of %d ms (was %s): %d rows",
        hold,
        recorded,
        after,
    )
    return RebuildReport(recorded, hold, before, int(after))
