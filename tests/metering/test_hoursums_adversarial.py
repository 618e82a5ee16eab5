"""Adversarial checks of the per device-hour sums (`metering.hoursums`, migration 0005): writes
of `billing_sample` the branch's own tests do not make (rows moved between partitions and
devices by an UPDATE, several modifications in one statement, the skip setting of a thaw left
behind by a statement that failed, ON CONFLICT merges, a mean's covered time, utilisation
that goes from none to some and back), a day dropped whose last samples spill into the next,
hours ended and in progress against the scanning path, the hold changed and rebuilt, the
migration applied over stored samples and blocks, and concurrent ingests on their own
connections. Each compares the sums with a recompute from the samples
(`tests.metering.sums_check`), or the rollup's rows from the sums with those scanning gives."""

from __future__ import annotations

import threading
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from metering import hoursums
from metering.blocks import thaw_samples
from metering.compaction import compact_samples
from metering.hours import MS_PER_HOUR, epoch_ms
from metering.ingest import SampleRow, ingest
from metering.models import HourSumState
from metering.retention import create_day_partition, day_bounds_ms, drop_day_partition
from tests.factories import AllocationFactory, DeviceFactory
from tests.metering.sums_check import assert_sums_right, recomputed_sums, stored_sums
from tests.metering.test_hoursums import both_ways, day_start, samples, send, today

pytestmark = pytest.mark.django_db

MINUTE = 60_000


def put(
    uuid: str, ts: int, util: float | None, gap: int | None = None, covered: int | None = None
) -> None:
    """One sample written straight into the parent, as any SQL writer would."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at, gap_ms, "
            "covered_ms) VALUES (%s, %s, %s, '', now(), %s, %s)",
            [uuid, ts, util, gap, covered],
        )


def run(sql: str, params: Any = ()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, list(params))


def hour_start(day: date, hour: int) -> int:
    return day_bounds_ms(day)[0] + hour * MS_PER_HOUR


# --- UPDATEs through the parent -----------------------------------------------------------


def test_an_update_moving_rows_between_day_partitions_and_default() -> None:
    """ts_ms changed by an UPDATE of the parent: the rows move partition (DELETE + INSERT
    inside PostgreSQL), and the sums must follow them to their new hour."""
    old, older = today() - timedelta(days=3), today() - timedelta(days=4)
    create_day_partition(old)
    create_day_partition(older)
    start = hour_start(old, 5)
    for index in range(10):
        put("gpu-move", start + index * MINUTE, 40.0 + index, MINUTE)
    assert_sums_right()
    # Into the day before's partition, into DEFAULT (a day without one), and within the day.
    run("UPDATE billing_sample SET ts_ms = ts_ms - 86400000 WHERE ts_ms < %s", [start + 3 * MINUTE])
    run(
        "UPDATE billing_sample SET ts_ms = ts_ms + 20 * 86400000 WHERE device_uuid = 'gpu-move' "
        "AND ts_ms >= %s AND ts_ms < %s",
        [start + 3 * MINUTE, start + 6 * MINUTE],
    )
    run(
        "UPDATE billing_sample SET ts_ms = ts_ms + 3 * %s WHERE ts_ms >= %s AND ts_ms < %s",
        [MS_PER_HOUR, start + 6 * MINUTE, start + 9 * MINUTE],
    )
    assert_sums_right()
    # And back out of DEFAULT.
    run(
        "UPDATE billing_sample SET ts_ms = ts_ms - 20 * 86400000 WHERE ts_ms > %s",
        [start + 86400000],
    )
    assert_sums_right()


def test_an_update_changing_a_samples_device() -> None:
    start = hour_start(today() - timedelta(days=1), 3)
    for index in range(6):
        put("gpu-a", start + index * 10 * MINUTE + 7, 25.5, 10 * MINUTE, 90_000)
    run("UPDATE billing_sample SET device_uuid = 'gpu-b' WHERE ts_ms > %s", [start + 25 * MINUTE])
    assert_sums_right()
    assert {key[0] for key in stored_sums()} == {"gpu-a", "gpu-b"}


def test_updates_of_utilisation_gap_and_covered_time() -> None:
    """NULL utilisation to some and back, a mean's covered time shortened and lengthened
    past the hold, a gap cleared (its span then the hold or the covered time)."""
    start = hour_start(today() - timedelta(days=1), 10) + 50 * MINUTE
    for index in range(20):
        put("gpu-c", start + index * MINUTE, None if index % 3 else 12.345678, MINUTE, None)
    run("UPDATE billing_sample SET gpu_util = 99.9999995 WHERE gpu_util IS NULL")
    assert_sums_right()
    run("UPDATE billing_sample SET covered_ms = 1000 WHERE ts_ms %% 2 = 0")
    run("UPDATE billing_sample SET covered_ms = 10 * 3600000, gap_ms = NULL WHERE ts_ms %% 3 = 0")
    assert_sums_right()
    run("UPDATE billing_sample SET gpu_util = NULL WHERE ts_ms %% 5 = 0")
    run("UPDATE billing_sample SET gap_ms = gap_ms + 3600000")  # past the hour and the hold
    assert_sums_right()


def test_a_delete_through_the_parent() -> None:
    start = hour_start(today() - timedelta(days=2), 0)
    for index in range(30):
        put("gpu-d", start + index * 3 * MINUTE - 5 * MINUTE, 60.0, 3 * MINUTE)
    run("DELETE FROM billing_sample WHERE ts_ms %% 2 = 0")
    assert_sums_right()


# --- several modifications in one statement -----------------------------------------------


def test_two_modifications_of_billing_sample_in_one_statement() -> None:
    """A data-modifying CTE and its outer statement both writing the parent: each event's
    trigger must see all of its rows (PostgreSQL shares one transition table per event)."""
    start = hour_start(today() - timedelta(days=1), 6)
    for index in range(10):
        put("gpu-e", start + index * MINUTE, 30.0, MINUTE)
    run(
        "WITH moved AS (DELETE FROM billing_sample WHERE device_uuid = 'gpu-e' AND ts_ms < %s "
        "RETURNING *) "
        "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at, gap_ms) "
        "SELECT 'gpu-f', ts_ms + 7, gpu_util, node, received_at, gap_ms FROM moved",
        [start + 5 * MINUTE],
    )
    assert_sums_right()
    run(
        "WITH a AS (INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at, "
        "gap_ms) VALUES ('gpu-g', %s, 10, '', now(), 60000) RETURNING 1) "
        "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at, gap_ms) "
        "VALUES ('gpu-g', %s, 20, '', now(), 60000)",
        [start + 3, start + MINUTE + 3],
    )
    assert_sums_right()
    run(
        "WITH u AS (UPDATE billing_sample SET gpu_util = 1 WHERE device_uuid = 'gpu-g' "
        "RETURNING 1) UPDATE billing_sample SET gap_ms = 1000 WHERE device_uuid = 'gpu-f'"
    )
    assert_sums_right()


def test_on_conflict_do_update_in_a_cte_as_ingest_writes_it() -> None:
    """`store_batch`'s shape: INSERT ... ON CONFLICT DO UPDATE ... WHERE, in a CTE with
    RETURNING: the update trigger sees the merged rows, the insert trigger the new ones."""
    start = hour_start(today() - timedelta(days=1), 8)
    for index in range(5):
        run(
            "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at, gap_ms, "
            "placed_gpu_instance) VALUES ('gpu-h', %s, 5, '', now(), 60000, 1)",
            [start + index * MINUTE],
        )
    run(
        "WITH inserted AS (INSERT INTO billing_sample AS s (device_uuid, ts_ms, gpu_util, node, "
        "received_at, gap_ms, covered_ms) SELECT 'gpu-h', %s + g * 60000, 77.7, '', now(), 60000, "
        "30000 FROM generate_series(0, 9) AS g "
        "ON CONFLICT (device_uuid, ts_ms) DO UPDATE SET gpu_util = COALESCE(excluded.gpu_util, "
        "s.gpu_util), covered_ms = excluded.covered_ms, placed_gpu_instance = NULL "
        "WHERE s.placed_gpu_instance IS NOT NULL RETURNING ts_ms) SELECT count(*) FROM inserted",
        [start],
    )
    assert_sums_right()
    # The same again: every row conflicts, none is placed now, nothing changes.
    before = stored_sums()
    run(
        "INSERT INTO billing_sample AS s (device_uuid, ts_ms, gpu_util, node, received_at) "
        "SELECT 'gpu-h', %s + g * 60000, 1, '', now() FROM generate_series(0, 9) AS g "
        "ON CONFLICT (device_uuid, ts_ms) DO UPDATE SET gpu_util = 2 "
        "WHERE s.placed_gpu_instance IS NOT NULL",
        [start],
    )
    assert stored_sums() == before
    assert_sums_right()


def test_writes_into_a_partition_whose_columns_lie_in_another_order() -> None:
    """A day partition attached with its columns in another physical order (as one made by
    hand, or before a column was added to the parent): rows routed to it, updated and moved
    out of it go through PostgreSQL's conversion to the parent's row type in the transition
    tables."""
    day = today() - timedelta(days=25)
    start, end = day_bounds_ms(day)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT string_agg(quote_ident(attname) || ' ' || format_type(atttypid, atttypmod) "
            "|| CASE WHEN attcollation = 950 THEN ' COLLATE \"C\"' ELSE '' END "
            "|| CASE WHEN attnotnull THEN ' NOT NULL' ELSE '' END, "
            "', ' ORDER BY attnum DESC) FROM pg_attribute "
            "WHERE attrelid = 'billing_sample'::regclass "
            "AND attnum > 0 AND NOT attisdropped"
        )
        (columns,) = cursor.fetchone()
        cursor.execute(f"CREATE TABLE billing_sample_p{day:%Y%m%d} ({columns}, junk int)")
        cursor.execute(f"ALTER TABLE billing_sample_p{day:%Y%m%d} DROP COLUMN junk")
        cursor.execute(
            f"ALTER TABLE billing_sample ATTACH PARTITION billing_sample_p{day:%Y%m%d} "
            f"FOR VALUES FROM ({start}) TO ({end})"
        )
    for index in range(12):
        put(
            "gpu-l",
            start + 23 * MS_PER_HOUR + index * 5 * MINUTE,
            10.0 + index,
            5 * MINUTE,
            200_000,
        )
    assert_sums_right()
    run(
        "UPDATE billing_sample SET gpu_util = gpu_util * 2, gap_ms = gap_ms - 1 "
        "WHERE device_uuid = 'gpu-l'"
    )
    assert_sums_right()
    # Half of them out, into DEFAULT (the next day has no partition).
    run("UPDATE billing_sample SET ts_ms = ts_ms + 2 * 3600000 WHERE gpu_util > 40")
    assert_sums_right()
    run("DELETE FROM billing_sample WHERE device_uuid = 'gpu-l' AND ts_ms %% 600000 = 0")
    assert_sums_right()


def test_a_merge_into_the_parent() -> None:
    """No writer uses MERGE today; one that did must be counted (inserted, updated and deleted
    rows alike)."""
    start = hour_start(today() - timedelta(days=1), 15)
    for index in range(6):
        put("gpu-m", start + index * MINUTE, 20.0, MINUTE)
    run(
        "MERGE INTO billing_sample AS s USING (SELECT 'gpu-m' AS uuid, %s + g * 60000 AS ts, "
        "g FROM generate_series(0, 9) AS g) AS n ON s.device_uuid = n.uuid AND s.ts_ms = n.ts "
        "WHEN MATCHED AND n.g %% 2 = 0 THEN UPDATE SET gpu_util = 90 "
        "WHEN MATCHED THEN DELETE "
        "WHEN NOT MATCHED THEN INSERT (device_uuid, ts_ms, gpu_util, node, received_at, gap_ms) "
        "VALUES (n.uuid, n.ts, 70, '', now(), 60000)",
        [start],
    )
    assert_sums_right()


# --- the thaw's skip setting ---------------------------------------------------------------


def test_a_skip_left_by_a_failed_statement_is_undone_with_its_savepoint() -> None:
    """A thaw-like statement sets the skip and then fails: rolled back to its savepoint, the
    setting must not make the next statement's samples go uncounted."""
    start = hour_start(today() - timedelta(days=1), 2)
    put("gpu-i", start, 50.0, MINUTE)
    with pytest.raises(DatabaseError), transaction.atomic():
        # Sets the skip, then meets the stored sample: a unique violation.
        run(
            "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at) "
            "SELECT 'gpu-i', %s, 1, '', now() WHERE set_config('tally.hoursum_skip', 'on', "
            "true) = 'on'",
            [start],
        )
    put("gpu-i", start + MINUTE, 70.0, MINUTE)
    assert_sums_right()


def test_a_skip_set_outside_a_thaw_is_honoured_by_the_next_write() -> None:
    """The setting set by a statement that is not an insert into the parent (a SELECT, an
    insert into another table): no trigger of the parent clears it, and the next write of
    samples must still be counted. (A thaw sets it only as its rows go in; this is what
    would happen if a future writer set it otherwise.)"""
    start = hour_start(today() - timedelta(days=1), 4)
    run("SELECT set_config('tally.hoursum_skip', 'on', true)")
    put("gpu-j", start, 50.0, MINUTE)
    leaked = stored_sums().get(("gpu-j", start // MS_PER_HOUR)) is None
    run("SELECT set_config('tally.hoursum_skip', '', true)")
    # Documented behaviour, recorded rather than asserted as a bug: the skip is honoured by
    # whatever statement comes next.
    assert leaked
    with connection.cursor() as cursor:
        cursor.execute("SELECT metering_hoursum_fill(NULL, NULL)")


def test_a_thaw_of_nothing_leaves_the_next_write_counted() -> None:
    day = today() - timedelta(days=20)
    lo = day_bounds_ms(day)[0]
    with connection.cursor() as cursor:
        thaw_samples(cursor, {})
    put("gpu-k", lo + 10 * MINUTE, 33.0, MINUTE)
    assert_sums_right()


def test_late_samples_among_compacted_ones_with_a_failed_batch_in_between() -> None:
    """A thaw (skipped), then a failing statement under a savepoint, then ingest of the
    same day: every sum stays a recompute's."""
    gpu = DeviceFactory.create()
    day = today() - timedelta(days=12)
    create_day_partition(day)
    start = day_bounds_ms(day)[0]
    send(samples(gpu, start, 200, seed=5))
    compact_samples()
    assert_sums_right()
    with transaction.atomic(), connection.cursor() as cursor:
        thaw_samples(cursor, {gpu.meter_id: (start + 30 * MINUTE, start + 40 * MINUTE)})
    assert_sums_right()
    send(samples(gpu, start + 31 * MINUTE, 30, seed=6))
    assert_sums_right()


# --- ingest ---------------------------------------------------------------------------------


def test_ingest_replays_merges_and_batches_that_fall_back_to_the_general_way() -> None:
    gpu = DeviceFactory.create()
    start = hour_start(today() - timedelta(days=1), 13)
    rows = samples(gpu, start, 80, seed=9)
    send(rows[::2])  # the COPY
    send(rows)  # meets stored samples: the general way, gaps refreshed
    send(rows[10:30] + rows[10:30])  # repeats in the batch
    send([row._replace(gpu_util=None) for row in rows[40:60]])  # replays without utilisation
    assert_sums_right()


def test_a_sample_at_an_hour_boundary_and_spans_of_the_whole_hold() -> None:
    gpu = DeviceFactory.create()
    base = hour_start(today() - timedelta(days=1), 20)
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=3600):
        call_command("rebuild_sample_sums")
        send(
            [
                SampleRow(gpu.meter_id, base - 1, 10.0, None, None),
                SampleRow(gpu.meter_id, base, 20.0, None, None),
                SampleRow(gpu.meter_id, base + 1, 30.0, None, None, 3_600_000),
                SampleRow(gpu.meter_id, base + MS_PER_HOUR + 1, 40.0, None, None),
                SampleRow(gpu.meter_id, base + 3 * MS_PER_HOUR - 1, 50.5, None, None),
            ]
        )
        assert_sums_right()
        AllocationFactory.create(device=gpu, start=day_start(today() - timedelta(days=1)), end=None)
        first = datetime.fromtimestamp(base // 1000, tz=UTC) - timedelta(hours=1)
        both_ways([first + timedelta(hours=index) for index in range(5)])
    call_command("rebuild_sample_sums")


# --- the rollup: ended hours, the hour in progress ----------------------------------------


@pytest.mark.parametrize("offset_s", [0, 1, 59, 61, 119, 121, 1799, 3599])
def test_a_window_ending_mid_hour_matches_scanning(offset_s: int) -> None:
    """`now` just past an hour's start: the last hour's spill from the hour before cut at
    now, a device whose only sample of the hour before spills into the hour in progress and
    which has no sample in it."""
    gpus = [DeviceFactory.create() for _ in range(3)]
    start = day_start(today() - timedelta(days=1))
    for gpu in gpus:
        AllocationFactory.create(device=gpu, start=start, end=None)
    now = start + timedelta(hours=5, seconds=offset_s)
    end = epoch_ms(start + timedelta(hours=5))
    send(samples(gpus[0], epoch_ms(start), 250, seed=21))
    send([SampleRow(gpus[1].meter_id, end - 90_000, 64.5, None, None)])
    send(
        [
            SampleRow(gpus[2].meter_id, end - 3 * MINUTE, 11.0, None, None),
            SampleRow(gpus[2].meter_id, end + 1_000, 12.0, None, None),
        ]
    )
    hours = [start + timedelta(hours=index) for index in range(6)]
    billed = both_ways(hours, now=now)
    assert any(row[0] == hours[-1] and row[3] for row in billed) or offset_s == 0
    # Windows of one and two hours ending at now too.
    both_ways(hours[-1:], now=now)
    both_ways(hours[-2:], now=now)


def test_a_window_ending_on_an_hour_boundary_with_a_device_spilling_past_it() -> None:
    gpu = DeviceFactory.create()
    start = day_start(today() - timedelta(days=1))
    AllocationFactory.create(device=gpu, start=start, end=None)
    end = epoch_ms(start + timedelta(hours=3))
    send([SampleRow(gpu.meter_id, end - 30_000, 80.0, None, None)])
    both_ways(
        [start + timedelta(hours=index) for index in range(4)], now=start + timedelta(hours=3)
    )
    both_ways([start + timedelta(hours=index) for index in range(4)])


def test_a_window_reaching_past_now_matches_scanning() -> None:
    """Hours asked for that lie past `now` (the window ends at now, mid-hour, before them)."""
    gpu = DeviceFactory.create()
    start = day_start(today() - timedelta(days=1))
    AllocationFactory.create(device=gpu, start=start, end=None)
    send(samples(gpu, epoch_ms(start), 200, seed=51))
    now = start + timedelta(hours=2, minutes=41)
    both_ways([start + timedelta(hours=index) for index in range(6)], now=now)
    both_ways([start + timedelta(hours=index) for index in range(1, 4)], now=now)


# --- retention -----------------------------------------------------------------------------


def test_a_dropped_day_whose_last_samples_spill_into_the_next() -> None:
    gpu = DeviceFactory.create()
    old = today() - timedelta(days=40)
    nxt = old + timedelta(days=1)
    create_day_partition(old)
    create_day_partition(nxt)
    end = day_bounds_ms(old)[1]
    AllocationFactory.create(device=gpu, start=day_start(old), end=None)
    send(
        [
            SampleRow(gpu.meter_id, end - 60_000 + index * 10_000, 50.0, None, None)
            for index in range(5)
        ]
    )
    send([SampleRow(gpu.meter_id, end + 200_000, 10.0, None, None)])
    hours = [day_start(nxt) + timedelta(hours=index) for index in range(2)]
    both_ways(hours)
    assert drop_day_partition(old)
    assert_sums_right()
    both_ways(hours)


def test_dropping_a_day_whose_samples_are_in_default() -> None:
    """No partition for the day (its samples in DEFAULT), only its blocks: the refill keeps
    the DEFAULT samples' sums."""
    gpu = DeviceFactory.create()
    old = today() - timedelta(days=41)
    start = day_bounds_ms(old)[0]
    send(samples(gpu, start, 40, seed=31))
    assert_sums_right()
    drop_day_partition(old)
    assert_sums_right()


def test_truncating_the_blocks_alone() -> None:
    """A TRUNCATE of the blocks fires no trigger of `billing_sample`: their samples' sums
    stay. Recorded (a writer that does it must rebuild), not a path production takes."""
    gpu = DeviceFactory.create()
    day = today() - timedelta(days=13)
    create_day_partition(day)
    send(samples(gpu, day_bounds_ms(day)[0], 100, seed=8))
    compact_samples()
    run("TRUNCATE metering_sampleblock")
    stale = stored_sums() != recomputed_sums()
    hoursums.rebuild_sums()
    assert_sums_right()
    assert stale


# --- the hold -------------------------------------------------------------------------------


def test_the_hold_changed_the_rollup_scans_then_rebuilt_it_reads_right_sums() -> None:
    gpu = DeviceFactory.create()
    start = day_start(today() - timedelta(days=1))
    AllocationFactory.create(device=gpu, start=start, end=None)
    send(samples(gpu, epoch_ms(start), 300, seed=13))
    hours = [start + timedelta(hours=index) for index in range(6)]
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=45):
        assert not hoursums.sums_usable()
        send(samples(gpu, epoch_ms(start) + 7 * MS_PER_HOUR, 50, seed=14))  # under the old hold
        call_command("rebuild_sample_sums")
        assert HourSumState.objects.get(id=1).hold_ms == 45_000
        assert_sums_right()
        send(samples(gpu, epoch_ms(start) + 9 * MS_PER_HOUR, 50, seed=15))
        assert_sums_right()
        both_ways(hours)
    call_command("rebuild_sample_sums")
    assert_sums_right()


# --- the migration over stored samples and blocks -----------------------------------------


def test_the_migration_over_stored_samples_and_blocks() -> None:
    gpu = DeviceFactory.create()
    day = today() - timedelta(days=14)
    create_day_partition(day)
    send(samples(gpu, day_bounds_ms(day)[0], 150, seed=3))
    send(samples(gpu, epoch_ms(day_start(today())), 30, seed=4))
    compact_samples()
    expected = recomputed_sums()
    call_command("migrate", "metering", "0004", verbosity=0)
    send(samples(gpu, day_bounds_ms(day)[0] + 5 * MS_PER_HOUR, 20, seed=5))  # no triggers now
    call_command("migrate", "metering", verbosity=0)
    assert_sums_right()
    assert stored_sums() != expected  # the samples written meanwhile are counted


# --- concurrency ---------------------------------------------------------------------------


@pytest.fixture
def sums_kept() -> None:
    """A transactional test's database was flushed by the one before (`metering_hoursumstate`
    emptied, so no sums kept): the sums made again under the setting's hold first."""
    hoursums.rebuild_sums()


def _in_threads(jobs: list[Any]) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def work(job: Any) -> None:
        try:
            barrier.wait()
            job()
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.django_db(transaction=True)
def test_concurrent_ingests_of_the_same_and_other_devices_in_one_hour(sums_kept: None) -> None:
    gpus = [DeviceFactory.create() for _ in range(4)]
    start = hour_start(today() - timedelta(days=1), 9)
    batches = []
    for round_ in range(3):
        for index, gpu in enumerate(gpus):
            rows = samples(gpu, start + round_ * 7 * MINUTE, 25, seed=100 * round_ + index)
            # Every batch holds two devices, in opposite orders, all in the same hour.
            other = gpus[(index + 1) % len(gpus)]
            rows += samples(other, start + round_ * 11 * MINUTE, 25, seed=7 + round_ + index)
            batches.append(rows[::-1] if index % 2 else rows)

    def job(rows: list[SampleRow]) -> Any:
        return lambda: ingest(node="node-a", samples=rows, received_at=timezone.now())

    errors = _in_threads([job(rows) for rows in batches])
    assert not errors, errors
    assert_sums_right()


@pytest.mark.django_db(transaction=True)
def test_many_concurrent_ingests_replays_and_late_samples(sums_kept: None) -> None:
    """Eight connections at once, each a batch of three devices out of four over two hours
    (in either order), replays of each other's samples, late samples among them."""
    gpus = [DeviceFactory.create() for _ in range(4)]
    start = hour_start(today() - timedelta(days=1), 14) + 40 * MINUTE
    everything = [samples(gpu, start, 60, seed=200 + index) for index, gpu in enumerate(gpus)]
    batches = []
    for index in range(8):
        rows = [
            row for k in range(3) for row in everything[(index + k) % 4][index % 3 :: 2 + index % 2]
        ]
        batches.append(rows[::-1] if index % 2 else rows)

    def job(rows: list[SampleRow]) -> Any:
        return lambda: ingest(node="node-a", samples=rows, received_at=timezone.now())

    for _ in range(2):
        errors = _in_threads([job(rows) for rows in batches])
        assert not errors, errors
        assert_sums_right()


@pytest.mark.django_db(transaction=True)
def test_concurrent_late_samples_into_a_compacted_day(sums_kept: None) -> None:
    """Thaws on several connections at once (each skips its own statement only), with a
    compaction and a rebuild of the sums in between."""
    gpus = [DeviceFactory.create() for _ in range(2)]
    day = today() - timedelta(days=15)
    create_day_partition(day)
    start = day_bounds_ms(day)[0]
    for index, gpu in enumerate(gpus):
        send(samples(gpu, start, 300, seed=300 + index))
    compact_samples()
    assert_sums_right()
    jobs: list[Any] = [
        (lambda gpu=gpu, k=k: send(samples(gpu, start + (10 + 37 * k) * MINUTE, 20, seed=k)))
        for gpu in gpus
        for k in range(3)
    ]
    jobs.append(compact_samples)
    jobs.append(hoursums.rebuild_sums)
    errors = _in_threads(jobs)
    assert not errors, errors
    assert_sums_right()


@pytest.mark.django_db(transaction=True)
def test_a_day_dropped_while_ingests_run(sums_kept: None) -> None:
    gpu = DeviceFactory.create()
    old = today() - timedelta(days=45)
    create_day_partition(old)
    send(samples(gpu, day_bounds_ms(old)[1] - 30 * MINUTE, 40, seed=61))
    errors = _in_threads(
        [
            lambda: drop_day_partition(old),
            lambda: send(samples(gpu, day_bounds_ms(old)[1] + 5 * MINUTE, 40, seed=62)),
            lambda: send(samples(gpu, day_bounds_ms(old)[1] - 25 * MINUTE, 10, seed=63)),
        ]
    )
    assert not errors, errors
    assert_sums_right()


@pytest.mark.django_db(transaction=True)
def test_a_rollup_racing_an_ingest_ends_with_the_scanning_rows(sums_kept: None) -> None:
    gpu = DeviceFactory.create()
    start = day_start(today() - timedelta(days=1))
    AllocationFactory.create(device=gpu, start=start, end=None)
    send(samples(gpu, epoch_ms(start), 100, seed=41))
    hours = [start + timedelta(hours=index) for index in range(4)]
    from metering import rollup

    errors = _in_threads(
        [
            lambda: send(samples(gpu, epoch_ms(start) + 30 * MINUTE, 100, seed=42)),
            lambda: rollup.rollup_hours(hours=hours),
        ]
    )
    assert not errors, errors
    assert_sums_right()
    both_ways(hours)


@pytest.mark.django_db(transaction=True)
def test_the_sums_are_kept_after_a_flush() -> None:
    """pytest-django flushes the database after each transactional test (`manage.py flush`,
    then post_migrate): `metering_hoursumstate` loses its row, and the triggers would keep no
    sums (the rollup scanning, the conftest's check after each test skipping) but for
    post_migrate's `metering.apps.keep_sums`, which makes them again."""
    call_command("flush", interactive=False, verbosity=0)
    assert hoursums.recorded_hold_ms() is not None
    gpu = DeviceFactory.create()
    send(samples(gpu, hour_start(today() - timedelta(days=1), 3), 20, seed=1))
    assert stored_sums()
    assert_sums_right()


@pytest.mark.django_db(transaction=True)
def test_a_rebuild_under_another_hold_committed_while_a_rollup_runs(
    sums_kept: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy changing TALLY_SAMPLE_HOLD_SECONDS: `rebuild_sample_sums` run under the new
    hold while a worker still under the old one rolls up. The worker found the sums usable
    (recorded hold == its hold), then reads sums made under the new hold: its whole hours are
    billed under the new hold, its pieces (allocations starting or ending inside an hour)
    and the hour in progress under its own, and the hours are not rolled up again. Low
    severity (a race inside one run, while holds change), but not what either hold gives."""
    from metering import rollup

    gpu = DeviceFactory.create()
    start = day_start(today() - timedelta(days=1))
    AllocationFactory.create(device=gpu, start=start, end=None)
    # Sparse samples: spans the hold cuts.
    send(
        [
            SampleRow(gpu.meter_id, epoch_ms(start) + index * 5 * MINUTE, 50.0, None, None)
            for index in range(40)
        ]
    )
    hours = [start + timedelta(hours=index) for index in range(3)]
    real = rollup.sums_usable

    def usable_then_rebuilt_elsewhere() -> bool:
        answer = real()

        def rebuild() -> None:
            try:
                with override_settings(TALLY_SAMPLE_HOLD_SECONDS=30):
                    hoursums.rebuild_sums()
            finally:
                connections.close_all()

        thread = threading.Thread(target=rebuild)
        threads.append(thread)
        thread.start()
        # Until the rebuild waits (the hold's row is held FOR SHARE by this transaction), or
        # is done (it was not held off).
        with connection.cursor() as cursor:
            for _ in range(100):
                cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                if cursor.fetchone()[0] or not thread.is_alive():
                    break
                threading.Event().wait(0.05)
        return answer

    threads: list[threading.Thread] = []
    monkeypatch.setattr(rollup, "sums_usable", usable_then_rebuilt_elsewhere)
    rollup.rollup_hours(hours=hours)
    for thread in threads:
        thread.join()
    raced = _usage_rows()
    assert hoursums.recorded_hold_ms() == 30_000  # the rebuild went through, after the run
    monkeypatch.setattr(rollup, "sums_usable", real)
    hoursums.rebuild_sums()  # under this worker's hold again
    rollup.rollup_hours(hours=hours)
    assert raced == _usage_rows()


def _usage_rows() -> list[tuple[Any, ...]]:
    from tests.metering.test_hoursums import usage

    return usage()


@pytest.mark.django_db(transaction=True)
def test_a_rebuild_and_a_thaw_lock_in_the_same_order(sums_kept: None) -> None:
    """An ingest's thaw (`_THAW_SQL`) locks the blocks (its DELETE) before `billing_sample`
    (its INSERT); `rebuild_sums` takes its locks in that order too. Here the thaw's
    transaction holds the blocks first, the rebuild waits for them (holding nothing yet), and
    the thaw goes on into `billing_sample`: no deadlock, both done, the sums right."""
    gpu = DeviceFactory.create()
    day = today() - timedelta(days=16)
    create_day_partition(day)
    start = day_bounds_ms(day)[0]
    send(samples(gpu, start, 100, seed=71))
    compact_samples()
    errors: list[BaseException] = []
    blocks_held = threading.Event()
    rebuild_started = threading.Event()

    def rebuild() -> None:
        try:
            blocks_held.wait()
            rebuild_started.set()
            hoursums.rebuild_sums()
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    def thaw() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("DELETE FROM metering_sampleblock WHERE false")  # its lock
                blocks_held.set()
                rebuild_started.wait()
                for _ in range(100):  # until the rebuild waits on the blocks
                    cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                    if cursor.fetchone()[0]:
                        break
                    threading.Event().wait(0.02)
                thaw_samples(cursor, {gpu.meter_id: (start + 30 * MINUTE, start + 40 * MINUTE)})
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=rebuild), threading.Thread(target=thaw)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert_sums_right()
