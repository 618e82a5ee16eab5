"""Believable usage for the demo fleet: samples for every hour its claims have held a device, then
billed as Celery beat and `run_billing` bill, so the portal has charts and statements the moment
the service starts, and billing again at that moment changes nothing.

Every allocation is sampled from its start to `now`, every ten minutes (at most the sample hold,
TALLY_SAMPLE_HOLD_SECONDS, which `dev.py serve` sets to ten minutes for the demo: five weeks of
two clusters every two minutes would be two million samples), and a claim still held once more
at `now`, so no held hour is unmeasured, nor the first minutes after the load. One claim of
whole GPUs, held for a week or more (`_forgotten_claim`), is the demo's forgotten job: allocated
and near idle since it started. Jobs follow the history's changes (`Slowdown`): below their
usual level until a change. The samples are written in bulk, each with its gap to its device's
next one as `ingest` keeps it (`metering.ingest`'s `fill_gaps` would find nothing to change), but
for those of an agent that could not report (`Outage`): held back, to be sent late through
`ingest` once the period they fall in has closed (`deliver_late_samples`), which makes the
late-data adjustment of the next statement.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

from billing import services
from billing.periods import period_bounds
from db.copy import insert_rows
from inventory.models import Allocation, Cluster, DeviceKind, ResourceClaim
from metering import ingest
from metering import services as metering_services
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
FORGOTTEN_FOR = timedelta(days=7)
STEP = timedelta(minutes=10)
SAMPLE_COLUMNS = ("device_uuid", "ts_ms", "gpu_util", "node", "received_at", "gap_ms")
SAMPLE_TYPES = ("text", "bigint", "float8", "text", "timestamptz", "bigint")
BATCH = 50_000
ACTOR = "load_demo"


@dataclass(frozen=True)
class Slowdown:
    """Jobs that ran at `factor` of their usual level before `until`: those on `node` of
    `cluster`, or those of `namespace`."""

    until: datetime
    factor: float
    cluster: str = ""
    node: str = ""
    namespace: str = ""

    def applies(self, allocation: Allocation) -> bool:
        if self.namespace:
            return allocation.claim.namespace == self.namespace
        device = allocation.device
        return (
            device is not None
            and device.node is not None
            and device.node.name == self.node
            and allocation.cluster.name == self.cluster
        )


@dataclass(frozen=True)
class Outage:
    """The agent of `node` of `cluster` could not report over `[start, end)`: its samples
    of then are held back, to arrive late."""

    cluster: str
    node: str
    start: datetime
    end: datetime


@dataclass
class DemoUsage:
    """What `load_demo_usage` made: samples written, the idle claim, and the samples held
    back by the outage, as the agent sends them (`ingest`'s JSON)."""

    samples: int
    idle_claim: ResourceClaim | None
    late: list[dict[str, Any]] = field(default_factory=list)


def load_demo_usage(
    *,
    clusters: Sequence[Cluster],
    now: datetime,
    seed: int = 0,
    slowdowns: Sequence[Slowdown] = (),
    outage: Outage | None = None,
) -> DemoUsage:
    """Sample every allocation of the clusters from its start to `now`; a device held by two
    claims (shared) is sampled once, as the first of them uses it."""
    rng = random.Random(seed)
    allocations = list(
        Allocation.objects.filter(cluster__in=clusters, device__isnull=False, start__lt=now)
        .exclude(device__meter_id="")  # not an accelerator: nothing to meter
        .select_related("device", "device__node", "claim", "cluster")
        .order_by("pk")
    )
    idle_claim = _forgotten_claim(allocations, now=now)
    patterns: dict[int, tuple[float, float]] = {}
    for allocation in allocations:  # one pattern per claim
        if allocation.claim_id not in patterns:
            patterns[allocation.claim_id] = PATTERNS[rng.choice(list(PATTERNS))]
    if idle_claim is not None:
        patterns[idle_claim.pk] = FORGOTTEN
    step = min(STEP, timedelta(milliseconds=sample_hold_ms()))
    by_device: dict[int, list[Allocation]] = defaultdict(list)
    for allocation in allocations:
        assert allocation.device_id is not None
        by_device[allocation.device_id].append(allocation)
    written, late = 0, []
    rows: list[tuple[str, int, float, str, datetime, int | None]] = []
    for held in by_device.values():
        device = held[0].device
        assert device is not None
        node = device.node.name if device.node else ""
        readings: dict[int, float] = {}
        for allocation in held:
            level, spread = patterns[allocation.claim_id]
            slow = [change for change in slowdowns if change.applies(allocation)]
            for moment in _moments(allocation, step=step, now=now):
                key = epoch_ms(moment)
                if key in readings:
                    continue
                factor = math.prod(c.factor for c in slow if moment < c.until)
                # A daily rhythm, so the charts look like days of work.
                daily = math.sin(moment.hour / 24 * 2 * math.pi) * spread / 2
                util = level + daily + rng.uniform(-spread, spread) / 2
                readings[key] = round(min(100.0, max(0.0, util * factor)), 1)
        held_back = set()
        if (
            outage is not None
            and node == outage.node
            and held[0].cluster.name == outage.cluster
            and device.uuid == device.meter_id
        ):
            first, last = epoch_ms(outage.start), epoch_ms(outage.end)
            held_back = {key for key in readings if first <= key < last}
            late += [
                {"uuid": device.meter_id, "ts": _iso(key), "gpu_util": readings[key]}
                for key in sorted(held_back)
            ]
        stored = sorted(key for key in readings if key not in held_back)
        gaps: list[int | None] = [b - a for a, b in pairwise(stored)]
        gaps.append(None)
        rows += [
            (device.meter_id, key, readings[key], node, now, gap)
            for key, gap in zip(stored, gaps, strict=True)
        ]
        if len(rows) >= BATCH:
            insert_rows(Sample, SAMPLE_COLUMNS, rows, types=SAMPLE_TYPES)
            written, rows = written + len(rows), []
    insert_rows(Sample, SAMPLE_COLUMNS, rows, types=SAMPLE_TYPES)
    return DemoUsage(written + len(rows), idle_claim, late)


def _moments(allocation: Allocation, *, step: timedelta, now: datetime) -> list[datetime]:
    moments = []
    moment, end = allocation.start, min(allocation.end or now, now)
    while moment < end:
        moments.append(moment)
        moment += step
    if end == now:
        # A claim still held gets a sample at `now` too: its utilisation then holds for
        # the whole sample hold after the load, whatever the grid's phase.
        moments.append(now)
    return moments


def _iso(ms: int) -> str:
    seconds, millis = divmod(ms, 1000)
    return f"{datetime.fromtimestamp(seconds, UTC):%Y-%m-%dT%H:%M:%S}.{millis:03d}Z"


def outage_on(*, cluster: Cluster, start: datetime, end: datetime) -> Outage | None:
    """An outage over `[start, end)` of the agent of the first node (by name) with a whole
    GPU held all that time; None when no node has one."""
    node = (
        Allocation.objects.filter(
            cluster=cluster,
            device__kind=DeviceKind.GPU,
            device__node__isnull=False,
            start__lte=start,
        )
        .exclude(device__uuid="")
        .exclude(end__lt=end)
        .order_by("device__node__name")
        .values_list("device__node__name", flat=True)
        .first()
    )
    return None if node is None else Outage(cluster.name, node, start, end)


@dataclass
class LateDelivery:
    """What `deliver_late_samples` did: the samples the agent sent, and the billing run of the
    open period that took their hours."""

    report: ingest.IngestReport
    run: services.BillingRun


def deliver_late_samples(
    *, cluster: Cluster, outage: Outage, samples: list[dict[str, Any]], now: datetime
) -> LateDelivery:
    """The agent of the outage's node reports again: its held-back samples sent as it sends
    them (its own token, checked and stored by `ingest`), then the open period billed as
    `run_billing` bills it, which rolls up the hours they touched and, for a closed period's,
    adds the adjustment lines of the late data."""
    token = metering_services.issue_agent_token(cluster=cluster, node=outage.node, actor=ACTOR)
    agent = ingest.authenticate(token)
    rows, rejected = ingest.validate_samples(samples, now=now)
    if rejected:
        raise ValueError(f"late samples rejected: {rejected[:3]}")
    report = ingest.ingest(node=outage.node, samples=rows, received_at=now, agent=agent)
    current, _ = period_bounds(now)
    run = services.bill_period(period_start=current, now=now, actor=ACTOR)
    return LateDelivery(report=report, run=run)


def _forgotten_claim(allocations: Iterable[Allocation], *, now: datetime) -> ResourceClaim | None:
    """The open claim of whole GPUs that would waste most: of those held for `FORGOTTEN_FOR`
    (a week: the team page's wasters look at one), the one of most GPUs, then held longest,
    then first; else the one held longest."""
    claims: dict[int, list[Allocation]] = defaultdict(list)
    for allocation in allocations:
        device = allocation.device
        if allocation.end is None and device is not None and device.kind == DeviceKind.GPU:
            claims[allocation.claim_id].append(allocation)
    if not claims:
        return None

    def since(held: list[Allocation]) -> tuple[datetime, int]:
        return min((allocation.start, allocation.pk) for allocation in held)

    long_held = [held for held in claims.values() if since(held)[0] <= now - FORGOTTEN_FOR]
    if long_held:
        chosen = min(long_held, key=lambda held: (-len(held), since(held)))
    else:
        chosen = min(claims.values(), key=since)
    return chosen[0].claim


def bill_periods(*, since: datetime, now: datetime) -> list[services.BillingRun]:
    """Bill each period from the one holding `since` to the one holding `now` with the
    services beat and `run_billing` use, so running either again changes nothing: every
    period before the current one is closed (the previous one by `close_due_period` when its
    close is due, as beat closes it; else, and an older one, by `bill_period`'s close, as
    finance closes one), and the current one is rolled up and priced to `now`. The first run
    also works off the hours the import marked."""
    current, _ = period_bounds(now)
    previous, _ = period_bounds(current - timedelta(microseconds=1))
    runs = []
    start, _ = period_bounds(since)
    while start < current:
        run = (
            services.close_due_period(now=now, actor=ACTOR) if start == previous else None
        ) or services.bill_period(period_start=start, now=now, close=True, actor=ACTOR)
        runs.append(run)
        start = run.period.end
    runs.append(services.bill_period(period_start=current, now=now))
    return runs
