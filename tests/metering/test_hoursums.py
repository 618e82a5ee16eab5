"""Per device-hour sums kept as samples are written (`metering.hoursums`, migration 0005): equal
to a recompute from the samples whatever the order and path of the writes (ingest in or out
of order, replays, compaction and thaws, partitions made and dropped, a TRUNCATE), and the
rollup's rows from them identical to the rows scanning the samples gives, for hours ended and
for the hour in progress; under another hold the rollup scans, until the sums are rebuilt.

(Placement moves, adoption and every other writer are checked by the conftest's check after
each metering and billing test: `tests.metering.sums_check`.)"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from inventory.models import Device
from metering import hoursums, rollup
from metering.compaction import compact_samples
from metering.hours import MS_PER_HOUR, epoch_ms, sample_hold_ms
from metering.ingest import SampleRow, ingest
from metering.models import HourSumState, UsageHour
from metering.retention import (
    create_day_partition,
    day_bounds_ms,
    drop_day_partition,
    maintain_sample_partitions,
)
from tests.factories import AllocationFactory, DeviceFactory
from tests.metering.sums_check import assert_sums_right, recomputed_sums, stored_sums

pytestmark = pytest.mark.django_db

MINUTE = 60_000


def today() -> date:
    return timezone.now().astimezone(UTC).date()


def day_start(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def send(rows: list[SampleRow]) -> None:
    ingest(node="node-a", samples=rows, received_at=timezone.now())


def samples(device: Device, start_ms: int, count: int, *, seed: int) -> list[SampleRow]:
    """`count` samples about a minute apart from `start_ms`: some without utilisation, some
    means, utilisations with fractions (rounding)."""
    rng = random.Random(seed)
    rows, ts = [], start_ms
    for _ in range(count):
        ts += rng.randint(1_000, 3 * MINUTE)
        util = None if rng.random() < 0.1 else rng.randint(0, 100_000) / 1000
        rows.append(SampleRow(device.meter_id, ts, util, None, None, rng.choice([None, 30_000])))
    return rows


def usage() -> list[tuple[Any, ...]]:
    return list(
        UsageHour.objects.order_by("hour", "allocation_id").values_list(
            "hour", "allocation_id", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
        )
    )


@contextmanager
def scanning() -> Iterator[None]:
    """The rollup scans samples meanwhile: the recorded hold is made another (no write runs
    meanwhile, so the sums stay as they were)."""
    state = HourSumState.objects.get(id=1)
    HourSumState.objects.filter(id=1).update(hold_ms=state.hold_ms + 1)
    try:
        yield
    finally:
        HourSumState.objects.filter(id=1).update(hold_ms=state.hold_ms)


def both_ways(hours: list[datetime], now: datetime | None = None) -> list[tuple[Any, ...]]:
    """The rollup's rows of `hours` from the sums, asserted equal to those scanning gives."""
    rollup.rollup_hours(hours=hours, now=now)
    from_sums = usage()
    with scanning():
        rollup.rollup_hours(hours=hours, now=now)
    assert usage() == from_sums
    return from_sums


def test_sums_are_the_same_whatever_order_the_samples_come_in() -> None:
    gpus = [DeviceFactory.create(), DeviceFactory.create()]
    start = epoch_ms(day_start(today())) + 2 * MS_PER_HOUR
    rows = [row for index, gpu in enumerate(gpus) for row in samples(gpu, start, 120, seed=index)]
    send(rows)
    in_order = stored_sums()
    assert in_order and in_order == recomputed_sums()

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE billing_sample")
    assert stored_sums() == {}
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    for first in range(0, len(shuffled), 17):
        send(shuffled[first : first + 17])
    send(rows[40:90])  # a replay changes nothing
    assert stored_sums() == in_order


def test_the_rollup_reads_the_sums_and_writes_the_rows_scanning_writes() -> None:
    gpu = DeviceFactory.create()
    start = day_start(today()) - timedelta(days=1)
    AllocationFactory.create(device=gpu, start=start + timedelta(minutes=17), end=None)
    send(samples(gpu, epoch_ms(start), 600, seed=7))
    billed = both_ways([start + timedelta(hours=index) for index in range(24)])
    assert any(row[3] for row in billed)


def test_the_hour_in_progress_is_read_from_its_samples() -> None:
    gpu = DeviceFactory.create()
    start = day_start(today()) - timedelta(days=1)
    AllocationFactory.create(device=gpu, start=start, end=None)
    send(samples(gpu, epoch_ms(start), 300, seed=11))
    # Inside hour 3, a sample of hour 2 spilling over `now`, another just before it.
    now = start + timedelta(hours=3, minutes=1, seconds=10)
    send([SampleRow(gpu.meter_id, epoch_ms(now) - 100_000, 50.0, None, None)])
    hours = [start + timedelta(hours=index) for index in range(4)]
    billed = both_ways(hours, now=now)
    last = [row for row in billed if row[0] == hours[-1]]
    assert last and last[0][2] == 70_000  # allocated to `now` only (a share of 1)
    # A window of the hour in progress alone.
    both_ways(hours[-1:], now=now)


def test_another_hold_scans_until_the_sums_are_rebuilt(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = DeviceFactory.create()
    start = day_start(today()) - timedelta(days=1)
    AllocationFactory.create(device=gpu, start=start, end=None)
    send(samples(gpu, epoch_ms(start), 400, seed=5))
    hours = [start + timedelta(hours=index) for index in range(10)]
    hold = hoursums.recorded_hold_ms()
    assert hold == sample_hold_ms() and hold != 45_000
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=45):
        kept = stored_sums()
        with caplog.at_level(logging.WARNING, logger="metering.hoursums"):
            rollup.rollup_hours(hours=hours)
        assert "rebuild_sample_sums" in caplog.text
        scanned = usage()
        assert scanned == both_ways(hours)  # `both_ways` scans both times here

        call_command("rebuild_sample_sums", "--dry-run")
        assert "would make them again under 45000 ms" in capsys.readouterr().out
        assert stored_sums() == kept and hoursums.recorded_hold_ms() == hold

        call_command("rebuild_sample_sums")
        assert "made again under 45000 ms" in capsys.readouterr().out
        assert hoursums.recorded_hold_ms() == 45_000
        assert stored_sums() != kept
        assert_sums_right()
        assert hoursums.sums_usable()
        rollup.rollup_hours(hours=hours)
        assert usage() == scanned
    call_command("rebuild_sample_sums")
    assert stored_sums() == kept


def test_retention_drops_a_days_sums_with_its_samples() -> None:
    gpu = DeviceFactory.create()
    old = today() - timedelta(days=5)
    send(samples(gpu, day_bounds_ms(old)[0], 50, seed=1))
    send(samples(gpu, day_bounds_ms(old)[1] - 10 * MINUTE, 50, seed=2))
    create_day_partition(old)  # moves them out of DEFAULT: no sum changes
    create_day_partition(old + timedelta(days=1))
    assert_sums_right()
    before = stored_sums()
    assert drop_day_partition(old)
    first, last = (bound // MS_PER_HOUR for bound in day_bounds_ms(old))
    assert set(stored_sums()) == {key for key in before if not first <= key[1] < last}
    assert stored_sums() != before
    assert_sums_right()


class Writes(RuleBasedStateMachine):
    """Random writes of samples of two devices over three closed days and today: batches in
    any order, replays, late samples among compacted days, compaction, a day dropped, the sums
    rebuilt (from samples and blocks: unchanged). After
    each, the sums are a recompute's; and the rollup's rows from them are scanning's."""

    def __init__(self) -> None:
        super().__init__()
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE billing_sample, metering_sampleblock")
        self.days = [today() - timedelta(days=back) for back in (5, 4, 3)]

    @rule(
        device=st.integers(0, 1),
        day=st.integers(0, 3),
        minute=st.integers(0, 24 * 60 - 1),
        count=st.integers(1, 40),
        seed=st.integers(0, 1000),
    )
    def write(self, device: int, day: int, minute: int, count: int, seed: int) -> None:
        on = self.days[day] if day < 3 else today()
        rows = samples(GPUS[device], day_bounds_ms(on)[0] + minute * MINUTE, count, seed=seed)
        random.Random(seed).shuffle(rows)
        send(rows)

    @rule()
    def compact(self) -> None:
        compact_samples()

    @rule()
    def partitions(self) -> None:
        maintain_sample_partitions()

    @rule()
    def rebuild(self) -> None:
        before = stored_sums()
        hoursums.rebuild_sums()  # from `billing_sample` and the blocks alike: the same sums
        assert stored_sums() == before

    @rule(day=st.integers(0, 2))
    def drop(self, day: int) -> None:
        drop_day_partition(self.days[day])

    @invariant()
    def sums_are_the_samples(self) -> None:
        assert_sums_right()

    @rule(day=st.integers(0, 2), hour=st.integers(0, 22), count=st.integers(1, 3))
    def rollup_the_same(self, day: int, hour: int, count: int) -> None:
        start = day_start(self.days[day]) + timedelta(hours=hour)
        both_ways([start + timedelta(hours=index) for index in range(count)])


GPUS: list[Device] = []


def test_sums_stay_right_under_random_writes() -> None:
    GPUS[:] = [DeviceFactory.create(), DeviceFactory.create()]
    start = day_start(today() - timedelta(days=6))
    for gpu in GPUS:
        AllocationFactory.create(device=gpu, start=start + timedelta(minutes=13), end=None)
    try:
        run_state_machine_as_test(
            Writes,
            settings=settings(
                max_examples=8,
                stateful_step_count=10,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        GPUS.clear()
