"""Late data since close: which closed periods' usage may have changed since the adjustments
that account for it were frozen, so that a refresh reads only those.

Every write of usage rows marks its hours (`UsageChange`), in the writing transaction, by the
triggers of migration 0009: a rollup (of late samples, adopted samples, allocations the sync
saw late, a re-attribution, an engine's readings), the just-ended hour rolled up after its
period closed, any SQL. Nothing that changes a closed period's usage can skip the mark.

A refresh reads the marks of the periods it prices first, then their usage (each statement
sees what was committed before it began, so every write its usage read misses is one whose
mark it did not read). A closed period without marks is billed exactly as its frozen lines
and the adjustments already issued for it say: reading it would give the adjustments the
open period already holds. The close of a period deletes the marks its last refresh read
(its own, and those of the closed periods it re-read), each only if its version is still the
one read, so a mark made while the close ran survives it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime

from django.db import connection

from billing.models import Period, UsageChange

Mark = tuple[datetime, int]  # an hour and its mark's version, as read


def read_marks(periods: Sequence[Period]) -> dict[int, list[Mark]]:
    """The marks the hours of `periods` hold now, per period (by pk), in one query; a period
    without marks is absent."""
    if not periods:
        return {}
    ordered = sorted(periods, key=lambda period: period.start)
    starts = [period.start for period in ordered]
    marks: dict[int, list[Mark]] = defaultdict(list)
    for hour, version in UsageChange.objects.filter(
        hour__gte=ordered[0].start, hour__lt=max(period.end for period in ordered)
    ).values_list("hour", "version"):
        period = ordered[bisect_right(starts, hour) - 1]
        if hour < period.end:
            marks[period.pk].append((hour, version))
    return dict(marks)


def clear_marks(marks: Iterable[Mark]) -> int:
    """Delete `marks` (as `read_marks` read them), each only where its version is still the
    one read: a write committed since (its usage not counted by what read the marks) raised
    the version, and keeps its mark. A mark a write holds uncommitted is left too (SKIP
    LOCKED): that write raises its version when it commits, and a close never waits for a
    rollup, nor deadlocks with one. The number deleted."""
    read = sorted(marks)
    if not read:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            """
            DELETE FROM billing_usagechange
            WHERE hour IN (
                SELECT mark.hour
                FROM billing_usagechange AS mark
                JOIN unnest(%s::timestamptz[], %s::bigint[]) AS read(hour, version)
                  ON mark.hour = read.hour AND mark.version = read.version
                FOR UPDATE OF mark SKIP LOCKED
            )
            """,
            [[hour for hour, _ in read], [version for _, version in read]],
        )
        return cursor.rowcount


def mark_hours(hours: Iterable[datetime]) -> None:
    """Mark `hours` as a write of their usage rows does: for a change that alters how a
    closed period's usage is priced without writing a usage row (a rate card's currency or
    model changed over closed days), so that the next refresh reads the period again."""
    ordered = sorted(set(hours))
    if not ordered:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO billing_usagechange (hour, version)
            SELECT hour, nextval('billing_usagechange_version')
            FROM unnest(%s::timestamptz[]) AS hour
            ORDER BY hour
            ON CONFLICT (hour) DO UPDATE SET version = EXCLUDED.version
            """,
            [ordered],
        )
