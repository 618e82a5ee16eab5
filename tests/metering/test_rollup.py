"""The rollup's coverage against a plain-Python reading of its rules, on random histories.

Each sample's utilisation holds from its timestamp until the device's next sample, for at most
`TALLY_SAMPLE_HOLD_SECONDS`; allocated time no sample covers is unmeasured; a MIG device
counts its share of its GPU; samples from just before the hour count into it. The reference
below applies these rules to every sample of the device, one by one; the rollup's SQL reads
only the hour (and a hold before it), per device for allocations that hold the whole hour and
per allocation for the others, so both of its statements are checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory.models import Allocation, Device
from metering import ingest, rollup
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from metering.models import UsageHour
from teams.models import Team
from tests.factories import AllocationFactory, DeviceFactory, MigDeviceFactory

pytestmark = pytest.mark.django_db

T10 = datetime(2026, 10, 15, 10, 0, tzinfo=UTC)
LATER = T10 + timedelta(days=1)
MS = timedelta(milliseconds=1)


def ms(at: datetime) -> int:
    return epoch_ms(at)


def round_half_up(value: Decimal) -> int:
    return int(value.to_integral_value(ROUND_HALF_UP))


@dataclass(frozen=True)
class Expected:
    allocated_gpu_ms: int
    utilised_gpu_ms: int
    unmeasured_gpu_ms: int


def reference(
    allocation: Allocation, samples: list[tuple[int, float | None]], hold_ms: int, now: datetime
) -> Expected | None:
    """The usage row of `allocation` for the hour at T10, from every sample of its device."""
    assert allocation.device is not None
    start = max(ms(allocation.start), ms(T10))
    end = min(ms(allocation.end) if allocation.end else ms(now), ms(T10) + 3_600_000, ms(now))
    if end <= start:
        return None
    covered, weighted = 0, 0
    ordered = sorted(samples)
    for index, (ts, util) in enumerate(ordered):
        following = ordered[index + 1][0] if index + 1 < len(ordered) else None
        span_end = ts + hold_ms if following is None else min(following, ts + hold_ms)
        overlap = min(span_end, end) - max(ts, start)
        if util is not None and overlap > 0:
            covered += overlap
            weighted += overlap * round(util * 1_000_000)  # millionths of a percent
    share = allocation.device.gpu_share
    return Expected(
        allocated_gpu_ms=round_half_up((end - start) * share),
        # Millionths of a percent summed as integers, exact in any order; rounded half up.
        utilised_gpu_ms=(weighted * int(share * 1_000_000) + 5 * 10**13) // 10**14,
        unmeasured_gpu_ms=round_half_up((end - start - covered) * share),
    )


def rolled_up() -> dict[int, Expected]:
    return {
        row.allocation_id: Expected(
            row.allocated_gpu_ms, row.utilised_gpu_ms, row.unmeasured_gpu_ms
        )
        for row in UsageHour.objects.filter(hour=T10)
    }


def store(device: Device, samples: list[tuple[int, float | None]]) -> None:
    """The samples, ingested as an agent's batch (in the order given)."""
    rows = [SampleRow(device.uuid, ts, util, None, None) for ts, util in samples]
    ingest.ingest(node="node-a", samples=rows, received_at=T10)


def hold(device: Device, start: datetime, end: datetime | None) -> Allocation:
    return AllocationFactory.create(device=device, start=start, end=end)


def check(
    allocations: list[Allocation],
    samples: dict[str, list[tuple[int, float | None]]],
    *,
    now: datetime = LATER,
    hold_ms: int = 120_000,
) -> dict[int, Expected]:
    rollup.rollup_hours(hours=[T10], now=now)
    expected = {}
    for allocation in allocations:
        assert allocation.device is not None
        row = reference(allocation, samples.get(allocation.device.uuid, []), hold_ms, now)
        if row is not None:
            expected[allocation.pk] = row
    assert rolled_up() == expected
    return expected


# Whole numbers and halves of a percent: every product and sum is exact in a double, so the
# order the database adds them in cannot move a rounding.
utilisations = st.one_of(
    st.none(), st.integers(min_value=0, max_value=200).map(lambda half: half / 2)
)
# Milliseconds from 10:00, from well before the hour (beyond a hold) to after it.
instants = st.integers(min_value=-400_000, max_value=3_800_000)
allocation_bounds = st.tuples(
    st.integers(min_value=-30, max_value=70),  # start, minutes from 10:00
    st.one_of(st.none(), st.integers(min_value=1, max_value=100)),  # minutes held, or open
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    gpu_samples=st.lists(st.tuples(instants, utilisations), max_size=40, unique_by=lambda s: s[0]),
    mig_samples=st.lists(st.tuples(instants, utilisations), max_size=40, unique_by=lambda s: s[0]),
    gpu_holds=st.lists(allocation_bounds, min_size=1, max_size=3),
    mig_holds=st.lists(allocation_bounds, max_size=2),
    now_minutes=st.one_of(st.just(24 * 60), st.integers(min_value=1, max_value=59)),
)
def test_coverage_follows_the_rules_sample_by_sample(
    gpu_samples: list[tuple[int, float | None]],
    mig_samples: list[tuple[int, float | None]],
    gpu_holds: list[tuple[int, int | None]],
    mig_holds: list[tuple[int, int | None]],
    now_minutes: int,
) -> None:
    with transaction.atomic():
        gpu = DeviceFactory.create()
        mig = MigDeviceFactory.create(parent=gpu)
        samples = {
            gpu.uuid: [(ms(T10) + offset, util) for offset, util in gpu_samples],
            mig.uuid: [(ms(T10) + offset, util) for offset, util in mig_samples],
        }
        for device in (gpu, mig):
            store(device, samples[device.uuid])
        allocations = [
            hold(
                device,
                T10 + timedelta(minutes=start),
                None if held is None else T10 + timedelta(minutes=start + held),
            )
            for device, holds in ((gpu, gpu_holds), (mig, mig_holds))
            for start, held in holds
        ]
        check(allocations, samples, now=T10 + timedelta(minutes=now_minutes))
        transaction.set_rollback(True)


def test_whole_hour_and_part_hour_holders_of_one_device() -> None:
    # A shared device: one claim holds it all hour, another from 10:20 to 10:40.
    gpu = DeviceFactory.create()
    minute = 60_000
    samples: list[tuple[int, float | None]] = [
        (ms(T10) - 90_000, 40.0),  # holds into the hour until 10:00:30
        *((ms(T10) + m * minute, float(m)) for m in range(1, 30)),
        *((ms(T10) + m * minute, 90.0) for m in range(35, 60)),  # 10:31-10:35: past the hold
        (ms(T10) + 45 * minute + 1, None),  # measured nothing until 10:46
    ]
    store(gpu, samples)
    whole = hold(gpu, T10 - timedelta(hours=1), None)
    part = hold(gpu, T10 + timedelta(minutes=20), T10 + timedelta(minutes=40))
    expected = check([whole, part], {gpu.uuid: samples})
    assert expected[whole.pk].unmeasured_gpu_ms == 30_000 + 4 * minute + minute - 1
    assert expected[part.pk].unmeasured_gpu_ms == 4 * minute
    assert expected[whole.pk].allocated_gpu_ms == 3_600_000


@override_settings(TALLY_SAMPLE_HOLD_SECONDS=600)
def test_coverage_follows_the_hold_setting() -> None:
    mig = MigDeviceFactory.create()
    samples: list[tuple[int, float | None]] = [
        (ms(T10) - 500_000, 70.0),
        (ms(T10) + 1_800_000, 20.0),
    ]
    store(mig, samples)
    allocations = [hold(mig, T10, None), hold(mig, T10 + timedelta(minutes=5), None)]
    expected = check(allocations, {mig.uuid: samples}, hold_ms=600_000)
    # 100 s of the early sample reach into the hour, then 600 s from 10:30.
    share = mig.gpu_share
    assert expected[allocations[0].pk].unmeasured_gpu_ms == round_half_up(
        (3_600_000 - 700_000) * share
    )


def test_an_hour_without_samples_is_unmeasured_and_rollups_are_idempotent() -> None:
    gpu = DeviceFactory.create()
    allocation = hold(gpu, T10 - timedelta(days=1), None)
    check([allocation], {})
    assert rolled_up()[allocation.pk].unmeasured_gpu_ms == 3_600_000
    store(gpu, [(ms(T10) + 60_000, 50.0)])
    check([allocation], {gpu.uuid: [(ms(T10) + 60_000, 50.0)]})
    check([allocation], {gpu.uuid: [(ms(T10) + 60_000, 50.0)]})
    assert UsageHour.objects.count() == 1
    assert rolled_up()[allocation.pk].utilised_gpu_ms == 60_000


def test_a_consumable_share_counts_the_memory_it_consumed() -> None:
    gpu = DeviceFactory.create()  # 80 GiB
    since = T10 - timedelta(hours=1)
    half = AllocationFactory.create(device=gpu, start=since, consumed_capacity={"memory": "40Gi"})
    whole = AllocationFactory.create(device=gpu, start=since)
    store(gpu, [(ms(T10) + minute * 60_000, 50.0) for minute in range(60)])
    rollup.rollup_hours(hours=[T10], now=LATER)
    assert rolled_up() == {
        half.pk: Expected(1_800_000, 900_000, 0),
        whole.pk: Expected(3_600_000, 1_800_000, 0),
    }


def test_usage_is_charged_to_whom_the_allocation_keeps_not_to_the_claim_now() -> None:
    # Who is charged was fixed on the allocation when it started (the sync resolved the
    # Deployment behind the claim's Pod); what its claim says later changes nothing.
    team = Team.objects.create(slug="vision", name="Vision")
    allocation = AllocationFactory.create(
        device=DeviceFactory.create(),
        start=T10 - timedelta(hours=1),
        team=team,
        job="Deployment/web",
        username="alice",
    )
    claim = allocation.claim
    claim.owner_references = [{"kind": "Job", "name": "other", "controller": True}]
    claim.job, claim.admitted_job, claim.created_by = "Job/other", "Job/other", "mallory"
    claim.save()
    rollup.rollup_hours(hours=[T10], now=T10 + timedelta(hours=2))
    row = UsageHour.objects.get(allocation=allocation)
    assert (row.team, row.job, row.username) == (team, "Deployment/web", "alice")
