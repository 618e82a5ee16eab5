"""Property: usage totals don't depend on how samples arrive or how often rollups run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import transaction
from django.db.models import Sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory import services as inventory_services
from metering import ingest, rollup
from metering.models import Sample, UsageHour
from tests.billing.test_chargeback import SLICE, claim, snapshot

pytestmark = pytest.mark.django_db
T10 = datetime(2026, 10, 15, 10, 0, tzinfo=UTC)
NOW = T10 + timedelta(days=1)


@pytest.fixture
def held() -> None:
    """The H100 and the MIG device of the chargeback scenario, both held 10:00-12:30."""
    snapshot([SLICE, claim("train", "gpu-0", T10), claim("tune", "gpu-1-mig-3g40gb-0", T10)], T10)
    snapshot([], T10 + timedelta(hours=2, minutes=30), kinds=["ResourceClaim"])


samples_strategy = st.lists(
    st.tuples(
        st.sampled_from(["GPU-H", "MIG-A", "GPU-UNKNOWN"]),
        st.integers(min_value=-5, max_value=200),  # minutes after 10:00
        st.integers(min_value=0, max_value=59),  # seconds
        st.one_of(st.none(), st.floats(min_value=0, max_value=100, allow_nan=False)),
    ),
    min_size=1,
    max_size=60,
    unique_by=lambda s: (s[0], s[1], s[2]),
)


def totals() -> tuple[int, int, int]:
    sums = UsageHour.objects.aggregate(
        a=Sum("allocated_gpu_ms"), u=Sum("utilised_gpu_ms"), m=Sum("unmeasured_gpu_ms")
    )
    return sums["a"] or 0, sums["u"] or 0, sums["m"] or 0


def send(batch: list[dict[str, Any]]) -> None:
    valid, rejected = ingest.validate_samples(batch, now=NOW)
    assert rejected == []
    ingest.ingest(node="node-a", samples=valid, received_at=NOW)


def roll(hours: range) -> None:
    for hour in hours:
        rollup.rollup_hours(hours=[T10.replace(hour=hour)], now=NOW)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    readings=samples_strategy,
    order=st.randoms(use_true_random=False),
    batch_size=st.integers(min_value=1, max_value=20),
    duplicated=st.booleans(),
)
def test_totals_do_not_depend_on_arrival_or_reruns(
    held: None, readings: list[Any], order: Any, batch_size: int, duplicated: bool
) -> None:
    samples = [
        {
            "uuid": uuid,
            "ts": (T10 + timedelta(minutes=minute, seconds=second)).isoformat(),
            "gpu_util": util,
        }
        for uuid, minute, second, util in readings
    ]
    with transaction.atomic():
        # In order, one batch, rolled up once.
        send(samples)
        roll(range(10, 13))
        expected = totals()
        transaction.set_rollback(True)
    with transaction.atomic():
        # Shuffled, split, maybe sent twice; rolled up over overlapping windows, twice.
        shuffled = list(samples)
        order.shuffle(shuffled)
        for start in range(0, len(shuffled), batch_size):
            send(shuffled[start : start + batch_size])
            if duplicated:
                send(shuffled[start : start + batch_size])
        roll(range(9, 13))
        roll(range(11, 14))
        assert totals() == expected
        assert Sample.objects.count() == len(
            {(s["uuid"], s["ts"]) for s in samples if s["uuid"] != "GPU-UNKNOWN"}
        )
        transaction.set_rollback(True)
    # Allocation time never depends on samples: 2.5 h of an H100 plus 2.5 h of 3/7 of an A100
    # (each hour rounded to the millisecond: 1,542,856 + 1,542,856 + 771,428).
    assert expected[0] == 9_000_000 + 3_857_140


def test_allocated_time_is_the_allocation_interval(held: None) -> None:
    roll(range(8, 14))
    allocated, utilised, unmeasured = totals()
    assert (allocated, utilised, unmeasured) == (9_000_000 + 3_857_140, 0, 9_000_000 + 3_857_140)
    cluster = inventory_services.get_cluster("default")
    assert UsageHour.objects.filter(cluster=cluster).count() == 6
