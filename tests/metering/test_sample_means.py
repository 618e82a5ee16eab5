"""Samples that are means over an interval (`covered_seconds`, sent by the agent with
TALLY_AGENT_MEAN_SECONDS): refused past the hold, stored in whole milliseconds
(`Sample.covered_ms`) through `/ingest/samples`, and billed as the readings they average."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.means import Averager
from agent.readings import GpuReading
from inventory.models import Allocation, Device
from metering import rollup
from metering.hours import epoch_ms
from metering.ingest import adopt_unknown_samples, ingest, validate_samples
from metering.models import Sample, UnknownDeviceSample, UsageHour
from metering.services import issue_agent_token
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


def post(device: Device, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples sent as the agent of `device`'s node sends them, with its token."""
    assert device.node is not None
    token = issue_agent_token(cluster=device.cluster, node=device.node.name, actor="ops")
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": device.node.name, "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()
    return answer


def covered(uuid: str) -> list[tuple[int, int | None]]:
    return list(
        Sample.objects.filter(device_uuid=uuid).order_by("ts_ms").values_list("ts_ms", "covered_ms")
    )


# (covered_seconds as sent, ms stored): rounded half up from the decimal sent, never through
# binary error (4.0005 * 1000 is 4000.4999999999995 as a float) nor half to even.
COVERED = [(60, 60_000), (59.997, 59_997), (4.0005, 4_001), (0.0025, 3), (120.0, 120_000)]


@pytest.mark.parametrize("repeated", [False, True], ids=["copied", "general way"])
def test_a_means_covered_time_is_stored_in_whole_milliseconds(repeated: bool) -> None:
    gpu = DeviceFactory.create()
    samples = [
        sample(uuid=gpu.uuid, ts=(HOUR_START + timedelta(minutes=i)).isoformat(), covered_seconds=c)
        for i, (c, _) in enumerate(COVERED)
    ]
    single = sample(uuid=gpu.uuid, ts=(HOUR_START + timedelta(minutes=9)).isoformat())
    # A device and instant sent twice in one batch takes the general way (a temporary table,
    # then INSERT ... SELECT) instead of the binary COPY into the samples.
    sent = [*samples, single, *([samples[0]] if repeated else [])]
    answer = post(gpu, sent)
    assert (answer["accepted"], answer["duplicates"], answer["rejected"]) == (
        len(COVERED) + 1,
        int(repeated),
        [],
    )
    assert covered(gpu.uuid) == [
        *((epoch_ms(HOUR_START) + i * 60_000, ms) for i, (_, ms) in enumerate(COVERED)),
        (epoch_ms(HOUR_START) + 9 * 60_000, None),  # a single reading
    ]


def test_a_mean_sent_again_keeps_the_covered_time_first_stored() -> None:
    gpu = DeviceFactory.create()
    post(gpu, [sample(uuid=gpu.uuid, covered_seconds=30)])
    answer = post(gpu, [sample(uuid=gpu.uuid, covered_seconds=60)])
    assert (answer["accepted"], answer["duplicates"]) == (0, 1)
    assert covered(gpu.uuid) == [(epoch_ms(HOUR_START), 30_000)]


def test_a_covered_time_under_half_a_millisecond_is_refused() -> None:
    _, rejected = validate_samples([sample(covered_seconds=0.0004)])
    [entry] = rejected
    assert entry["reason"] == (
        "samples[0].covered_seconds: 0.0004 is under half a millisecond, which is what it is "
        "stored in"
    )


def test_a_mean_set_aside_is_adopted_with_its_covered_time() -> None:
    gpu = DeviceFactory.create()
    single = sample(uuid="GPU-not-synced-yet", ts=(HOUR_START + timedelta(minutes=1)).isoformat())
    # The mean sent twice before the sync: set aside once.
    mean = sample(uuid="GPU-not-synced-yet", covered_seconds=59.997)
    answer = post(gpu, [mean, single, mean])
    assert (answer["accepted"], answer["duplicates"]) == (2, 1)
    assert answer["unknown_devices"] == ["GPU-not-synced-yet"]
    assert sorted(UnknownDeviceSample.objects.values_list("ts_ms", "covered_ms")) == [
        (epoch_ms(HOUR_START), 59_997),
        (epoch_ms(HOUR_START) + 60_000, None),
    ]
    Device.objects.filter(pk=gpu.pk).update(
        uuid="GPU-not-synced-yet", meter_id="GPU-not-synced-yet"
    )
    assert adopt_unknown_samples(now=timezone.now()) == 2
    assert adopt_unknown_samples(now=timezone.now()) == 0  # nothing left, nothing changed
    assert covered("GPU-not-synced-yet") == [
        (epoch_ms(HOUR_START), 59_997),
        (epoch_ms(HOUR_START) + 60_000, None),  # a single reading stays one
    ]
    assert UnknownDeviceSample.objects.count() == 0


def test_a_mean_set_aside_and_sent_again_after_the_sync_is_stored_once() -> None:
    gpu = DeviceFactory.create()
    post(gpu, [sample(uuid="GPU-not-synced-yet", covered_seconds=30)])
    Device.objects.filter(pk=gpu.pk).update(
        uuid="GPU-not-synced-yet", meter_id="GPU-not-synced-yet"
    )
    # The agent sends it again (a retry) before the adoption runs: stored as sent now.
    answer = post(gpu, [sample(uuid="GPU-not-synced-yet", covered_seconds=60)])
    assert (answer["accepted"], answer["unknown_devices"]) == (1, [])
    assert adopt_unknown_samples(now=timezone.now()) == 0  # the one stored wins
    assert covered("GPU-not-synced-yet") == [(epoch_ms(HOUR_START), 60_000)]
    assert UnknownDeviceSample.objects.count() == 0


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
