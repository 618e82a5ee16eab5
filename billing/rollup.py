"""Hourly usage: allocation intervals split into utilised, idle and unmeasured GPU time.

Allocated time comes from the allocation history, exactly. Samples only split it: each
sample's utilisation holds from its timestamp until the device's next sample, for at most
`TALLY_SAMPLE_HOLD_SECONDS`; allocated time that no sample covers is unmeasured. Rolling up
an hour replaces that hour's rows, so reruns and duplicate deliveries give the same rows.
"""

from __future__ import annotations

import json
import logging
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
from inventory.bulk import insert_rows
from inventory.models import Allocation
from quota.models import Reservation, ReservationState, TeamNamespace

log = logging.getLogger(__name__)
HOUR = timedelta(hours=1)
HOUR_MS = 3_600_000


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


# The rows of one JSON parameter, an array of arrays: a single parameter rather than several per
# allocation, which the driver would splice into the statement one by one (for a thousand
# allocations that took longer than the query).
_JSON_ROWS = {
    "postgresql": "SELECT {columns} FROM json_array_elements(%s::json) AS item(value)",
    "sqlite": "SELECT {columns} FROM json_each(%s)",
}
_JSON_ITEM = {
    "postgresql": "CAST(value ->> {index} AS {type})",
    "sqlite": "CAST(json_extract(value, '$[{index}]') AS {type})",
}
# The devices' samples are read in (device_uuid, ts_ms) order, which the window needs: on
# PostgreSQL `= ANY(array)` lets it come from an index-only scan of the unique index, with no
# sort (`IN (subquery)` would join, then sort).
_IN_DEVICES = {
    "postgresql": "= ANY(ARRAY(SELECT uuid FROM {devices}))",
    "sqlite": "IN (SELECT uuid FROM {devices})",
}
# Each sample's span: from its timestamp until the device's next sample, for at most the hold.
# Written with CASE rather than GREATEST/LEAST or MAX/MIN, so that the same statements run on
# PostgreSQL and SQLite. Samples from a hold before the window count into it.
_SPANS_SQL = """
s AS (
    SELECT device_uuid, ts_ms, gpu_util,
           LEAD(ts_ms) OVER (PARTITION BY device_uuid ORDER BY ts_ms) AS next_ms
    FROM billing_sample
    WHERE device_uuid {in_devices} AND ts_ms >= %s AND ts_ms < %s
),
spans AS (
    SELECT device_uuid, gpu_util, ts_ms AS s0,
           CASE WHEN next_ms IS NOT NULL AND next_ms < ts_ms + %s THEN next_ms
                ELSE ts_ms + %s END AS s1
    FROM s
    WHERE gpu_util IS NOT NULL
)"""
# Per device: the time its samples cover within the whole window, and that time weighted by
# utilisation (percent). The allocations that hold a device for the whole window, nearly all
# of them, take these: the samples are aggregated in the order they are read, not joined.
_DEVICE_COVERAGE_SQL = """
WITH d(uuid) AS ({devices}),
{spans}
SELECT device_uuid, SUM(c1 - c0), SUM((c1 - c0) * gpu_util)
FROM (
    SELECT device_uuid, gpu_util,
           CASE WHEN s0 > %s THEN s0 ELSE %s END AS c0,
           CASE WHEN s1 < %s THEN s1 ELSE %s END AS c1
    FROM spans
    WHERE s1 > %s
) AS clipped
GROUP BY device_uuid
"""
# Per allocation: the same within the allocation's part of the window, for allocations that
# start or end inside it.
_ALLOCATION_COVERAGE_SQL = """
WITH a(allocation_id, uuid, a0, a1) AS ({allocations}),
{spans},
overlap AS (
    SELECT a.allocation_id, spans.gpu_util,
           (CASE WHEN spans.s1 < a.a1 THEN spans.s1 ELSE a.a1 END)
           - (CASE WHEN spans.s0 > a.a0 THEN spans.s0 ELSE a.a0 END) AS covered_ms
    FROM a JOIN spans ON spans.device_uuid = a.uuid AND spans.s1 > a.a0 AND spans.s0 < a.a1
)
SELECT allocation_id, SUM(covered_ms), SUM(covered_ms * gpu_util)
FROM overlap GROUP BY allocation_id
"""


def _json_rows(*types: str) -> str:
    """A SELECT of the rows of one JSON parameter (arrays of `types`), for this database."""
    item = _JSON_ITEM[connection.vendor]
    columns = ", ".join(item.format(index=index, type=type_) for index, type_ in enumerate(types))
    return _JSON_ROWS[connection.vendor].format(columns=columns)


def _spans_sql(devices: str) -> str:
    return _SPANS_SQL.format(in_devices=_IN_DEVICES[connection.vendor].format(devices=devices))


def rollup_hour(*, hour: datetime, now: datetime | None = None) -> int:
    """Recompute the usage rows of `[hour, hour + 1h)`; returns how many rows it wrote.

    Idempotent: the hour's rows are replaced in one transaction, under a lock per hour so two
    workers rolling up the same hour one after the other give the same rows. An hour still
    in progress is rolled up to `now`.
    """
    with metrics.ROLLUP_DURATION.time():
        return _rollup_hour(hour_start(hour), now or timezone.now())


def _rollup_hour(hour: datetime, now: datetime) -> int:
    window_start, window_end = epoch_ms(hour), min(epoch_ms(hour + HOUR), epoch_ms(now))
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                # An hour of a large fleet's samples sorts (if it must) in memory rather than on
                # disk; JIT compilation would cost more than it saves on statements this size.
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s), set_config('work_mem', '64MB', true), "
                    "set_config('jit', 'off', true)",
                    [7_411, window_start // HOUR_MS],
                )
        intervals = _intervals(hour, window_start, window_end)
        coverage = _coverage(intervals, window_start, window_end)
        rows = _usage_rows(hour, intervals, coverage)
        UsageHour.objects.filter(hour=hour).delete()
        insert_rows(UsageHour, _USAGE_COLUMNS, rows)
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


def _intervals(hour: datetime, window_start: int, window_end: int) -> list[_Interval]:
    rows = (
        Allocation.objects.filter(
            Q(end__isnull=True) | Q(end__gt=hour), start__lt=hour + HOUR, device__isnull=False
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


def _coverage(
    intervals: list[_Interval], window_start: int, window_end: int
) -> dict[int, tuple[int, float]]:
    """Per allocation: milliseconds its device's samples cover within its part of the window,
    and those milliseconds times utilisation (percent). Allocations none of whose part any
    sample covers are left out."""
    hold_ms = settings.TALLY_SAMPLE_HOLD_SECONDS * 1000
    spans_params: list[int | str] = [window_start - hold_ms, window_end, hold_ms, hold_ms]
    whole = [i for i in intervals if (i.start_ms, i.end_ms) == (window_start, window_end)]
    partial = [i for i in intervals if (i.start_ms, i.end_ms) != (window_start, window_end)]
    coverage: dict[int, tuple[int, float]] = {}
    with connection.cursor() as cursor:
        if whole:
            devices = sorted({interval.device_uuid for interval in whole})
            cursor.execute(
                _DEVICE_COVERAGE_SQL.format(devices=_json_rows("text"), spans=_spans_sql("d")),
                [
                    json.dumps([[uuid] for uuid in devices]),
                    *spans_params,
                    *(window_start, window_start, window_end, window_end, window_start),
                ],
            )
            per_device = {uuid: (int(ms), float(weighted)) for uuid, ms, weighted in cursor}
            for interval in whole:
                if interval.device_uuid in per_device:
                    coverage[interval.allocation_id] = per_device[interval.device_uuid]
        if partial:
            allocations = [[i.allocation_id, i.device_uuid, i.start_ms, i.end_ms] for i in partial]
            cursor.execute(
                _ALLOCATION_COVERAGE_SQL.format(
                    allocations=_json_rows("bigint", "text", "bigint", "bigint"),
                    spans=_spans_sql("a"),
                ),
                [json.dumps(allocations), *spans_params],
            )
            coverage.update((row[0], (int(row[1]), float(row[2]))) for row in cursor)
    return coverage


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


def _usage_rows(
    hour: datetime, intervals: list[_Interval], coverage: dict[int, tuple[int, float]]
) -> list[tuple[Any, ...]]:
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
    rows = []
    for interval in intervals:
        covered_ms, weighted = coverage.get(interval.allocation_id, (0, 0.0))
        length = interval.end_ms - interval.start_ms
        username, owner_kind, owner_name = attribution.get(
            (interval.claim_namespace, interval.claim_name), ("", "", "")
        )
        job = interval.job
        if not job and owner_kind:
            job = f"{owner_kind}/{owner_name}"
        rows.append(
            (
                hour,
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
                _gpu_ms(length, interval.share),
                # `weighted` is covered milliseconds times percent utilisation.
                _gpu_ms(Decimal(weighted) / 100, interval.share),
                _gpu_ms(length - covered_ms, interval.share),
            )
        )
    return rows


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
    done = []
    for hour in due:
        rollup_hour(hour=hour, now=now)
        # A mark made while this ran stays, so the newer data is not missed.
        DirtyHour.objects.filter(hour=hour, marked_at__lte=started).delete()
        done.append(hour)
    return done
