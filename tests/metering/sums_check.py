"""The per device-hour sums (`metering.hoursums`) against a recompute from every sample stored,
in Python: what the rollup's per-hour SQL makes of each sample's span, summed per device and
hour. The metering and billing tests' conftests check it after every test that wrote to the
database (`check_after_each_test`), whatever path wrote the samples."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.db.utils import DatabaseError

from metering.hours import MS_PER_HOUR

Sums = dict[tuple[str, int], tuple[int, int, int, int]]


def stored_sums() -> Sums:
    """The sums table, less rows all zeros (a row whose samples went: the same as none)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT device_uuid, h, covered, weighted, spill, spill_weighted FROM metering_hoursum"
        )
        return {
            (uuid, h): (covered, weighted, spill, spill_weighted)
            for uuid, h, covered, weighted, spill, spill_weighted in cursor.fetchall()
            if covered or weighted or spill or spill_weighted
        }


def recorded_hold() -> int | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT hold_ms FROM metering_hoursumstate WHERE id = 1")
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def recomputed_sums(hold_ms: int | None = None) -> Sums:
    """Every sample's span (its gap, at most its covered time and the hold), split at its
    hour's end, summed per device and hour in integers; all-zero groups left out."""
    hold = recorded_hold() if hold_ms is None else hold_ms
    sums: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT device_uuid, ts_ms, gpu_util, gap_ms, covered_ms "
            "FROM metering_readings(0, 9000000000000) WHERE gpu_util IS NOT NULL"
        )
        for uuid, ts, util, gap, covered in cursor.fetchall():
            span = min(value for value in (gap, covered, hold) if value is not None)
            hour = ts // MS_PER_HOUR
            next_hour = (hour + 1) * MS_PER_HOUR
            end = ts + span
            weight = round(util * 1_000_000)
            part = min(end, next_hour) - ts
            spill = max(end - next_hour, 0)
            row = sums[(uuid, hour)]
            row[0] += part
            row[1] += part * weight
            row[2] += spill
            row[3] += spill * weight
    return {key: (a, b, c, d) for key, (a, b, c, d) in sums.items() if a or b or c or d}


def assert_sums_right() -> None:
    stored, expected = stored_sums(), recomputed_sums()
    wrong = {
        key: (stored.get(key), expected.get(key))
        for key in stored.keys() | expected.keys()
        if stored.get(key) != expected.get(key)
    }
    assert not wrong, f"per device-hour sums differ from the samples' (stored, expected): {wrong}"


def check_after_each_test(item: pytest.Item) -> Iterator[Any]:
    """A `pytest_runtest_call` wrapper's body: after a test that passed and used the database,
    its sums must be its samples'."""
    result = yield
    if item.get_closest_marker("django_db") is None or connection.connection is None:
        return result
    try:
        if recorded_hold() is not None:
            assert_sums_right()
    except DatabaseError:
        pass  # a transaction the test left failed (its own business), or no tables
    return result
