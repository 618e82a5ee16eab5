"""Hourly usage: allocation intervals split into utilised, idle and unmeasured GPU time.

Every allocation of an accelerator is billed, whatever its vendor: devices are metered by
their meter id (`Device.meter_id`: the published UUID where the driver's profile trusts it,
else an identity formed from cluster, driver, pool and device), which is what samples name
them by (`billing_sample.device_uuid`). An allocation whose device no sample names is billed
its allocated hours, all unmeasured. Its figures count its device's unit (GPUs, TPU chips,
Gaudi cards), kept on each row.

What an allocation is metered and counted by (meter id, unit, share, model and profile) is
read from the allocation, which fixed it from its device when it started, never from the
device now: a driver profile edited since changes no hour it has held. A device that gained a
UUID since (NVIDIA dynamic MIG, a driver upgrade) is metered by it from then on, so its
samples are found under the allocation's meter id or the device's current one; each sample is
stored under one of them, so none counts twice. Such an allocation's hours are measured
piece by piece, as an allocation's first and last hours are.

Allocated time comes from the allocation history, exactly. Samples only split it: each
sample's utilisation holds from its timestamp until the device's next sample, for at most
`TALLY_SAMPLE_HOLD_SECONDS`, and a mean's (an agent's minute mean) for at most the time its
readings covered (`Sample.covered_ms`); allocated time that no sample covers is unmeasured.
Rolling up hours replaces their rows, so reruns and duplicate deliveries give the same rows.
The job and person charged are read from the allocation too (fixed when it started), and the
team per hour from the namespace's dated ownership (`teams.ownership`): each allocation's
interval is cut where its namespace changed owner (always at an hour's start), and each part
charged to the team that owned it then, or to no team (unowned usage). A namespace moved to
another team or a claim released since never changes a rerun's rows.

The work is in the database. Each sample carries its gap to the device's next one (kept by
`metering.ingest`), so a run of consecutive hours is rolled up from one unordered pass over its
samples, summed per device and hour, then joined to the allocations that hold those hours
whole and written by one INSERT ... SELECT. Only the hours an allocation starts or ends in
are measured piece by piece, and their rows made here. The sums of every hour that has ended
are not even scanned for: they are kept per device and hour as samples are written
(`metering.hoursums`), and read from there while they are made under the hold in force; the
hour still in progress is summed from its samples.

Clusters that TALLY_METERING_SOURCE meters from a Prometheus-compatible engine are read from
it: `metering.prometheus` sums the engine's readings per device and hour as it parses them
(`metering.reading_sums`, the arithmetic of `_PER_HOUR_SQL` and `_PIECE_COVERAGE_SQL` below)
and loads only the sums, which the same SQL reads instead of the kept sums, so the hold and
rounding rules are the same.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any, NamedTuple

from django.conf import settings
from django.db import DataError, IntegrityError, connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from core import metrics
from db import locks
from db.copy import insert_rows, json_rows
from inventory.attribution import charge_by_team
from inventory.models import Allocation
from metering import prometheus, silence
from metering.blocks import readings_between
from metering.dirty import mark_dirty
from metering.hours import (
    HOUR,
    MS_PER_HOUR,
    UTIL_SCALE,
    epoch_ms,
    hour_at,
    hour_start,
    hours_between,
    sample_hold_ms,
)
from metering.hoursums import sums_usable
from metering.models import DirtyHour, HourSum, RollupProgress, UsageHour

MICRO = 1_000_000  # shares of a GPU are kept to the millionth
# A GPU-millisecond in the weighted sums times a share's millionths: percent, scale and share.
_UTILISED_UNIT = 100 * UTIL_SCALE * MICRO
# Readings come from `billing_sample` and its compacted days (`metering.blocks
# .readings_between`), unless a source gives its own.
log = logging.getLogger(__name__)


class _Interval(NamedTuple):
    """One allocation's part of the hour, with what its usage row needs (no model instances:
    an hour of a large fleet is thousands of these)."""

    allocation_id: int
    cluster_id: int
    claim_namespace: str
    claim_name: str
    # The team that owned the namespace over this part of the allocation (None: no team), and
    # the job and person the allocation has kept since it started.
    team_id: int | None
    job: str
    username: str
    device_uuid: str  # the meter id the allocation keeps, which samples name its device by
    # The device's meter id now where it has changed since (it gained a UUID), else "".
    renamed_uuid: str
    product_name: str
    profile: str
    unit: str  # what `share` counts: GPUs, TPU chips, Gaudi cards
    start_ms: int
    end_ms: int
    share: Decimal  # of one unit (a GPU, a TPU chip), to the millionth

    @property
    def share_micro(self) -> int:
        return int(self.share * MICRO)


# Per device and hour of the window: the time its samples cover, and that time weighted by
# utilisation (percent). Each sample's utilisation holds from its timestamp for its gap to
# the device's next sample, at most the hold and a mean's covered time: `e` is where that
# ends. A span (at most an hour long) lies in the sample's own hour `h` and, past the hour's
# end, in the next: `a` is the part in hour h (cut at the window's end), the FILTERed sums
# the part that spills into h + 1. Samples from a hold before the window count only by their
# spill (their own hour is outside it). One pass over the window's samples in any order,
# grouped as they come: no sort, no join, parallel workers; as few operations a row as will do.
# The weighted sums are of integers (`UTIL_SCALE`), exact in any order: a double's sum
# depends on the order it adds the rows in, and a total on a half (1250.5 GPU-ms) rounded to
# 1250 or to 1251 by the order samples arrived in. numeric sums are exact too, but slower.
_PER_HOUR_SQL = """
SELECT device_uuid, h, CAST(SUM(a) AS bigint) AS covered,
       SUM(a * CAST(round(gpu_util * {util_scale}) AS bigint)) AS weighted,
       CAST(SUM(LEAST(e, %(end)s) - next_h) FILTER (WHERE e > next_h) AS bigint) AS spill,
       SUM((LEAST(e, %(end)s) - next_h) * CAST(round(gpu_util * {util_scale}) AS bigint))
       FILTER (WHERE e > next_h) AS spill_weighted
FROM (
    SELECT device_uuid, gpu_util, h, e, next_h, LEAST(e, next_h, %(end)s) - ts_ms AS a
    FROM (
        SELECT device_uuid, gpu_util, ts_ms, ts_ms / {hour} AS h,
               (ts_ms / {hour} + 1) * {hour} AS next_h,
               {span_end} AS e
        FROM {samples}
        WHERE ts_ms >= %(start)s - %(hold)s AND ts_ms < %(end)s AND gpu_util IS NOT NULL
    ) AS spans
) AS parts
GROUP BY device_uuid, h
"""
# The usage rows of allocations over the hours they hold whole (their part of the window's
# hour, all of it): nearly every row. `iv` is the allocations, each with its first and last
# such hour, and `held` one row per allocation and hour; each takes its device's hour from
# `per_hour` and the part of the hour before's spans that spills into it. GPU-milliseconds are
# rounded half up, exactly, in integers: held and unmeasured time (shares are millionths), and
# utilised time (sums of milliseconds times `UTIL_SCALE`ths of a percent) by div(), whose
# integer quotient is exact where a numeric division rounds to a scale of its own. `iv` is
# MATERIALIZED: its JSON is parsed once, before the join (as jsonb: a json value's `->>` parses
# the row's text again for each column, 15 times).
# Rows go in in (hour, allocation) order, the unique index's.
_WHOLE_HOURS_SQL = """
WITH
iv(allocation_id, cluster_id, device_uuid, product_name, profile, unit, gpu_share, namespace,
   claim_name, team_id, job, username, share_micro, h0, h1) AS MATERIALIZED ({intervals}),
per_hour AS (SELECT * FROM {per_hour_table}),
spills AS (
    SELECT device_uuid, h + 1 AS h, spill, spill_weighted FROM per_hour WHERE spill IS NOT NULL
),
usage AS (
    SELECT held.h, iv.*,
           COALESCE(own.covered, 0) + COALESCE(spills.spill, 0) AS covered,
           COALESCE(own.weighted, 0) + COALESCE(spills.spill_weighted, 0) AS weighted,
           LEAST((held.h + 1) * {hour}, %(end)s) - GREATEST(held.h * {hour}, %(start)s)
           AS length
    FROM iv CROSS JOIN LATERAL generate_series(iv.h0, iv.h1) AS held(h)
    LEFT JOIN per_hour AS own ON own.device_uuid = iv.device_uuid AND own.h = held.h
    LEFT JOIN spills ON spills.device_uuid = iv.device_uuid AND spills.h = held.h
)
INSERT INTO billing_usagehour ({columns})
SELECT to_timestamp(h * 3600), allocation_id, cluster_id, device_uuid, product_name, profile,
       unit, gpu_share, namespace, claim_name, team_id, job, username,
       (length * share_micro + 500000) / 1000000,
       CAST(div(weighted * share_micro + {utilised_half}, {utilised_unit}) AS bigint),
       ((length - covered) * share_micro + 500000) / 1000000
FROM usage
ORDER BY h, allocation_id
"""
# Per piece of an allocation that starts or ends inside an hour (or inside the window): the
# time its device's samples cover within `[a0, a1)`, and that time weighted by utilisation. A
# piece of a renamed device comes once per name, summed: each sample is stored under one.
_PIECE_COVERAGE_SQL = """
WITH pieces(piece, uuid, a0, a1) AS ({pieces})
SELECT piece, SUM(covered), SUM(covered * CAST(round(gpu_util * {util_scale}) AS bigint))
FROM (
    SELECT pieces.piece, s.gpu_util,
           LEAST({span_end}, pieces.a1)
           - GREATEST(s.ts_ms, pieces.a0) AS covered
    FROM pieces JOIN {samples} AS s
      ON s.device_uuid = pieces.uuid AND s.ts_ms >= pieces.a0 - %(hold)s AND s.ts_ms < pieces.a1
    WHERE s.gpu_util IS NOT NULL
) AS covering
WHERE covered > 0
GROUP BY piece
"""
# `_PER_HOUR_SQL`'s rows from the per device-hour sums kept as samples are written
# (`metering.hoursums`), for a window whose hours have all ended by its end: its hours' own
# rows and the hour before's (for its spill). An hour that has ended is summed there exactly
# as `_PER_HOUR_SQL` sums it (no span of its samples, nor of the hour before's, reaches the
# window's end), but for spill nulls where it has none, which the joins read as 0. The
# weighted sums as numeric, as `_PER_HOUR_SQL`'s SUM makes them (times a share, past bigint).
_SUMS_PER_HOUR_SQL = """
SELECT device_uuid, h, covered, CAST(weighted AS numeric) AS weighted, spill,
       CAST(spill_weighted AS numeric) AS spill_weighted
FROM {sums} WHERE h >= %(first_hour)s - 1 AND h < %(end_hour)s
"""
# The same for a window whose last hour is still in progress at its end (`%(end_hour)s`, whose
# start is `%(tail)s`): that hour, and what the hour before spills into it up to the window's
# end, from its samples (`_PER_HOUR_SQL` from `%(tail)s`); the hours before from the sums.
_SUMS_AND_TAIL_SQL = """
WITH tail AS MATERIALIZED ({tail})
SELECT s.device_uuid, s.h, s.covered, CAST(s.weighted AS numeric) AS weighted,
       CASE WHEN s.h = %(end_hour)s - 1 THEN t.spill ELSE s.spill END AS spill,
       CASE WHEN s.h = %(end_hour)s - 1 THEN t.spill_weighted
            ELSE CAST(s.spill_weighted AS numeric) END AS spill_weighted
FROM {sums} AS s
LEFT JOIN tail AS t ON t.device_uuid = s.device_uuid AND t.h = s.h AND s.h = %(end_hour)s - 1
WHERE s.h >= %(first_hour)s - 1 AND s.h < %(end_hour)s
UNION ALL
SELECT * FROM tail WHERE h = %(end_hour)s
"""
# The columns of `iv` above, as `json_rows` types.
_INTERVAL_TYPES = (
    "bigint", "bigint", "text", "text", "text", "text", "numeric", "text", "text", "bigint",
    "text", "text", "bigint", "bigint", "bigint",
)  # fmt: skip
# The per-hour sums are made first into a temporary table: a statement that writes (the
# INSERT) never gets parallel workers, a CREATE TABLE ... AS may.
_PER_HOUR_TABLE = "tally_rollup_per_hour"


# Where a sample's utilisation stops holding: its gap to the device's next sample, at most
# the hold, and for a mean at most the time its readings covered (`covered_ms`). LEAST skips
# nulls: a gap not yet known, or a single reading's covered time, leaves the others. `{s}` is
# the sample table's name with a dot, or nothing.
_SPAN_END = "{s}ts_ms + LEAST({s}gap_ms, {s}covered_ms, %(hold)s)"


def _sql(template: str, *, samples: str, sample: str = "", **parts: str) -> str:
    """`template` with the hour's length, `{span_end}` and the table readings come from
    (`samples`: `billing_sample`, or a source's readings shaped like it) filled in; `sample`
    names that table in `{span_end}`."""
    return template.format(
        hour=MS_PER_HOUR,
        util_scale=UTIL_SCALE,
        utilised_unit=_UTILISED_UNIT,
        utilised_half=_UTILISED_UNIT // 2,
        span_end=_SPAN_END.format(s=f"{sample}." if sample else ""),
        samples=samples,
        **parts,
    )


def rollup_hours(*, hours: Iterable[datetime], now: datetime | None = None) -> int:
    """Recompute the usage rows of `hours`; returns how many rows it wrote.

    Idempotent: each run of consecutive hours (at most `TALLY_ROLLUP_DEVICE_HOURS`
    allocation-hours at a time) has its rows replaced in one transaction, under a lock per
    hour, so two workers rolling up the same hours one after the other give the same rows.
    An hour still in progress is rolled up to `now`, and marked to be rolled up again. A run's
    samples are read in one pass.
    Clusters metered by a Prometheus-compatible engine (`metering.prometheus`) are read from
    it instead, through the same SQL. Where an engine cannot answer for a run, its clusters'
    rows of those hours are left as they were (the other clusters' are written), the hours are
    marked to be rolled up again, and `EngineUnavailable` names them, after the other runs are
    done. The engines are asked for at most TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS in all
    (`prometheus.RunBudget`): the runs after that are left so, for the next call to go on.
    A silent engine (`metering.silence`) is reported as each run finds it.
    """
    now = now or timezone.now()
    starts = sorted({hour_start(hour) for hour in hours})
    if not starts:
        return 0
    held = held_allocations(starts[0], starts[-1] + HOUR).count()
    per_run = max(1, settings.TALLY_ROLLUP_DEVICE_HOURS // max(1, held))
    # A run's readings from a metering engine are held in memory: as many hours as one query.
    per_run = min(per_run, prometheus.run_hours_limit() or per_run)
    written = 0
    unavailable: list[prometheus.EngineUnavailable] = []
    budget = prometheus.RunBudget()
    for first, count in _runs(starts, per_run):
        try:
            with metrics.ROLLUP_DURATION.time():
                written += _rollup_run(first, count, now, budget)
        except prometheus.EngineUnavailable as error:
            error.hours = [first + index * HOUR for index in range(count)]
            unavailable.append(error)
            if budget.spent() is not None:
                metrics.METERING_DEADLINE_HOURS.inc(count)
    # An hour rolled up only to `now` is marked after its rows are written (a new version: a
    # rollup that read its mark before takes this one not): so it is rolled up again once it
    # has ended, and until then no one counts it whole (`billing.selectors.team_gpu_hours`),
    # even where these rows land after beat has rolled it up whole.
    unfinished = {hour for hour in starts if hour + HOUR > now}
    if unfinished:
        mark_dirty(hours=unfinished, at=now)
    if unavailable:
        # The other runs are done; these hours wrote nothing and stay to do: marked, so beat's
        # next rollup tries them again whoever asked for them (`run_billing`, a close).
        missed = [hour for error in unavailable for hour in error.hours]
        mark_dirty(hours=set(missed), at=now)
        raise prometheus.EngineUnavailable(
            str(unavailable[0]),
            hours=missed,
            clusters=frozenset().union(*(error.clusters for error in unavailable)),
        )
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


def _rollup_run(first: datetime, count: int, now: datetime, budget: prometheus.RunBudget) -> int:
    window_start = epoch_ms(first)
    window_end = min(epoch_ms(first + count * HOUR), epoch_ms(now))
    first_hour = window_start // MS_PER_HOUR
    # Readings from Prometheus-compatible engines, for the clusters they meter: asked before
    # the transaction. The clusters of an engine that does not answer are left out: their rows
    # stay as they were, and the run raises once the others' are written.
    readings, unanswered = None, None
    if window_end > window_start:
        try:
            readings = prometheus.window_readings(
                held=held_allocations(first, first + count * HOUR),
                start_ms=window_start,
                end_ms=window_end,
                now=now,
                budget=budget,
            )
        except prometheus.EngineUnavailable as error:
            if error.answered is None:
                raise
            readings, unanswered = error.answered, error
        if readings is not None:
            silence.report(readings.silences, now=now)
    left_out = unanswered.clusters if unanswered else frozenset()
    with transaction.atomic():
        # The hours' locks, in order, so two runs over overlapping hours never wait on each
        # other in a cycle. The sums aggregate in memory rather than on disk; JIT compilation
        # would cost more than it saves on statements this size. The commit need not wait for
        # its WAL to reach the disk: the rows can be made again, and the next durable commit
        # (marking the hours done, in `rollup_pending`) flushes this one's WAL before its own.
        # One round trip for all of it.
        lock, params = locks.xact_lock_sql(
            "billing.rollup.hour", range(first_hour, first_hour + count)
        )
        with connection.cursor() as cursor:
            cursor.execute(
                f"{lock}; SELECT set_config('work_mem', '64MB', true), "
                "set_config('jit', 'off', true), set_config('synchronous_commit', 'off', true)",
                params,
            )
        replaced = UsageHour.objects.filter(hour__gte=first, hour__lt=first + count * HOUR)
        if left_out:
            replaced = replaced.exclude(cluster__name__in=left_out)
        replaced.delete()
        if window_end <= window_start:
            return 0
        source = _source(readings, window_start, window_end)
        intervals = _intervals(first, count, window_start, window_end, left_out)
        written = _write_usage(intervals, window_start, window_end, source)
    if readings is not None:
        prometheus.mark_unsettled(start_ms=window_start, end_ms=window_end, now=now)
    if unanswered is not None:
        raise unanswered
    return written


class _Source(NamedTuple):
    """Where a run reads its readings from: `samples`, a table shaped like `billing_sample`
    (None: no device of the run is metered by samples); `sums`, whether the hours that have
    ended are read from the per device-hour sums kept of samples (`metering.hoursums`); and
    `engine`, an engine's readings summed per device and hour (`prometheus.HourSums`), or
    None."""

    samples: str | None
    sums: bool = False
    engine: prometheus.HourSums | None = None


def _source(readings: prometheus.Readings | None, window_start: int, window_end: int) -> _Source:
    """The run's `_Source`, loaded (in its transaction)."""
    if readings is None:
        # The hours that have ended are read from the per device-hour sums, where they are
        # made under the hold in force (`metering.hoursums`).
        samples = readings_between(window_start - sample_hold_ms(), window_end)
        return _Source(samples, sums=sums_usable())
    # An engine's readings are summed per device and hour as they were parsed, and only the
    # sums loaded; the samples of the clusters that send them are read as they are (no
    # sums kept of them cover an engine's run: its hours are read from the samples).
    engine = prometheus.load_hour_sums(readings, start_ms=window_start, end_ms=window_end)
    if engine is not None:
        return _Source(engine.samples, engine=engine)
    # A percent the sums cannot take: the readings loaded and summed by the SQL, as before.
    return _Source(prometheus.load_readings(readings, start_ms=window_start, end_ms=window_end))


# What the database refuses of a row, rather than failing for every row: a value that does
# not fit its column, a check it fails.
_REFUSED_ROW = (DataError, IntegrityError)


def _write_usage(
    intervals: list[_Interval], window_start: int, window_end: int, source: _Source
) -> int:
    """Write the usage rows of `intervals` (in the run's transaction); how many.

    One allocation whose rows the database refuses never keeps the others' from being
    written: the run is written again one allocation at a time, each in a savepoint, and the
    allocations refused are logged as an error by id, their hours without rows (every other
    team's usage, and so its statements, still made). Only a refusal costs the savepoints.
    """
    try:
        with transaction.atomic():
            return _write_intervals(intervals, window_start, window_end, source)
    except _REFUSED_ROW:
        pass
    written = 0
    refused: list[tuple[int, str]] = []
    for interval in intervals:
        try:
            with transaction.atomic():
                written += _write_intervals([interval], window_start, window_end, source)
        except _REFUSED_ROW as error:
            refused.append((interval.allocation_id, str(error).splitlines()[0]))
    log.error(
        "usage of %s allocation(s) from %s to %s not rolled up, the database refused its rows "
        "(the others' are written): %s",
        len(refused),
        hour_at(window_start // MS_PER_HOUR).isoformat(),
        hour_at(-(-window_end // MS_PER_HOUR)).isoformat(),
        "; ".join(f"allocation {pk}: {reason}" for pk, reason in refused),
    )
    return written


def _write_intervals(
    intervals: list[_Interval], window_start: int, window_end: int, source: _Source
) -> int:
    whole, partial = _split(intervals, window_start, window_end)
    written = _insert_whole_hours(whole, window_start, window_end, source)
    rows = _partial_rows(partial, source)
    insert_rows(UsageHour, _USAGE_COLUMNS, rows, types=_USAGE_TYPES)
    return written + len(rows)


_INTERVAL_FIELDS = (
    "pk",
    "cluster_id",
    "claim__namespace",
    "claim__name",
    "job",
    "username",
    "meter_id",
    "device__meter_id",
    "product_name",
    "profile",
    "unit",
    "gpu_share",
    "start",
    "end",
)


def held_allocations(start: datetime, end: datetime) -> QuerySet[Allocation]:
    """Allocations of an accelerator (one that kept a meter id: devices of kind `other` have
    none) held at some time in `[start, end)`."""
    return Allocation.objects.filter(
        Q(end__isnull=True) | Q(end__gt=start), start__lt=end, device__isnull=False
    ).exclude(meter_id="")


def _intervals(
    first: datetime, count: int, window_start: int, window_end: int, left_out: frozenset[str]
) -> list[_Interval]:
    """The window's allocations, but those of the clusters `left_out` (by name)."""
    held = held_allocations(first, first + count * HOUR)
    if left_out:
        held = held.exclude(cluster__name__in=left_out)
    rows = held.order_by("pk").values_list(*_INTERVAL_FIELDS)
    intervals = []
    for (
        pk, cluster_id, namespace, name, job, username, meter_id, meter_id_now,
        product, profile, unit, share, start_at, end_at,
    ) in rows:  # fmt: skip
        start = max(epoch_ms(start_at), window_start)
        end = min(epoch_ms(end_at), window_end) if end_at else window_end
        if end <= start:
            continue
        intervals.append(
            _Interval(
                allocation_id=pk,
                cluster_id=cluster_id,
                claim_namespace=namespace,
                claim_name=name,
                team_id=None,
                job=job,
                username=username,
                device_uuid=meter_id,
                renamed_uuid=meter_id_now if meter_id_now != meter_id else "",
                product_name=product,
                profile=profile,
                unit=unit,
                start_ms=start,
                end_ms=end,
                share=share,
            )
        )
    return charge_by_team(intervals, start=first, end=first + count * HOUR, ms=epoch_ms)


class _Piece(NamedTuple):
    """An allocation's part of one hour of the window, less than that hour's part."""

    interval: _Interval
    hour: int  # hours since the epoch
    start_ms: int
    end_ms: int


def _split(
    intervals: list[_Interval], window_start: int, window_end: int
) -> tuple[list[tuple[_Interval, int, int]], list[_Piece]]:
    """Each interval's run of hours it holds whole (first and last hour since the epoch; at
    most one run), and the pieces of the hours it holds in part (at most two). An interval of a
    device renamed since it started is all pieces, one an hour: its samples go by two names."""
    whole: list[tuple[_Interval, int, int]] = []
    partial: list[_Piece] = []
    for interval in intervals:
        first = interval.start_ms // MS_PER_HOUR
        last = (interval.end_ms - 1) // MS_PER_HOUR
        if interval.renamed_uuid:
            partial.extend(
                _Piece(
                    interval,
                    hour,
                    max(interval.start_ms, hour * MS_PER_HOUR),
                    min(interval.end_ms, (hour + 1) * MS_PER_HOUR),
                )
                for hour in range(first, last + 1)
            )
            continue
        run_first, run_last = first, last
        if interval.start_ms != max(first * MS_PER_HOUR, window_start):
            partial.append(
                _Piece(
                    interval,
                    first,
                    interval.start_ms,
                    min(interval.end_ms, (first + 1) * MS_PER_HOUR),
                )
            )
            run_first = first + 1
        if interval.end_ms != min((last + 1) * MS_PER_HOUR, window_end) and run_first <= last:
            partial.append(
                _Piece(interval, last, max(interval.start_ms, last * MS_PER_HOUR), interval.end_ms)
            )
            run_last = last - 1
        if run_first <= run_last:
            whole.append((interval, run_first, run_last))
    return whole, partial


def _per_hour_sql(window_start: int, window_end: int, source: _Source) -> str:
    """The statement of the window's per device-hour sums (`_PER_HOUR_SQL`'s rows): from
    `samples`, or (`sums`) from the sums kept as samples are written, but for an hour still in
    progress at the window's end, read from `samples`; an engine's, made as its readings were
    parsed, with those of the samples of the clusters that send them, if any."""
    if source.engine is not None:
        assert source.samples is not None  # else its table is read as it is
        return (
            f"{_sql(_PER_HOUR_SQL, samples=source.samples)} UNION ALL "
            f"SELECT * FROM {source.engine.table}"
        )
    samples, sums = source.samples, source.sums
    assert samples is not None
    if not sums or window_end // MS_PER_HOUR == window_start // MS_PER_HOUR:
        # No sums to read, or none of use: the window is one hour, still in progress.
        return _sql(_PER_HOUR_SQL, samples=samples)
    if window_end % MS_PER_HOUR == 0:
        return _SUMS_PER_HOUR_SQL.format(sums=HourSum._meta.db_table)
    tail = _sql(_PER_HOUR_SQL, samples=samples).replace("%(start)s", "%(tail)s")
    return _SUMS_AND_TAIL_SQL.format(sums=HourSum._meta.db_table, tail=tail)


def _insert_whole_hours(
    whole: list[tuple[_Interval, int, int]],
    window_start: int,
    window_end: int,
    source: _Source,
) -> int:
    """Write the usage rows of the hours allocations hold whole, in the database; how many."""
    if not whole:
        return 0
    params: dict[str, int | str] = {
        "start": window_start,
        "end": window_end,
        "first_hour": window_start // MS_PER_HOUR,
        "end_hour": window_end // MS_PER_HOUR,
        "tail": window_end // MS_PER_HOUR * MS_PER_HOUR,
        "hold": sample_hold_ms(),
        "intervals": json.dumps(
            [
                [
                    interval.allocation_id,
                    interval.cluster_id,
                    interval.device_uuid,
                    interval.product_name,
                    interval.profile,
                    interval.unit,
                    str(interval.share),
                    interval.claim_namespace,
                    interval.claim_name,
                    interval.team_id,
                    interval.job,
                    interval.username,
                    interval.share_micro,
                    first,
                    last,
                ]
                for interval, first, last in whole
            ]
        ),
    }
    # An engine's sums alone are a table already, read as they are.
    ready = source.engine.table if source.engine and source.samples is None else None
    with connection.cursor() as cursor:
        if ready is None:
            cursor.execute(
                f"CREATE TEMP TABLE {_PER_HOUR_TABLE} ON COMMIT DROP AS "
                f"{_per_hour_sql(window_start, window_end, source)}",
                params,
            )
        cursor.execute(
            _sql(
                _WHOLE_HOURS_SQL,
                samples="",
                intervals=json_rows(*_INTERVAL_TYPES, placeholder="%(intervals)s", jsonb=True),
                per_hour_table=ready or _PER_HOUR_TABLE,
                columns=", ".join(_USAGE_COLUMNS),
            ),
            params,
        )
        written = cursor.rowcount
        if ready is None:
            cursor.execute(f"DROP TABLE {_PER_HOUR_TABLE}")
    return written


def _piece_coverage(pieces: list[_Piece], source: _Source) -> dict[int, tuple[int, int]]:
    """Per piece (by position in `pieces`): milliseconds its device's samples cover within
    it, and those milliseconds times utilisation (`UTIL_SCALE`ths of a percent), under either
    of its names (each name's readings are in one of the source's samples and its engine's)."""
    if not pieces:
        return {}
    names = [
        (index, uuid, piece.start_ms, piece.end_ms)
        for index, piece in enumerate(pieces)
        for uuid in (piece.interval.device_uuid, piece.interval.renamed_uuid)
        if uuid
    ]
    found = source.engine.coverage(names) if source.engine is not None else {}
    if source.samples is None:
        return found
    with connection.cursor() as cursor:
        cursor.execute(
            _sql(
                _PIECE_COVERAGE_SQL,
                samples=source.samples,
                sample="s",
                pieces=json_rows("bigint", "text", "bigint", "bigint", placeholder="%(pieces)s"),
            ),
            {"pieces": json.dumps(names), "hold": sample_hold_ms()},
        )
        for index, covered, weighted in cursor:
            before = found.get(index, (0, 0))
            found[index] = (before[0] + int(covered), before[1] + int(weighted))
    return found


_USAGE_COLUMNS = (
    "hour",
    "allocation_id",
    "cluster_id",
    "device_uuid",
    "product_name",
    "profile",
    "unit",
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
    "timestamptz", "int8", "int8", "text", "text", "text", "text", "numeric", "text", "text",
    "int8", "text", "text", "int8", "int8", "int8",
)  # fmt: skip


def _partial_rows(pieces: list[_Piece], source: _Source) -> list[tuple[Any, ...]]:
    """The usage rows of the hours allocations hold in part, made here: they are few."""
    coverage = _piece_coverage(pieces, source)
    rows = []
    for index, piece in enumerate(pieces):
        interval = piece.interval
        covered_ms, measured = coverage.get(index, (0, 0))
        weighted = Fraction(measured)
        length = piece.end_ms - piece.start_ms
        if covered_ms > length:
            # Only where a device changed names: the last sample under the old name holds on
            # (no later sample of that name cuts it short) over the first under the new one.
            # The overlap is counted once, at the utilisation the two measured on average.
            weighted = weighted * length / covered_ms
            covered_ms = length
        rows.append(
            (
                hour_at(piece.hour),
                interval.allocation_id,
                interval.cluster_id,
                interval.device_uuid,
                interval.product_name,
                interval.profile,
                interval.unit,
                interval.share,
                interval.claim_namespace,
                interval.claim_name,
                interval.team_id,
                interval.job,
                interval.username,
                gpu_ms(length, interval.share_micro),
                utilised_gpu_ms(weighted, interval.share_micro),
                gpu_ms(length - covered_ms, interval.share_micro),
            )
        )
    return rows


def gpu_ms(milliseconds: int, share_micro: int) -> int:
    """Milliseconds of a device that is `share_micro` millionths of a GPU, in GPU-milliseconds,
    rounded half up (as the rollup's SQL does)."""
    return (milliseconds * share_micro + MICRO // 2) // MICRO


def utilised_gpu_ms(weighted: Fraction | int, share_micro: int) -> int:
    """Utilised GPU-milliseconds of `weighted` (covered milliseconds times `UTIL_SCALE`ths of
    a percent), rounded half up, exactly, as the rollup's SQL does."""
    return math.floor(Fraction(weighted) * share_micro / _UTILISED_UNIT + Fraction(1, 2))


def rollup_pending(*, now: datetime, limit: int | None = None) -> list[datetime]:
    """Roll up the hour just ended and the hours marked dirty, newest first, at most `limit`
    of them (default TALLY_ROLLUP_HOURS_PER_RUN); returns the hours done.

    A first sync of a cluster whose claims began months ago marks thousands of hours: they
    are worked off over the next runs, recent hours first, each run bounded. What is left
    stays marked, as does an hour the metering engine could not be asked about
    (`metering.prometheus.EngineUnavailable`): it is retried, never billed as idle.

    Hours that ended since the last run's hour just ended and before this one's (no worker ran
    when they ended) are marked first, so they are worked off as any marked hour; the hour
    just ended is then recorded (`RollupProgress`), whether it was rolled up or left marked.
    """
    limit = settings.TALLY_ROLLUP_HOURS_PER_RUN if limit is None else limit
    just_ended = hour_start(now) - HOUR
    last = rolled_through()
    if last is not None and last + HOUR < just_ended:
        missed = hours_between(last + HOUR, just_ended)
        log.warning(
            "rollup: %d hour(s) from %s ended while no rollup ran: marked for rollup",
            len(missed),
            f"{last + HOUR:%Y-%m-%d %H:00}",
        )
        mark_dirty(hours=missed, at=now)
    marked = DirtyHour.objects.filter(hour__lt=now).exclude(hour=just_ended).order_by("-hour")
    read = dict(marked.values_list("hour", "version")[: max(limit - 1, 0)])
    read.update(DirtyHour.objects.filter(hour=just_ended).values_list("hour", "version"))
    due = [just_ended, *sorted(set(read) - {just_ended}, reverse=True)]
    try:
        rollup_hours(hours=due, now=now)
        pending: set[datetime] = set()
    except prometheus.EngineUnavailable as error:
        # Never billed as idle: `rollup_hours` marked these hours for the next run.
        pending = set(error.hours)
        log.warning("rollup: %d hours left pending: %s", len(pending), error)
    done = [hour for hour in due if hour not in pending]
    # Only the marks read, at the version read: a mark made while this ran (a new version,
    # whatever its `marked_at`) stays, so the newer data is not missed.
    taken = [(hour, read[hour]) for hour in done if hour in read]
    if taken:
        with connection.cursor() as cursor:
            cursor.execute(
                f"DELETE FROM {DirtyHour._meta.db_table} WHERE (hour, version) IN "
                "(SELECT * FROM unnest(%s::timestamptz[], %s::bigint[]))",
                [[hour for hour, _ in taken], [version for _, version in taken]],
            )
    # Not past the clock's hour just ended: a run for a later `now` (a worker whose clock is
    # ahead, a command given one) guessed the hours after it, which must still be taken.
    record_rolled_through(min(just_ended, hour_start(timezone.now()) - HOUR))
    return done


def rolled_through() -> datetime | None:
    """The newest hour a rollup run has taken as the hour just ended (`RollupProgress`); None
    before the first run."""
    return RollupProgress.objects.values_list("rolled_through", flat=True).first()


def record_rolled_through(hour: datetime) -> None:
    """Record that the rollup has taken `hour` as the hour just ended (`rollup_pending`; a
    benchmark's or a test's set-up). Never back: a run for an earlier `now` (`run_billing`)
    leaves a later mark."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {RollupProgress._meta.db_table} (id, rolled_through) VALUES (1, %s) "
            "ON CONFLICT (id) DO UPDATE SET rolled_through = "
            "GREATEST(EXCLUDED.rolled_through, "
            f"{RollupProgress._meta.db_table}.rolled_through)",
            [hour],
        )
