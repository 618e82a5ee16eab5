"""Believable usage for the demo fleet: samples for every hour its claims have held a device,
then billed as Celery beat and `run_billing` bill, so the portal has charts and statements the
moment the service starts, and billing again at that moment changes nothing.

Every allocation is sampled from its start to `now`, every two minutes (at most the sample
hold), and a claim still held once more at `now`, so no held hour is unmeasured, nor the
first two minutes after the load. One claim, the one of whole GPUs held longest, is the
demo's forgotten job: allocated and near idle since it started.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from billing import services
from billing.periods import period_bounds
from db.copy import insert_rows
from inventory.models import Allocation, Cluster, DeviceKind, ResourceClaim
from metering import ingest
from metering.hours import epoch_ms, sample_hold_ms
from metering.models import Sample

# How a job uses its GPUs: a level and how much it wanders, in percent.
PATTERNS: dict[str, tuple[float, float]] = {
    "busy": (88, 8),
    "bursty": (45, 40),
    "idle": (3, 3),
    "notebook": (12, 15),
}
FORGOTTEN = (0.5, 1.0)  # the idle claim's: next to nothing, for days
STEP = timedelta(seconds=120)
SAMPLE_COLUMNS = ("device_uuid", "ts_ms", "gpu_util", "node", "received_at")
SAMPLE_TYPES = ("text", "bigint", "float8", "text", "timestamptz")
ACTOR = "load_demo"


@dataclass
class DemoUsage:
    """What `load_demo_usage` made: samples written, the idle claim, the billing runs."""

    samples: int
    idle_claim: ResourceClaim | None
    runs: list[services.BillingRun]


def load_demo_usage(*, cluster: Cluster, now: datetime, seed: int = 0) -> DemoUsage:
    """Sample every allocation of the cluster from its start to `now`, then bill every period
    its claims reach as beat would by `now` (`bill_periods`)."""
    rng = random.Random(seed)
    allocations = list(
        Allocation.objects.filter(cluster=cluster, device__isnull=False, start__lt=now)
        .exclude(device__meter_id="")  # not an accelerator: nothing to meter
        .select_related("device", "device__node", "claim")
        .order_by("pk")
    )
    idle_claim = _forgotten_claim(allocations)
    patterns: dict[int, tuple[float, float]] = {}
    for allocation in allocations:  # one pattern per claim
        if allocation.claim_id not in patterns:
            patterns[allocation.claim_id] = PATTERNS[rng.choice(list(PATTERNS))]
    if idle_claim is not None:
        patterns[idle_claim.pk] = FORGOTTEN
    step = min(STEP, timedelta(milliseconds=sample_hold_ms()))
    written = 0
    sampled: set[tuple[str, int]] = set()  # a device held twice (shared) is sampled once
    for allocation in allocations:
        device = allocation.device
        assert device is not None
        level, spread = patterns[allocation.claim_id]
        node = device.node.name if device.node else ""
        rows: list[tuple[str, int, float, str, datetime]] = []
        moment, end = allocation.start, min(allocation.end or now, now)
        moments = []
        while moment < end:
            moments.append(moment)
            moment += step
        if end == now:
            # A claim still held gets a sample at `now` too: its utilisation then holds for
            # the whole sample hold after the load, whatever the grid's phase.
            moments.append(now)
        for moment in moments:
            key = (device.meter_id, epoch_ms(moment))
            if key not in sampled:
                sampled.add(key)
                # A daily rhythm, so the charts look like days of work.
                daily = math.sin(moment.hour / 24 * 2 * math.pi) * spread / 2
                util = min(100.0, max(0.0, level + daily + rng.uniform(-spread, spread) / 2))
                rows.append((device.meter_id, key[1], round(util, 1), node, now))
        insert_rows(Sample, SAMPLE_COLUMNS, rows, types=SAMPLE_TYPES)
        written += len(rows)
    ingest.fill_gaps({meter_id for meter_id, _ in sampled})
    since = min((allocation.start for allocation in allocations), default=now)
    return DemoUsage(written, idle_claim, bill_periods(since=since, now=now))


def _forgotten_claim(allocations: Iterable[Allocation]) -> ResourceClaim | None:
    """The open claim of whole GPUs held longest (the first such claim on a tie)."""
    open_whole = [
        allocation
        for allocation in allocations
        if allocation.end is None
        and allocation.device is not None
        and allocation.device.kind == DeviceKind.GPU
    ]
    if not open_whole:
        return None
    return min(open_whole, key=lambda allocation: (allocation.start, allocation.pk)).claim


def bill_periods(*, since: datetime, now: datetime) -> list[services.BillingRun]:
    """Bill each period from the one holding `since` to the one holding `now` with the
    services beat and `run_billing` use, so running either again changes nothing: the
    previous period is closed when its close is due (`close_due_period`, as beat), an older
    one, which beat would have closed on its day, is closed, and the rest are rolled up and
    priced to `now`. The first run also works off the hours the import marked."""
    current, _ = period_bounds(now)
    previous, _ = period_bounds(current - timedelta(microseconds=1))
    runs = []
    start, _ = period_bounds(since)
    while start < current:
        run = (
            services.close_due_period(now=now, actor=ACTOR) if start == previous else None
        ) or services.bill_period(period_start=start, now=now, close=start < previous, actor=ACTOR)
        runs.append(run)
        start = run.period.end
    runs.append(services.bill_period(period_start=current, now=now))
    return runs
