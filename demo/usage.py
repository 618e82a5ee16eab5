"""A week of believable usage for the demo fleet: samples for every held device, rolled up
and priced, so the portal has charts and statements the moment the service starts."""

from __future__ import annotations

import math
import random
from datetime import datetime, timedelta

from billing import ingest, pricing, rollup
from billing.hours import epoch_ms, hours_between
from billing.models import Sample
from billing.periods import period_bounds
from db.copy import bulk_insert
from inventory.models import Allocation, Cluster

# How a job uses its GPUs: a level and how much it wanders, in percent.
PATTERNS = {"busy": (88, 8), "bursty": (45, 40), "idle": (3, 3), "notebook": (12, 15)}
STEP = timedelta(seconds=120)


def load_demo_usage(*, cluster: Cluster, now: datetime, days: int = 7, seed: int = 0) -> int:
    """Samples every two minutes for the devices held over the last `days`, then the rollups
    and the open period's statements. Returns how many samples were written."""
    rng = random.Random(seed)
    since = now - timedelta(days=days)
    written = 0
    sampled: set[tuple[str, int]] = set()  # a device held twice (shared) is sampled once
    allocations = (
        Allocation.objects.filter(cluster=cluster, device__isnull=False, start__lt=now)
        .select_related("device")
        .order_by("pk")
    )
    for allocation in allocations:
        assert allocation.device is not None
        if not allocation.device.uuid:
            continue
        level, spread = PATTERNS[rng.choice(list(PATTERNS))]
        moment = max(allocation.start, since)
        end = min(allocation.end or now, now)
        rows = []
        while moment < end:
            key = (allocation.device.uuid, epoch_ms(moment))
            if key in sampled:
                moment += STEP
                continue
            sampled.add(key)
            # A daily rhythm, so the charts look like a week of work.
            daily = math.sin(moment.hour / 24 * 2 * math.pi) * spread / 2
            util = min(100.0, max(0.0, level + daily + rng.uniform(-spread, spread) / 2))
            rows.append(
                Sample(
                    device_uuid=allocation.device.uuid,
                    ts_ms=epoch_ms(moment),
                    gpu_util=round(util, 1),
                    node="demo",
                    received_at=now,
                )
            )
            moment += STEP
        bulk_insert(Sample, rows)
        written += len(rows)
    ingest.fill_gaps({uuid for uuid, _ in sampled})
    rollup.rollup_hours(hours=hours_between(since, now), now=now)
    for start in {period_bounds(since)[0], period_bounds(now)[0]}:
        pricing.refresh_statements(period=pricing.period_for(start))
    return written
