"""Compacted samples (`metering.compaction`, `metering.blocks`): closed days' samples moved
into one row of arrays per device and day, read back exactly, thawed by any write among
them, aged out with their day, and the ledger (usage hours) the same before and after."""

from __future__ import annotations

import json
import random
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory.models import Device
from metering import rollup
from metering.compaction import compact_samples, partition_bloated
from metering.hours import epoch_ms
from metering.ingest import SampleRow, ingest
from metering.models import SampleBlock, UsageHour
from metering.retention import (
    day_bounds_ms,
    drop_day_partition,
    maintain_sample_partitions,
    partition_name,
    sample_partitions,
)
from tests.factories import AllocationFactory, DeviceFactory

pytestmark = pytest.mark.django_db

# Every column of a sample but its id (a thawed sample gets a new one).
_COLUMNS = (
    "device_uuid, ts_ms, gpu_util, mem_used_bytes, processes, node, received_at, gap_ms, "
    "covered_ms, placed_gpu_instance"
)


def today() -> date:
    return timezone.now().astimezone(UTC).date()


def at(day: date, minute: int) -> int:
    return day_bounds_ms(day)[0] + minute * 60_000


def everything() -> list[tuple[Any, ...]]:
    """Every sample, wherever it is kept, in (device, instant) order."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {_COLUMNS} FROM metering_samples(0, 9000000000000) ORDER BY 1, 2")
        return cursor.fetchall()


def hot_count() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM billing_sample")
        (count,) = cursor.fetchone()
    return int(count)


def send(rows: list[SampleRow], *, node: str = "node-a", received: datetime | None = None) -> None:
    ingest(node=node, samples=rows, received_at=received or timezone.now())


def day_of_samples(device: Device, day: date, *, every: int = 7, seed: int = 0) -> list[SampleRow]:
    """A day of samples of `device`, one each `every` minutes, some without utilisation, some
    means, with a process list that changes now and then."""
    rng = random.Random(seed)
    rows = []
    for minute in range(0, 24 * 60, every):
        util = None if rng.random() < 0.1 else float(rng.randint(0, 100))
        processes = json.dumps([{"pid": 100 + minute // 120, "used_memory_bytes": 1 << 30}])
        rows.append(
            SampleRow(
                device.meter_id,
                at(day, minute) + rng.randint(0, 999),
                util,
                rng.choice([None, rng.randint(0, 80) << 30]),
                rng.choice([None, processes]),
                rng.choice([None, None, 60_000]),
            )
        )
    return rows


def expected_gaps(samples: list[tuple[Any, ...]]) -> list[int | None]:
    """Each sample's gap to its device's next (samples in device, instant order)."""
    gaps: list[int | None] = []
    for here, after in zip(samples, [*samples[1:], None], strict=True):
        gaps.append(after[1] - here[1] if after is not None and after[0] == here[0] else None)
    return gaps


def usage() -> list[tuple[Any, ...]]:
    return list(
        UsageHour.objects.order_by("hour", "allocation_id").values_list(
            "hour",
            "allocation_id",
            "allocated_gpu_ms",
            "utilised_gpu_ms",
            "unmeasured_gpu_ms",
            "device_uuid",
            "team_id",
        )
    )


def hours(first: date, days: int) -> list[datetime]:
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    return [start + timedelta(hours=index) for index in range(24 * days)]


@pytest.fixture
def fleet() -> tuple[list[Device], list[date]]:
    """Two GPUs with three closed days of samples (five to three days ago), each day in its
    own partition, and an allocation of each over all of it (one of them only partly)."""
    gpus = [DeviceFactory.create(), DeviceFactory.create()]
    days = [today() - timedelta(days=back) for back in (5, 4, 3)]
    for index, gpu in enumerate(gpus):
        for number, day in enumerate(days):
            send(day_of_samples(gpu, day, seed=10 * index + number))
    maintain_sample_partitions()
    start = datetime(days[0].year, days[0].month, days[0].day, tzinfo=UTC)
    AllocationFactory.create(device=gpus[0], start=start - timedelta(hours=1), end=None)
    AllocationFactory.create(
        device=gpus[1],
        start=start + timedelta(hours=30, minutes=17),
        end=start + timedelta(hours=50, minutes=3),
    )
    return gpus, days


def test_compaction_keeps_every_sample_and_the_usage_hours(fleet: Any) -> None:
    gpus, days = fleet
    before = everything()
    assert [row[7] for row in before] == expected_gaps(before)
    rollup.rollup_hours(hours=hours(days[0], 4))
    billed = usage()
    assert billed and any(row[3] for row in billed)
    hot = hot_count()

    report = compact_samples()

    assert set(report.moved) == set(days)
    assert report.rewritten == days and not report.busy
    # Each device-day keeps its first and last sample in `billing_sample`, the rest in a block.
    assert hot_count() == 2 * len(gpus) * len(days)
    assert SampleBlock.objects.count() == len(gpus) * len(days)
    assert sum(report.moved.values()) == hot - hot_count()
    assert everything() == before
    rollup.rollup_hours(hours=hours(days[0], 4))
    assert usage() == billed
    # Idempotent: a rerun moves nothing and changes nothing.
    assert compact_samples().moved == {}
    assert everything() == before


def test_a_late_sample_thaws_its_block_and_its_gaps_are_right(fleet: Any) -> None:
    gpus, days = fleet
    compact_samples()
    block = SampleBlock.objects.get(device_uuid=gpus[0].meter_id, day_ms=day_bounds_ms(days[1])[0])
    # Between two compacted samples of the middle day, on a minute no sample has.
    late = at(days[1], 3 * 60 + 3) + 500
    before = everything()
    send([SampleRow(gpus[0].meter_id, late, 42.0, None, None)])

    assert not SampleBlock.objects.filter(pk=block.pk).exists()
    after = everything()
    assert len(after) == len(before) + 1
    assert [row[7] for row in after] == expected_gaps(after)
    # The other device-days stay compacted.
    assert SampleBlock.objects.count() == 2 * 3 - 1
    # And the ledger is what the samples give, compacted again or not.
    rollup.rollup_hours(hours=hours(days[0], 4))
    billed = usage()
    compact_samples()
    assert SampleBlock.objects.count() == 2 * 3
    assert everything() == after
    rollup.rollup_hours(hours=hours(days[0], 4))
    assert usage() == billed


def test_a_duplicate_of_a_compacted_sample_is_not_stored_twice(fleet: Any) -> None:
    gpus, days = fleet
    before = everything()
    compact_samples()
    inside = next(row for row in before if row[0] == gpus[1].meter_id and row[1] > at(days[2], 600))
    send([SampleRow(gpus[1].meter_id, inside[1], 99.0, None, None)])
    assert everything() == before


def test_backfill_before_and_across_compacted_days_finds_its_neighbours(fleet: Any) -> None:
    gpus, days = fleet
    compact_samples()
    earlier = days[0] - timedelta(days=1)
    # One batch from the day before the first to the middle of the last: every block of the
    # device it spans is thawed, the gaps of both ends found.
    rows = [
        SampleRow(gpus[0].meter_id, at(earlier, 1400), 10.0, None, None),
        SampleRow(gpus[0].meter_id, at(days[2], 700) + 1, 20.0, None, None),
    ]
    send(rows)
    after = everything()
    assert [row[7] for row in after] == expected_gaps(after)
    left = set(SampleBlock.objects.values_list("device_uuid", flat=True))
    assert left == {gpus[1].meter_id}


def test_a_day_with_a_sample_placed_by_the_spells_is_not_compacted(fleet: Any) -> None:
    gpus, days = fleet
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE billing_sample SET placed_gpu_instance = 3 WHERE device_uuid = %s "
            "AND ts_ms = (SELECT min(ts_ms) FROM billing_sample WHERE device_uuid = %s "
            "AND ts_ms > %s)",
            [gpus[0].meter_id, gpus[0].meter_id, at(days[0], 300)],
        )
        assert cursor.rowcount == 1
    compact_samples()
    assert not SampleBlock.objects.filter(
        device_uuid=gpus[0].meter_id, day_ms=day_bounds_ms(days[0])[0]
    ).exists()
    assert SampleBlock.objects.count() == 2 * 3 - 1


def test_dry_run_and_limit(fleet: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _, days = fleet
    before = everything()
    hot = hot_count()
    call_command("compact_samples", "--dry-run")
    out = capsys.readouterr().out
    assert all(f"{day}: would move" in out for day in days)
    assert hot_count() == hot and not SampleBlock.objects.exists()
    call_command("compact_samples", "--limit", "1")
    assert set(SampleBlock.objects.values_list("day_ms", flat=True)) == {day_bounds_ms(days[0])[0]}
    assert everything() == before


def default_bytes() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_relation_size('billing_sample_default')")
        (size,) = cursor.fetchone()
    return int(size)


def test_closed_days_left_in_default_are_partitioned_compacted_and_default_shrunk(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """History loaded before its days had partitions (a backfill, the demo's weeks) waits in
    DEFAULT: compaction gives each closed day its partition first, compacts it, and gives
    DEFAULT the space of the rows moved out (a delete alone leaves it its size)."""
    gpu = DeviceFactory.create()
    days = [today() - timedelta(days=back) for back in (5, 4, 3)]
    for number, day in enumerate(days):
        send(day_of_samples(gpu, day, every=1, seed=number))
    assert not set(days) & set(sample_partitions())  # in DEFAULT, as loaded
    before = everything()
    grown = default_bytes()
    assert grown > 1 << 20

    call_command("compact_samples", "--dry-run")
    out = capsys.readouterr().out
    for day in days:
        start, end = day_bounds_ms(day)
        count = sum(1 for row in before if start <= row[1] < end)
        assert f"{day}: {count} sample(s) in the DEFAULT partition would be given" in out
    assert everything() == before and default_bytes() == grown
    assert not set(days) & set(sample_partitions()) and not SampleBlock.objects.exists()

    call_command("compact_samples")
    out = capsys.readouterr().out
    assert all(f"{day}: moved " in out for day in days)
    assert "DEFAULT partition: the space of the rows moved out given back" in out
    assert set(days) <= set(sample_partitions())
    assert SampleBlock.objects.count() == 3
    assert everything() == before
    assert default_bytes() < grown // 10
    assert not partition_bloated(None)


def test_days_within_the_horizon_are_not_compacted(fleet: Any) -> None:
    _, days = fleet
    with override_settings(TALLY_SAMPLE_COMPACT_AFTER_DAYS=4):
        report = compact_samples()
    assert set(report.moved) == {days[0]}


def test_retention_drops_a_compacted_day_with_its_blocks(fleet: Any) -> None:
    _, days = fleet
    compact_samples()
    before = everything()
    assert drop_day_partition(days[0])
    start, end = day_bounds_ms(days[0])
    assert [row for row in before if not start <= row[1] < end] == everything()
    assert not SampleBlock.objects.filter(day_ms=start).exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [partition_name(days[0])])
        assert cursor.fetchone() == (None,)


def test_retention_drops_compacted_days_only_when_they_may_go(fleet: Any) -> None:
    _, days = fleet
    compact_samples()
    now = timezone.now()
    with override_settings(TALLY_SAMPLE_RETENTION_DAYS=4):
        report = maintain_sample_partitions(now=now)
    # Days older than four are dropped unless held (nothing holds them here: no period).
    assert days[0] in report.dropped or days[0] in report.kept
    if days[0] in report.dropped:
        assert not SampleBlock.objects.filter(day_ms=day_bounds_ms(days[0])[0]).exists()
    else:
        assert SampleBlock.objects.filter(day_ms=day_bounds_ms(days[0])[0]).exists()
    assert SampleBlock.objects.filter(day_ms=day_bounds_ms(days[2])[0]).exists()


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    late=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=1),  # device
            st.integers(min_value=-1, max_value=3),  # day, from the first
            st.integers(min_value=0, max_value=24 * 60 * 60_000 - 1),  # ms into the day
            st.one_of(st.none(), st.integers(min_value=0, max_value=100).map(float)),
        ),
        min_size=1,
        max_size=6,
    ),
    batches=st.integers(min_value=1, max_value=3),
)
def test_late_writes_among_compacted_days_leave_every_gap_right(
    late: list[tuple[int, int, int, float | None]], batches: int
) -> None:
    """Whatever is written late, in however many batches, after compaction: the samples are
    those written, each once, with the gap to its device's next; and compacting again moves
    nothing that changes them."""
    with connection.cursor() as cursor:
        # A TRUNCATE empties the per device-hour sums too (a DELETE of blocks, which no writer
        # but compaction's thaw and retention makes, would leave theirs).
        cursor.execute("TRUNCATE metering_sampleblock, billing_sample")
    gpus = [DeviceFactory.create(), DeviceFactory.create()]
    first = today() - timedelta(days=6)
    for index, gpu in enumerate(gpus):
        for number in range(3):
            send(day_of_samples(gpu, first + timedelta(days=number), every=97, seed=index + number))
    maintain_sample_partitions()
    compact_samples()
    rows = [
        SampleRow(gpus[device].meter_id, at(first, 0) + day * 86_400_000 + ms, util, None, None)
        for device, day, ms, util in late
    ]
    for number in range(batches):
        send(rows[number::batches])
    after = everything()
    assert len({row[:2] for row in after}) == len(after)
    assert [row[7] for row in after] == expected_gaps(after)
    compact_samples()
    assert everything() == after


@pytest.mark.django_db(transaction=True)
def test_compaction_waits_for_a_write_holding_a_device_of_the_day() -> None:
    """A writer holding a device's ingest lock (between its check for blocks and its write)
    is never overtaken: compaction of that device's day waits for it, then compacts what it
    wrote too."""
    import threading

    from django.db import connections

    from metering.ingest.gaps import lock_devices

    gpu = DeviceFactory.create()
    day = today() - timedelta(days=4)
    send(day_of_samples(gpu, day, seed=3))
    maintain_sample_partitions()
    locked, release, compacted = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                lock_devices(cursor, [gpu.meter_id])
                locked.set()
                assert release.wait(30)
                cursor.execute(
                    "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at)"
                    " VALUES (%s, %s, 1.0, '', now())",
                    [gpu.meter_id, at(day, 600) + 1],
                )
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    def compactor() -> None:
        try:
            compact_samples()
            compacted.set()
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    first = threading.Thread(target=writer)
    first.start()
    assert locked.wait(30)
    second = threading.Thread(target=compactor)
    second.start()
    assert not compacted.wait(2)  # waiting for the writer's lock
    release.set()
    first.join(30)
    second.join(60)
    assert not errors and compacted.is_set()
    block = SampleBlock.objects.get(device_uuid=gpu.meter_id)
    assert at(day, 600) + 1 - block.day_ms in block.ts_off


def test_a_write_of_the_last_days_skips_the_thaw_query(fleet: Any) -> None:
    from django.test.utils import CaptureQueriesContext

    from metering.blocks import thaw_samples

    gpus, days = fleet
    compact_samples()
    now_ms = epoch_ms(timezone.now())
    yesterday = day_bounds_ms(today() - timedelta(days=1))[0]
    with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
        assert thaw_samples(cursor, {gpus[0].meter_id: (yesterday, now_ms)}) == 0
        assert not queries.captured_queries
        # One reaching back into a compacted day asks, and thaws.
        assert thaw_samples(cursor, {gpus[0].meter_id: (at(days[2], 500), now_ms)}) > 0
        assert len(queries.captured_queries) == 1
