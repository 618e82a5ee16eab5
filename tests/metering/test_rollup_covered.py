"""Means held for the time their readings covered (`Sample.covered_ms`), not the whole gap.

A sample's utilisation holds from its timestamp for `min(gap, covered, hold)`: a minute mean
whose readings covered 45 s of a 60 s gap is 45 s measured and 15 s unmeasured. Null covered
(a single reading) holds for `min(gap, hold)` as ever. Samples are written here as rows with
their gaps worked out (not through `metering.ingest`), so the rollup's reading of the column is
checked on its own, in both of its statements (hours held whole, pieces of hours) and across
an hour's boundary, against a plain-Python reading of the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory.models import Allocation, Device
from metering import rollup
from metering.hours import MS_PER_HOUR, epoch_ms
from metering.models import Sample, UsageHour
from tests.factories import AllocationFactory, DeviceFactory

pytestmark = pytest.mark.django_db

T10 = datetime(2026, 10, 15, 10, 0, tzinfo=UTC)
T11 = T10 + timedelta(hours=1)
LATER = T10 + timedelta(days=1)
HOLD_MS = 120_000  # TALLY_SAMPLE_HOLD_SECONDS' default
MINUTE = 60_000

# (ms since the epoch, percent or None, covered ms or None)
Reading = tuple[int, float | None, int | None]


@dataclass(frozen=True)
class Usage:
    allocated_gpu_ms: int
    utilised_gpu_ms: int
    unmeasured_gpu_ms: int


def store(device: Device, readings: list[Reading]) -> None:
    """The device's samples as rows, each with its gap to the next (as ingest keeps it)."""
    ordered = sorted(readings)
    Sample.objects.bulk_create(
        Sample(
            device_uuid=device.meter_id,
            ts_ms=ts,
            gpu_util=util,
            covered_ms=covered,
            gap_ms=ordered[index + 1][0] - ts if index + 1 < len(ordered) else None,
            received_at=T10,
        )
        for index, (ts, util, covered) in enumerate(ordered)
    )


def hold(device: Device, start: datetime, end: datetime | None) -> Allocation:
    return AllocationFactory.create(device=device, start=start, end=end)


def reference(allocation: Allocation, readings: list[Reading], hour: datetime) -> Usage | None:
    """The usage row of `allocation` for `hour`, sample by sample: each holds for
    `min(gap, covered, hold)` (a null one left out)."""
    assert allocation.device is not None
    start = max(epoch_ms(allocation.start), epoch_ms(hour))
    end = min(
        epoch_ms(allocation.end) if allocation.end else epoch_ms(LATER),
        epoch_ms(hour) + MS_PER_HOUR,
    )
    if end <= start:
        return None
    covered_ms, weighted = 0, 0
    ordered = sorted(readings)
    for index, (ts, util, covered) in enumerate(ordered):
        spans = [HOLD_MS]
        if index + 1 < len(ordered):
            spans.append(ordered[index + 1][0] - ts)
        if covered is not None:
            spans.append(covered)
        overlap = min(ts + min(spans), end) - max(ts, start)
        if util is not None and overlap > 0:
            covered_ms += overlap
            weighted += overlap * round(util * 1_000_000)  # millionths of a percent
    share = allocation.device.gpu_share
    return Usage(
        allocated_gpu_ms=int(((end - start) * share).to_integral_value(ROUND_HALF_UP)),
        utilised_gpu_ms=(weighted * int(share * 1_000_000) + 5 * 10**13) // 10**14,
        unmeasured_gpu_ms=int(
            ((end - start - covered_ms) * share).to_integral_value(ROUND_HALF_UP)
        ),
    )


def rolled_up() -> dict[tuple[int, datetime], Usage]:
    return {
        (row.allocation_id, row.hour): Usage(
            row.allocated_gpu_ms, row.utilised_gpu_ms, row.unmeasured_gpu_ms
        )
        for row in UsageHour.objects.all()
    }


def check(
    allocations: list[Allocation], readings: dict[str, list[Reading]]
) -> dict[tuple[int, datetime], Usage]:
    """Roll up 10:00 and 11:00 together (spans spill from one into the other) and compare
    every row with the reference."""
    rollup.rollup_hours(hours=[T10, T11], now=LATER)
    expected = {}
    for allocation in allocations:
        assert allocation.device is not None
        for hour in (T10, T11):
            row = reference(allocation, readings.get(allocation.device.meter_id, []), hour)
            if row is not None:
                expected[allocation.pk, hour] = row
    assert rolled_up() == expected
    return expected


def test_a_minute_mean_covering_45_s_of_its_minute_is_45_s_measured_15_s_unmeasured() -> None:
    gpu = DeviceFactory.create()
    # A mean a minute from 10:00 to 10:59, each of readings over its first 45 s.
    readings: list[Reading] = [(epoch_ms(T10) + m * MINUTE, 80.0, 45_000) for m in range(60)]
    store(gpu, readings)
    whole = hold(gpu, T10 - timedelta(hours=1), T11)  # the hour whole: one SQL statement
    part = hold(gpu, T10 + timedelta(minutes=20), T10 + timedelta(minutes=40))  # a piece
    expected = check([whole, part], {gpu.meter_id: readings})
    assert expected[whole.pk, T10] == Usage(3_600_000, 60 * 45_000 * 80 // 100, 60 * 15_000)
    assert expected[part.pk, T10] == Usage(1_200_000, 20 * 45_000 * 80 // 100, 20 * 15_000)


def test_a_mean_crossing_an_hours_end_counts_in_each_hour_what_it_covered_there() -> None:
    gpu = DeviceFactory.create()
    end = epoch_ms(T11)
    readings: list[Reading] = [
        (end - 30_000, 50.0, 60_000),  # covers 10:59:30-11:00:30: half in each hour
        (end + 40_000, 20.0, 30_000),  # the next, 70 s later: covers 11:00:40-11:01:10
        (end + 3 * MINUTE, 90.0, 300_000),  # covered beyond the hold: the hold still caps it
    ]
    store(gpu, readings)
    whole = hold(gpu, T10 - timedelta(hours=1), None)
    across = hold(gpu, T10 + timedelta(minutes=50), T11 + timedelta(minutes=10))
    expected = check([whole, across], {gpu.meter_id: readings})
    measured_after = 30_000 + 30_000 + HOLD_MS
    assert expected[whole.pk, T10].unmeasured_gpu_ms == MS_PER_HOUR - 30_000
    assert expected[whole.pk, T11].unmeasured_gpu_ms == MS_PER_HOUR - measured_after
    assert expected[across.pk, T10] == Usage(600_000, 15_000, 570_000)
    assert expected[across.pk, T11] == Usage(
        600_000, 15_000 + 6_000 + 108_000, 600_000 - measured_after
    )


def test_single_readings_and_means_mixed_each_hold_by_their_own_rule() -> None:
    gpu = DeviceFactory.create()
    # Every minute, a single reading (null: holds to the next) or a mean covering 30 s.
    readings: list[Reading] = [
        (epoch_ms(T10) + m * MINUTE, 40.0, None if m % 2 else 30_000) for m in range(60)
    ]
    store(gpu, readings)
    whole = hold(gpu, T10, T11)
    part = hold(gpu, T10 + timedelta(minutes=1), T10 + timedelta(minutes=5))
    expected = check([whole, part], {gpu.meter_id: readings})
    # 30 single readings hold 60 s each (the last, at 10:59, up to 11:00); 30 means 30 s.
    assert expected[whole.pk, T10].unmeasured_gpu_ms == 30 * 30_000
    # 10:01-10:05: readings at 1 and 3 hold a minute, means at 2 and 4 half of one.
    assert expected[part.pk, T10].unmeasured_gpu_ms == 2 * 30_000


# Whole and half percents: sums exact in doubles, whatever order the database adds them in.
utilisations = st.one_of(
    st.none(), st.integers(min_value=0, max_value=200).map(lambda half: half / 2)
)
# Milliseconds from 10:00, from before the hour (beyond a hold) to past 11:00.
instants = st.integers(min_value=-300_000, max_value=7_300_000)
allocation_bounds = st.tuples(
    st.integers(min_value=-30, max_value=130),  # start, minutes from 10:00
    st.one_of(st.none(), st.integers(min_value=1, max_value=150)),  # minutes held, or open
)


def _allocations(gpu: Device, bounds: list[tuple[int, int | None]]) -> list[Allocation]:
    return [
        hold(
            gpu,
            T10 + timedelta(minutes=start),
            None if held is None else T10 + timedelta(minutes=start + held),
        )
        for start, held in bounds
    ]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    samples=st.lists(
        st.tuples(instants, utilisations, st.one_of(st.none(), st.integers(1, HOLD_MS))),
        max_size=40,
        unique_by=lambda sample: sample[0],
    ),
    bounds=st.lists(allocation_bounds, min_size=1, max_size=3),
)
def test_coverage_follows_the_covered_rule_sample_by_sample(
    samples: list[tuple[int, float | None, int | None]], bounds: list[tuple[int, int | None]]
) -> None:
    with transaction.atomic():
        gpu = DeviceFactory.create()
        readings = [(epoch_ms(T10) + offset, util, covered) for offset, util, covered in samples]
        store(gpu, readings)
        check(_allocations(gpu, bounds), {gpu.meter_id: readings})
        transaction.set_rollback(True)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    samples=st.lists(
        st.tuples(instants, utilisations, st.integers(min_value=0, max_value=HOLD_MS)),
        max_size=40,
        unique_by=lambda sample: sample[0],
    ),
    bounds=st.lists(allocation_bounds, min_size=1, max_size=3),
)
def test_a_mean_covering_its_whole_gap_bills_as_a_single_reading(
    samples: list[tuple[int, float | None, int]], bounds: list[tuple[int, int | None]]
) -> None:
    with transaction.atomic():
        gpu = DeviceFactory.create()
        single: list[Reading] = [
            (epoch_ms(T10) + offset, util, None) for offset, util, _ in samples
        ]
        store(gpu, single)
        allocations = _allocations(gpu, bounds)
        as_single = check(allocations, {gpu.meter_id: single})
        # Each a mean covering its gap (or more, up to the hold), the last one the hold.
        beyond = {epoch_ms(T10) + offset: more for offset, _, more in samples}
        stored = Sample.objects.filter(device_uuid=gpu.meter_id)
        means: list[Reading] = []
        for ts_ms, util, gap_ms in stored.values_list("ts_ms", "gpu_util", "gap_ms"):
            covered = HOLD_MS if gap_ms is None else min(gap_ms + beyond[ts_ms], HOLD_MS)
            stored.filter(ts_ms=ts_ms).update(covered_ms=covered)
            means.append((ts_ms, util, covered))
        assert check(allocations, {gpu.meter_id: means}) == as_single
        assert rolled_up() == as_single
        transaction.set_rollback(True)
