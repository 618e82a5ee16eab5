"""Samples that are means over an interval (`covered_seconds`, sent by the agent with
TALLY_AGENT_MEAN_SECONDS): refused past the hold, and billed as the readings they average."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agent.means import Averager
from agent.readings import GpuReading
from billing import rollup
from billing.ingest import ingest, validate_samples
from billing.models import UsageHour
from inventory.models import Allocation
from tests.factories import AllocationFactory, DeviceFactory

pytestmark = pytest.mark.django_db

HOUR_START = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)


def sample(**fields: Any) -> dict[str, Any]:
    return {"uuid": "GPU-a", "ts": HOUR_START.isoformat(), "gpu_util": 10.0, **fields}


@pytest.mark.parametrize(
    ("covered", "reason"),
    [
        (121, "samples[0].covered_seconds: must be more than 0 and at most 120 "),
        (0, "samples[0].covered_seconds: must be more than 0 and at most 120 "),
        ("60", 'samples[0].covered_seconds: must be a number of seconds, not "60"'),
        (True, "samples[0].covered_seconds: must be a number of seconds, not true"),
    ],
)
def test_a_mean_over_longer_than_the_hold_is_refused_naming_the_field(
    covered: object, reason: str
) -> None:
    valid, rejected = validate_samples([sample(covered_seconds=covered)])
    assert valid == []
    [entry] = rejected
    assert entry["reason"].startswith(reason)
    if isinstance(covered, int) and not isinstance(covered, bool):
        assert (
            f"(TALLY_SAMPLE_HOLD_SECONDS, how long a sample holds), not {covered}"
            in (entry["reason"])
        )


def test_a_mean_within_the_hold_is_accepted() -> None:
    valid, rejected = validate_samples([sample(covered_seconds=60), sample(covered_seconds=0.5)])
    assert rejected == [] and len(valid) == 2


def _usage(allocation: Allocation) -> tuple[int, int, int]:
    row = UsageHour.objects.get(allocation=allocation)
    return row.allocated_gpu_ms, row.utilised_gpu_ms, row.unmeasured_gpu_ms


def test_minute_means_bill_as_the_readings_a_second_they_average() -> None:
    each_second, means = DeviceFactory.create(), DeviceFactory.create()
    by_reading = AllocationFactory.create(
        device=each_second, start=HOUR_START, end=HOUR_START + timedelta(hours=1)
    )
    by_mean = AllocationFactory.create(
        device=means, start=HOUR_START, end=HOUR_START + timedelta(hours=1)
    )
    averager = Averager(seconds=60, interval=1)
    readings, averaged = [], []
    for second in range(3600):
        minute = second // 60
        # Busy a different part of each minute; two minutes not measured at all.
        util = None if minute in (20, 21) else (100.0 if second % 60 < minute % 7 * 8 else 0.0)
        at = HOUR_START + timedelta(seconds=second)
        readings.append(GpuReading(uuid=each_second.meter_id, ts=at, gpu_util=util,
                                   mem_used_bytes=None))  # fmt: skip
        averaged += averager.add(
            [GpuReading(uuid=means.meter_id, ts=at, gpu_util=util, mem_used_bytes=None)]
        )
    averaged += averager.flush()
    assert len(averaged) == 60
    for batch in ([reading.as_sample() for reading in readings], [m.sample for m in averaged]):
        valid, rejected = validate_samples(batch)
        assert rejected == []
        ingest(node="", samples=valid, received_at=timezone.now())

    rollup.rollup_hours(hours=[HOUR_START])

    allocated, utilised, unmeasured = _usage(by_reading)
    assert (allocated, unmeasured) == (3_600_000, 120_000)  # the two minutes not measured
    mean_allocated, mean_utilised, mean_unmeasured = _usage(by_mean)
    assert (mean_allocated, mean_unmeasured) == (allocated, unmeasured)
    # The same utilised time, but for the agent's rounding of each mean to 1/1000 of a percent.
    assert abs(mean_utilised - utilised) <= 60
    assert utilised == sum(minute % 7 * 8 for minute in range(60) if minute not in (20, 21)) * 1000
