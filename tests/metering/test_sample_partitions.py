"""Raw samples partitioned by UTC day (migration 0007, `metering.retention`): partitions made
ahead, DEFAULT catching the rest and emptied by the beat task, days dropped only once their
periods are closed and their hours rolled up, ingest going on while partitions are made, and
the rollup's reads still pruned to their days."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.test import override_settings
from django.utils import timezone

from billing.models import Period
from billing.periods import period_bounds
from inventory.models import Device
from metering.dirty import mark_dirty
from metering.hours import epoch_ms, sample_hold_ms
from metering.ingest import SampleRow, ingest
from metering.models import DirtyHour, Sample, UnknownDeviceSample
from metering.retention import (
    DEFAULT_PARTITION,
    create_day_partition,
    day_bounds_ms,
    maintain_sample_partitions,
    partition_name,
    purge_unknown_device_samples,
    sample_partitions,
    why_kept,
)
from metering.tasks import sample_retention
from tests.factories import DeviceFactory

pytestmark = pytest.mark.django_db

# A reference instant for the tests that pass their own `now`. Fixed when the module is
# collected, before the test database (and migration 0007's partitions) is made: a test that
# needs the partitions the migration made reads the clock itself (`utc_today`).
NOW = timezone.now()
TODAY = NOW.astimezone(UTC).date()
# How many days from its own the migration made partitions for (today and three ahead).
MIGRATION_DAYS = 4


def utc_today() -> date:
    return timezone.now().astimezone(UTC).date()


def at(day: date, hour: int = 12, second: int = 0) -> datetime:
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC) + timedelta(seconds=second)


def store(device: Device, *instants: datetime, util: float = 50.0) -> None:
    rows = [SampleRow(device.meter_id, epoch_ms(moment), util, None, None) for moment in instants]
    ingest(node="", samples=rows, received_at=NOW)


def where(device: Device) -> dict[int, str]:
    """Each of the device's samples (by ts_ms) and the partition that holds it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ts_ms, tableoid::regclass::text FROM billing_sample WHERE device_uuid = %s",
            [device.meter_id],
        )
        return dict(cursor.fetchall())


@pytest.fixture
def gpu() -> Device:
    return DeviceFactory.create()


def test_partitions_are_made_ahead_and_again_idempotently() -> None:
    made = sample_partitions()
    # The migration made the day it ran and three days ahead. It ran when the test database
    # was made: today, or yesterday when the suite has since gone past midnight (UTC).
    today = utc_today()
    migration_days = [today, today - timedelta(days=1)]
    assert any(
        {day + timedelta(days=n) for n in range(MIGRATION_DAYS)} <= made.keys()
        for day in migration_days
    ), sorted(made)
    later = NOW + timedelta(days=10)
    with override_settings(TALLY_SAMPLE_PARTITIONS_AHEAD_DAYS=5):
        report = maintain_sample_partitions(now=later)
        again = maintain_sample_partitions(now=later)
    wanted = {later.date() + timedelta(days=n) for n in range(6)}
    assert wanted <= sample_partitions().keys()
    assert set(report.created) == wanted - made.keys()
    assert again.created == [] and again.dropped == []
    start, end = day_bounds_ms(later.date())
    assert sample_partitions()[later.date()] == partition_name(later.date())
    assert (end - start, start % 86_400_000) == (86_400_000, 0)


def test_todays_samples_land_in_todays_partition_a_far_day_in_default(gpu: Device) -> None:
    # Today by the clock now, not when the module was collected: the migration made its
    # partition (it ran today, or up to three days before).
    now = timezone.now()
    today = now.astimezone(UTC).date()
    far = today + timedelta(days=40)
    store(gpu, at(today, 0), at(far))
    assert where(gpu) == {
        epoch_ms(at(today, 0)): partition_name(today),
        epoch_ms(at(far)): DEFAULT_PARTITION,
    }
    # Too far ahead to be a day to make now: reported, left where it is.
    report = maintain_sample_partitions(now=now)
    assert report.left_in_default == {far: 1}
    assert where(gpu)[epoch_ms(at(far))] == DEFAULT_PARTITION
    # Once its day is within the days made ahead, it is moved into its own partition, its
    # id and gap kept.
    before = Sample.objects.get(ts_ms=epoch_ms(at(far)))
    report = maintain_sample_partitions(now=at(far, 0) - timedelta(days=1))
    assert report.moved_from_default == 1 and far in report.created
    assert where(gpu)[epoch_ms(at(far))] == partition_name(far)
    after = Sample.objects.get(ts_ms=epoch_ms(at(far)))
    assert (after.pk, after.gap_ms, after.gpu_util) == (before.pk, before.gap_ms, 50.0)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {DEFAULT_PARTITION}")
        assert cursor.fetchone() == (0,)


def test_a_stored_sample_is_still_stored_once_across_partitions(gpu: Device) -> None:
    far = TODAY + timedelta(days=30)
    store(gpu, at(far), at(far, second=10))
    create_day_partition(far)
    store(gpu, at(far), at(far, second=10), at(far, second=20))
    assert Sample.objects.filter(device_uuid=gpu.meter_id).count() == 3
    gaps = list(
        Sample.objects.filter(device_uuid=gpu.meter_id).order_by("ts_ms").values_list("gap_ms")
    )
    assert gaps == [(10_000,), (10_000,), (None,)]


def _old_day_with_samples(gpu: Device, *, days_old: int) -> date:
    day = TODAY - timedelta(days=days_old)
    store(gpu, at(day, 1), at(day, 23, 3590))  # the last one holds into the next day
    DirtyHour.objects.all().delete()  # as after the rollup
    return day


def _close_periods_over(day: date) -> None:
    start, end = period_bounds(at(day))
    Period.objects.update_or_create(
        start=start, defaults={"end": end, "closed_at": NOW, "closed_by": "finance"}
    )


@override_settings(TALLY_SAMPLE_RETENTION_DAYS=100)
def test_a_day_is_dropped_only_once_its_period_is_closed_and_its_hours_rolled_up(
    gpu: Device,
) -> None:
    day = _old_day_with_samples(gpu, days_old=120)
    young = _old_day_with_samples(gpu, days_old=50)
    maintain_sample_partitions(now=NOW)  # their partitions made, their rows moved out of DEFAULT
    assert {day, young} <= sample_partitions().keys()

    # No period billed the day yet: kept.
    report = maintain_sample_partitions(now=NOW)
    assert day in report.kept and "not billed yet" in report.kept[day]
    # Its period open: kept.
    start, end = period_bounds(at(day))
    Period.objects.create(start=start, end=end)
    assert "is open" in why_kept(day, now=NOW)
    assert day in maintain_sample_partitions(now=NOW).kept
    # Closed, but a late sample's hour (the next day's first, which the day's last sample
    # holds into) is still to be rolled up: kept.
    _close_periods_over(day)
    _close_periods_over(day + timedelta(days=1))
    DirtyHour.objects.create(hour=at(day + timedelta(days=1), 0), marked_at=NOW)
    assert "to be rolled up" in why_kept(day, now=NOW)
    assert day in maintain_sample_partitions(now=NOW).kept
    assert Sample.objects.filter(ts_ms__lt=day_bounds_ms(day)[1]).count() == 2
    # Rolled up: dropped, samples and table gone. The young day stays, whatever its period.
    DirtyHour.objects.all().delete()
    _close_periods_over(young)
    report = maintain_sample_partitions(now=NOW)
    assert report.dropped == [day]
    assert young not in report.dropped and young not in report.kept
    assert day not in sample_partitions() and young in sample_partitions()
    start_ms, end_ms = day_bounds_ms(day)
    assert not Sample.objects.filter(ts_ms__gte=start_ms, ts_ms__lt=end_ms).exists()
    assert Sample.objects.filter(ts_ms__gte=day_bounds_ms(young)[0]).count() == 2
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [partition_name(day)])
        assert cursor.fetchone() == (None,)


@override_settings(TALLY_SAMPLE_RETENTION_DAYS=100)
def test_the_hours_of_a_dropped_day_are_never_marked_for_rollup_again(gpu: Device) -> None:
    """Rolled up again without its samples, a dropped day's measured time would turn
    unmeasured and bill its closed period anew: a claim the sync sees months late marks the
    hours still kept, not those."""
    # A day and its next in one period, long past retention; a day of the next period, past
    # retention too, whose period stays open.
    first = TODAY - timedelta(days=150)
    if period_bounds(at(first + timedelta(days=1)))[0] != period_bounds(at(first))[0]:
        first -= timedelta(days=1)
    later = period_bounds(at(first))[1].date() + timedelta(days=2)
    day = _old_day_with_samples(gpu, days_old=(TODAY - first).days)
    open_old = _old_day_with_samples(gpu, days_old=(TODAY - later).days)
    assert (TODAY - open_old).days > 100
    maintain_sample_partitions(now=NOW)
    _close_periods_over(day)
    _close_periods_over(day + timedelta(days=1))
    assert day in maintain_sample_partitions(now=NOW).dropped
    assert open_old in sample_partitions()

    recent = at(TODAY - timedelta(days=2), 3)
    mark_dirty(hours={at(day, 5), at(open_old, 5), recent}, at=NOW)

    assert set(DirtyHour.objects.values_list("hour", flat=True)) == {at(open_old, 5), recent}


@override_settings(TALLY_SAMPLE_RETENTION_DAYS=100)
def test_a_day_any_open_period_overlaps_is_kept(gpu: Device) -> None:
    day = _old_day_with_samples(gpu, days_old=130)
    maintain_sample_partitions(now=NOW)
    _close_periods_over(day)
    _close_periods_over(day + timedelta(days=1))
    assert why_kept(day, now=NOW) == ""
    # A period of another length, stored before the length changed, still open.
    Period.objects.create(start=at(day, 6), end=at(day, 18))
    assert "is open" in why_kept(day, now=NOW)
    assert day in maintain_sample_partitions(now=NOW).kept


def test_the_beat_task_reports_what_it_did(gpu: Device) -> None:
    far = TODAY + timedelta(days=50)
    store(gpu, at(far))
    result = sample_retention.apply().get()
    assert result["left_in_default"] == {far.isoformat(): 1}
    assert result["dropped"] == [] and result["busy"] == []


@pytest.mark.django_db(transaction=True)
def test_ingest_goes_on_while_partitions_are_made() -> None:
    device = DeviceFactory.create()
    days = [TODAY + timedelta(days=20 + n) for n in range(4)]
    per_batch, batches = 50, 12
    errors: list[BaseException] = []
    start, first_stored = threading.Event(), threading.Event()

    def send(worker: int) -> None:
        try:
            start.wait()
            for batch in range(batches):
                rows = [
                    SampleRow(
                        device.meter_id,
                        epoch_ms(at(days[(batch + index) % len(days)], worker))
                        + (batch * per_batch + index) * 1000,
                        float(index % 100),
                        None,
                        None,
                    )
                    for index in range(per_batch)
                ]
                ingest(node="", samples=rows, received_at=timezone.now())
                first_stored.set()
        except BaseException as error:  # reported below, never lost in the thread
            errors.append(error)
        finally:
            connections.close_all()

    senders = [threading.Thread(target=send, args=(worker,)) for worker in (2, 8)]
    for thread in senders:
        thread.start()
    start.set()
    moved = 0
    try:
        # Made while the senders go on: some of their rows are in DEFAULT by then.
        assert first_stored.wait(30)
        for day in days:
            moved += create_day_partition(day)
    finally:
        for thread in senders:
            thread.join(60)
    assert errors == []
    assert moved > 0
    assert set(days) <= sample_partitions().keys()
    expected = 2 * batches * per_batch
    assert Sample.objects.filter(device_uuid=device.meter_id).count() == expected
    placed = where(device)
    assert set(placed.values()) == {partition_name(day) for day in days}
    # Every gap is right: each sample's gap is the time to the device's next one.
    ordered = list(
        Sample.objects.filter(device_uuid=device.meter_id)
        .order_by("ts_ms")
        .values_list("ts_ms", "gap_ms")
    )
    for (ts_ms, gap_ms), (next_ms, _) in pairwise(ordered):
        assert gap_ms == next_ms - ts_ms
    assert ordered[-1][1] is None


def _plan(sql: str, params: dict[str, int] | None) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


# How the rollup reads a window's samples (`metering.rollup`'s per-hour sums): the window, and a
# hold before it, whose samples reach into it.
_WINDOW_READ = """
SELECT device_uuid, ts_ms / 3600000 AS h, SUM(gpu_util) FROM billing_sample
WHERE ts_ms >= %(start)s - %(hold)s AND ts_ms < %(end)s AND gpu_util IS NOT NULL
GROUP BY device_uuid, h
"""


def test_reads_of_a_window_are_pruned_to_its_days(gpu: Device) -> None:
    day = TODAY - timedelta(days=3)
    for other in (day - timedelta(days=1), day, day + timedelta(days=1)):
        create_day_partition(other)
    start, end = epoch_ms(at(day, 10)), epoch_ms(at(day, 11))
    plan = _plan(_WINDOW_READ, {"start": start, "end": end, "hold": sample_hold_ms()})
    assert partition_name(day) in plan
    assert partition_name(day - timedelta(days=1)) not in plan
    assert partition_name(day + timedelta(days=1)) not in plan
    assert DEFAULT_PARTITION not in plan
    # The first hour of a day reaches back a hold into the day before: both, no more.
    plan = _plan(
        _WINDOW_READ,
        {"start": epoch_ms(at(day, 0)), "end": epoch_ms(at(day, 1)), "hold": sample_hold_ms()},
    )
    assert partition_name(day - timedelta(days=1)) in plan and partition_name(day) in plan
    assert partition_name(day + timedelta(days=1)) not in plan
    # The ORM's bounded reads too.
    query = str(Sample.objects.filter(ts_ms__gte=start, ts_ms__lt=end).values("gpu_util").query)
    plan = _plan(query, None)
    assert partition_name(day) in plan and DEFAULT_PARTITION not in plan
    # A day with no partition of its own is read from DEFAULT.
    lone = TODAY + timedelta(days=45)
    plan = _plan(
        _WINDOW_READ,
        {"start": epoch_ms(at(lone, 10)), "end": epoch_ms(at(lone, 11)), "hold": 0},
    )
    assert DEFAULT_PARTITION in plan and partition_name(TODAY) not in plan


@override_settings(TALLY_INGEST_UNKNOWN_RETENTION_DAYS=7, TALLY_RETENTION_BATCH=2)
def test_samples_set_aside_age_out_in_batches() -> None:
    for index in range(5):
        UnknownDeviceSample.objects.create(
            device_uuid="GPU-gone",
            ts_ms=index,
            node="n1",
            received_at=NOW - timedelta(days=8),
        )
    kept = UnknownDeviceSample.objects.create(
        device_uuid="GPU-gone", ts_ms=99, node="n1", received_at=NOW - timedelta(days=6)
    )
    assert purge_unknown_device_samples(now=NOW) == 5
    assert list(UnknownDeviceSample.objects.values_list("pk", flat=True)) == [kept.pk]
    assert purge_unknown_device_samples(now=NOW) == 0


@pytest.mark.django_db(transaction=True)
def test_the_migration_converts_the_table_with_its_data_and_back() -> None:
    device = DeviceFactory.create()
    old_day, far = TODAY - timedelta(days=5), TODAY + timedelta(days=200)
    store(device, at(old_day), at(old_day, second=10), at(TODAY), at(far))
    ids = dict(Sample.objects.values_list("ts_ms", "id"))
    call_command("migrate", "billing", "0006", verbosity=0)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT relkind FROM pg_class WHERE relname = 'billing_sample'")
            assert cursor.fetchone() == ("r",)  # a plain table again
        assert dict(Sample.objects.values_list("ts_ms", "id")) == ids
        # A row written under the old schema (before migration 0008's covered_ms: ingest
        # writes the model's columns, so not through it).
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO billing_sample (device_uuid, ts_ms, gpu_util, node, received_at) "
                "VALUES (%s, %s, 50.0, '', %s)",
                [device.meter_id, epoch_ms(at(old_day, second=20)), NOW],
            )
    finally:
        # Every app forward again: going back to billing 0006 took back metering's migrations
        # that follow it too (the compacted samples' blocks, metering 0004).
        call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE relname = 'billing_sample'")
        assert cursor.fetchone() == ("p",)
    placed = where(device)
    assert placed[epoch_ms(at(old_day))] == partition_name(old_day)
    assert placed[epoch_ms(at(old_day, second=20))] == partition_name(old_day)
    assert placed[epoch_ms(at(TODAY))] == partition_name(TODAY)
    assert placed[epoch_ms(at(far))] == DEFAULT_PARTITION
    assert len(placed) == 5
    # Ids go on from the sequence past every id copied.
    store(device, at(TODAY, second=5))
    assert Sample.objects.get(ts_ms=epoch_ms(at(TODAY, second=5))).pk > max(ids.values())


def test_a_retention_within_the_ingest_window_fails_at_start() -> None:
    env = {
        **os.environ,
        "TALLY_INGEST_MAX_AGE_DAYS": "30",
        "TALLY_SAMPLE_RETENTION_DAYS": "30",
        "DJANGO_SETTINGS_MODULE": "config.settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "TALLY_SAMPLE_RETENTION_DAYS=30 must be more than TALLY_INGEST_MAX_AGE_DAYS=30" in (
        done.stderr
    )
    env["TALLY_SAMPLE_RETENTION_DAYS"] = "31"
    assert (
        subprocess.run(
            [sys.executable, "-c", "import django; django.setup()"],
            env=env,
            timeout=120,
            check=False,
        ).returncode
        == 0
    )
