"""Hourly usage: allocation intervals split into utilised, idle and unmeasured GPU time.

Allocated time comes from the allocation history, exactly. Samples only split it: each
sample's utilisation holds from its timestamp until the device's next sample, for at most
`TALLY_SAMPLE_HOLD_SECONDS`; allocated time that no sample covers is unmeasured. Rolling up
an hour replaces that hour's rows, so reruns and duplicate deliveries give the same rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone
from kubernetes.utils import parse_quantity

from billing.models import DirtyHour, UsageHour
from config import metrics
from inventory.bulk import insert_rows, json_rows
from inventory.models import Allocation
from quota.models import Reservation, ReservationState, TeamNamespace

log = logging.getLogger(__name__)
HOUR = timedelta(hours=1)
HOUR_MS = 3_600_000


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def hour_start(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


class _Interval(NamedTuple):
    """One allocation's part of the hour, with what its usage row needs (no model instances:
    an hour of a large fleet is thousands of these)."""

    allocation_id: int
    cluster_id: int
    claim_namespace: str
    claim_name: str
    job: str  # the claim's job as the sync resolved it (ResourceClaim.job)
    device_uuid: str
    product_name: str
    profile: str
    start_ms: int
    end_ms: int
    share: Decimal


# Dialects: PostgreSQL's GREATEST/LEAST are SQLite's multi-argument MAX/MIN (no argument is
# ever null here).
_GREATEST = {"postgresql": "GREATEST", "sqlite": "MAX"}
_LEAST = {"postgresql": "LEAST", "sqlite": "MIN"}

# Each sample's utilisation holds from its timestamp for its gap to the device's next sample,
# at most the hold: `e` is where that ends. A span (at most an hour long) lies in the sample's
# own hour `h` and perhaps the next; per device and hour, the parts in each (`a`: in hour h,
# `b`: in hour h + 1), clipped to the window, and those weighted by utilisation (percent).
# One pass over the window's samples in any order, grouped as they come: no sort, no join,
# and on PostgreSQL parallel workers when the window is large.
_DEVICE_HOURS_SQL = """
SELECT device_uuid, h, SUM(a), SUM(a * gpu_util), SUM(b), SUM(b * gpu_util)
FROM (
    SELECT device_uuid, gpu_util, h,
           {greatest}({least}(e, %(end)s, (h + 1) * {hour}) - {greatest}(ts_ms, %(start)s), 0) AS a,
           {greatest}({least}(e, %(end)s) - {greatest}((h + 1) * {hour}, %(start)s), 0) AS b
    FROM (
        SELECT device_uuid, gpu_util, ts_ms, ts_ms / {hour} AS h,
               ts_ms + {least}(COALESCE(gap_ms, %(hold)s), %(hold)s) AS e
        FROM billing_sample
        WHERE ts_ms >= %(start)s - %(hold)s AND ts_ms < %(end)s AND gpu_util IS NOT NULL
    ) AS spans
) AS parts
GROUP BY device_uuid, h
"""
# Per piece of an allocation that starts or ends inside an hour (or shares its device's hour
# with another): the time its device's samples cover within `[a0, a1)`, and that time
# weighted by utilisation.
_PIECE_COVERAGE_SQL = """
WITH pieces(piece, uuid, a0, a1) AS ({pieces})
SELECT piece, SUM(covered), SUM(covered * gpu_util)
FROM (
    SELECT pieces.piece, s.gpu_util,
           {least}(s.ts_ms + {least}(COALESCE(s.gap_ms, %(hold)s), %(hold)s), pieces.a1)
           - {greatest}(s.ts_ms, pieces.a0) AS covered
    FROM pieces JOIN billing_sample AS s
      ON s.device_uuid = pieces.uuid AND s.ts_ms >= pieces.a0 - %(hold)s AND s.ts_ms < pieces.a1
    WHERE s.gpu_util IS NOT NULL
) AS covering
WHERE covered > 0
GROUP BY piece
"""


def _sql(template: str, **parts: str) -> str:
    vendor = connection.vendor
    return template.format(greatest=_GREATEST[vendor], least=_LEAST[vendor], hour=HOUR_MS, **parts)


def rollup_hour(*, hour: datetime, now: datetime | None = None) -> int:
    """Recompute the usage rows of `[hour, hour + 1h)`; returns how many rows it wrote.

    As `rollup_hours` for one hour.
    """
    return rollup_hours(hours=[hour], now=now)


def rollup_hours(*, hours: Iterable[datetime], now: datetime | None = None) -> int:
    """Recompute the usage rows of `hours`; returns how many rows it wrote.

    Idempotent: each run of consecutive hours (at most `TALLY_ROLLUP_DEVICE_HOURS` device-hours
    at a time) has its rows replaced in one transaction, under a lock per hour, so two workers
    rolling up the same hours one after the other give the same rows. An hour still in
    progress is rolled up to `now`. The samples of a run of hours are read in one pass.
    """
    now = now or timezone.now()
    starts = sorted({hour_start(hour) for hour in hours})
    if not starts:
        return 0
    held = Allocation.objects.filter(
        Q(end__isnull=True) | Q(end__gt=starts[0]), start__lt=starts[-1] + HOUR
    ).exclude(device=None)
    per_chunk = max(1, settings.TALLY_ROLLUP_DEVICE_HOURS // max(1, held.count()))
    written = 0
    for first, count in _runs(starts, per_chunk):
        with metrics.ROLLUP_DURATION.time():
            written += _rollup_run(first, count, now)
    return written


def _runs(starts: list[datetime], most: int) -> Iterator[tuple[datetime, int]]:
    """Sorted hour starts as runs of consecutive hours, each at most `most` long."""
    first, count = starts[0], 1
    for start in starts[1:]:
        if start == first + count * HOUR and count < most:
            count += 1
            continue
        yield first, count
        first, count = start, 1
    yield first, count


def _rollup_run(first: datetime, count: int, now: datetime) -> int:
    window_start = epoch_ms(first)
    window_end = min(epoch_ms(first + count * HOUR), epoch_ms(now))
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                # The hours' locks in order, so two runs over overlapping hours never wait on
                # each other in a cycle. An hour's samples aggregate in memory rather than on
                # disk; JIT compilation would cost more than it saves on statements this size.
                cursor.execute(
                    "SELECT count(pg_advisory_xact_lock(%s, hour)) FROM generate_series(%s, %s) "
                    "AS hour; SELECT set_config('work_mem', '64MB', true), "
                    "set_config('jit', 'off', true)",
                    [7_411, window_start // HOUR_MS, window_start // HOUR_MS + count - 1],
                )
        if window_end <= window_start:
            intervals: list[_Interval] = []
        else:
            intervals = _intervals(first, count, window_start, window_end)
        rows = _usage_rows(first, intervals, window_start, window_end)
        UsageHour.objects.filter(hour__gte=first, hour__lt=first + count * HOUR).delete()
        insert_rows(UsageHour, _USAGE_COLUMNS, rows, types=_USAGE_TYPES)
    return len(rows)


_INTERVAL_FIELDS = (
    "pk",
    "cluster_id",
    "claim__namespace",
    "claim__name",
    "claim__job",
    "device__uuid",
    "device__product_name",
    "device__profile",
    "device__kind",
    "device__gpu_share",
    "device__memory_bytes",
    "consumed_memory",
    "start",
    "end",
)


def _intervals(first: datetime, count: int, window_start: int, window_end: int) -> list[_Interval]:
    rows = (
        Allocation.objects.filter(
            Q(end__isnull=True) | Q(end__gt=first),
            start__lt=first + count * HOUR,
            device__isnull=False,
        )
        .exclude(device__uuid="")
        # The one key read, rather than every allocation's JSON parsed in Python.
        .annotate(consumed_memory=KeyTextTransform("memory", "consumed_capacity"))
        .order_by("pk")
        .values_list(*_INTERVAL_FIELDS)
    )
    intervals = []
    for (
        pk, cluster_id, namespace, name, job, uuid, product, profile, kind, gpu_share,
        memory_bytes, consumed_memory, start_at, end_at,
    ) in rows:  # fmt: skip
        start = max(epoch_ms(start_at), window_start)
        end = min(epoch_ms(end_at), window_end) if end_at else window_end
        if end <= start:
            continue
        share = gpu_share if kind != "other" else Decimal(0)
        # A consumable share of a device (KEP-5075) holds the fraction it consumed.
        if consumed_memory and memory_bytes:
            fraction = Decimal(parse_quantity(consumed_memory)) / memory_bytes
            share *= min(fraction, Decimal(1))
        intervals.append(
            _Interval(
                pk, cluster_id, namespace, name, job, uuid, product, profile, start, end, share
            )
        )
    return intervals


class _Piece(NamedTuple):
    """An allocation's part of one hour of the window."""

    interval: _Interval
    hour: int  # hours since the epoch
    start_ms: int
    end_ms: int


def _pieces(intervals: list[_Interval]) -> Iterator[_Piece]:
    for interval in intervals:
        hour = interval.start_ms // HOUR_MS
        while hour * HOUR_MS < interval.end_ms:
            start = max(interval.start_ms, hour * HOUR_MS)
            end = min(interval.end_ms, (hour + 1) * HOUR_MS)
            yield _Piece(interval, hour, start, end)
            hour += 1


def _device_hours(window_start: int, window_end: int) -> dict[tuple[str, int], list[float]]:
    """Per device and hour (since the epoch) of the window: milliseconds its samples cover
    and those milliseconds times utilisation (percent)."""
    hold_ms = settings.TALLY_SAMPLE_HOLD_SECONDS * 1000
    coverage: dict[tuple[str, int], list[float]] = {}
    with connection.cursor() as cursor:
        cursor.execute(
            _sql(_DEVICE_HOURS_SQL),
            {"start": window_start, "end": window_end, "hold": hold_ms},
        )
        spills = []
        for uuid, hour, inside, weighted, spill, spill_weighted in cursor.fetchall():
            if inside:
                coverage[uuid, hour] = [inside, weighted]
            if spill:
                spills.append(((uuid, hour + 1), spill, spill_weighted))
    for key, spill, spill_weighted in spills:
        entry = coverage.setdefault(key, [0, 0.0])
        entry[0] += spill
        entry[1] += spill_weighted
    return coverage


def _piece_coverage(pieces: list[_Piece]) -> dict[int, tuple[int, float]]:
    """Per piece (by position in `pieces`): as `_device_hours`, within the piece."""
    if not pieces:
        return {}
    hold_ms = settings.TALLY_SAMPLE_HOLD_SECONDS * 1000
    with connection.cursor() as cursor:
        cursor.execute(
            _sql(
                _PIECE_COVERAGE_SQL,
                pieces=json_rows("bigint", "text", "bigint", "bigint", placeholder="%(pieces)s"),
            ),
            {
                "pieces": json.dumps(
                    [
                        [index, piece.interval.device_uuid, piece.start_ms, piece.end_ms]
                        for index, piece in enumerate(pieces)
                    ]
                ),
                "hold": hold_ms,
            },
        )
        return {index: (int(covered), float(weighted)) for index, covered, weighted in cursor}


_USAGE_COLUMNS = (
    "hour",
    "allocation_id",
    "cluster_id",
    "device_uuid",
    "product_name",
    "profile",
    "gpu_share",
    "namespace",
    "claim_name",
    "team_id",
    "job",
    "username",
    "allocated_gpu_ms",
    "utilised_gpu_ms",
    "unmeasured_gpu_ms",
)


# Binary COPY types of `_USAGE_COLUMNS`.
_USAGE_TYPES = (
    "timestamptz", "int8", "int8", "text", "text", "text", "numeric", "text", "text", "int8",
    "text", "text", "int8", "int8", "int8",
)  # fmt: skip
_ONE = Decimal(1)


def _usage_rows(
    first: datetime, intervals: list[_Interval], window_start: int, window_end: int
) -> list[tuple[Any, ...]]:
    """A usage row per allocation and hour of the window.

    Pieces that take all of their hour's part of the window (nearly all) take their device's
    coverage of that hour; the others are measured one by one.
    """
    pieces = list(_pieces(intervals))
    whole: list[_Piece] = []
    partial: list[_Piece] = []
    for piece in pieces:
        hour_start_ms = piece.hour * HOUR_MS
        if piece.start_ms == max(hour_start_ms, window_start) and piece.end_ms == min(
            hour_start_ms + HOUR_MS, window_end
        ):
            whole.append(piece)
        else:
            partial.append(piece)
    device_hours = _device_hours(window_start, window_end) if whole else {}
    piece_coverage = _piece_coverage(partial)
    namespaces = {interval.claim_namespace for interval in intervals}
    teams = dict(
        TeamNamespace.objects.filter(namespace__in=namespaces).values_list("namespace", "team_id")
    )
    attribution = {
        (namespace, name): (username, owner_kind, owner_name)
        for namespace, name, username, owner_kind, owner_name in Reservation.objects.filter(
            namespace__in=namespaces
        )
        .exclude(state=ReservationState.RELEASED)
        .values_list("namespace", "name", "username", "owner_kind", "owner_name")
    }
    # What each interval's rows share, made once per interval rather than per hour.
    fixed: dict[int, tuple[Any, ...]] = {}
    for interval in intervals:
        username, owner_kind, owner_name = attribution.get(
            (interval.claim_namespace, interval.claim_name), ("", "", "")
        )
        job = interval.job
        if not job and owner_kind:
            job = f"{owner_kind}/{owner_name}"
        fixed[interval.allocation_id] = (
            interval.allocation_id,
            interval.cluster_id,
            interval.device_uuid,
            interval.product_name,
            interval.profile,
            interval.share,
            interval.claim_namespace,
            interval.claim_name,
            teams.get(interval.claim_namespace),
            job,
            username,
        )
    hours = {hour: EPOCH + timedelta(hours=hour) for hour in {piece.hour for piece in pieces}}
    nothing = (0, 0.0)
    rows = []
    for piece in whole:
        interval = piece.interval
        covered_ms, weighted = device_hours.get((interval.device_uuid, piece.hour), nothing)
        rows.append(
            (
                hours[piece.hour],
                *fixed[interval.allocation_id],
                *_usage(piece.end_ms - piece.start_ms, int(covered_ms), weighted, interval.share),
            )
        )
    for index, piece in enumerate(partial):
        covered_ms, weighted = piece_coverage.get(index, nothing)
        rows.append(
            (
                hours[piece.hour],
                *fixed[piece.interval.allocation_id],
                *_usage(piece.end_ms - piece.start_ms, covered_ms, weighted, piece.interval.share),
            )
        )
    return rows


def _usage(length: int, covered_ms: int, weighted: float, share: Decimal) -> tuple[int, int, int]:
    """Allocated, utilised and unmeasured GPU-milliseconds of `length` milliseconds held, of
    which samples covered `covered_ms`; `weighted` is covered milliseconds times percent
    utilisation."""
    utilised = Decimal(weighted) / 100
    if share == _ONE:  # a whole GPU, the usual case: integers need no Decimal
        return length, _gpu_ms(utilised, share), length - covered_ms
    return (
        _gpu_ms(length, share),
        _gpu_ms(utilised, share),
        _gpu_ms(length - covered_ms, share),
    )


def _gpu_ms(milliseconds: int | Decimal, share: Decimal) -> int:
    return int((Decimal(milliseconds) * share).to_integral_value(ROUND_HALF_EVEN))


def mark_dirty(*, hours: set[datetime], at: datetime) -> None:
    """Mark hours to roll up again (late samples, allocations seen late)."""
    hours = {hour_start(hour) for hour in hours}
    if not hours:
        return
    DirtyHour.objects.filter(hour__in=hours).update(marked_at=at)
    DirtyHour.objects.bulk_create(
        [DirtyHour(hour=hour, marked_at=at) for hour in hours], ignore_conflicts=True
    )


def mark_claims_dirty(*, claim_ids: list[int], at: datetime) -> None:
    """Mark every hour the claims' allocations span, so usage follows what the sync saw."""
    # Merge the intervals first: a large import holds thousands of allocations over the same
    # weeks, and each hour is to be marked once.
    intervals = sorted(
        (start, min(end or at, at) + timedelta(milliseconds=1))
        for start, end in Allocation.objects.filter(claim_id__in=claim_ids).values_list(
            "start", "end"
        )
    )
    hours: set[datetime] = set()
    merged_start: datetime | None = None
    merged_end: datetime | None = None
    for start, end in intervals:
        if merged_end is not None and start <= merged_end:
            merged_end = max(merged_end, end)
            continue
        if merged_start is not None and merged_end is not None:
            hours |= hours_between(merged_start, merged_end)
        merged_start, merged_end = start, end
    if merged_start is not None and merged_end is not None:
        hours |= hours_between(merged_start, merged_end)
    mark_dirty(hours=hours, at=at)


def hours_between(start: datetime, end: datetime) -> set[datetime]:
    hours, hour = set(), hour_start(start)
    while hour < end:
        hours.add(hour)
        hour += HOUR
    return hours


def rollup_pending(*, now: datetime, limit: int | None = None) -> list[datetime]:
    """Roll up the hour just ended and the hours marked dirty, newest first, at most `limit`
    of them (default TALLY_ROLLUP_HOURS_PER_RUN); returns the hours done.

    A first sync of a cluster whose claims began months ago marks thousands of hours: they
    are worked off over the next runs, recent hours first, each run bounded. What is left
    stays marked.
    """
    limit = settings.TALLY_ROLLUP_HOURS_PER_RUN if limit is None else limit
    started = timezone.now()
    just_ended = hour_start(now) - HOUR
    marked = DirtyHour.objects.filter(hour__lt=now).exclude(hour=just_ended).order_by("-hour")
    due = [just_ended, *marked.values_list("hour", flat=True)[: max(limit - 1, 0)]]
    rollup_hours(hours=due, now=now)
    # A mark made while this ran stays, so the newer data is not missed.
    DirtyHour.objects.filter(hour__in=due, marked_at__lte=started).delete()
    return due
