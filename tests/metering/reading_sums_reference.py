"""What the rollup's SQL makes of an engine's readings loaded as before the sums were made in
Python (`prometheus.load_readings`, the view shaped like `billing_sample`), and what the sums
made in Python (`metering.reading_sums`) and loaded (`prometheus.load_hour_sums`) read back as:
the references `test_prometheus_hour_sums` and its adversarial checks compare. Each runs in a
transaction it rolls back (the temporary tables go with it)."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from django.db import connection, transaction

from db.copy import json_rows
from metering import prometheus, reading_sums, rollup

Columns = reading_sums.Columns
Row = tuple[Any, ...]


def _readings(columns: dict[str, Columns]) -> prometheus.Readings:
    return prometheus.Readings(metered=set(columns), mixed=False, columns=columns)


def _by_device_and_hour(rows: Any) -> list[Row]:
    return sorted(rows, key=lambda row: (row[0], row[1]))


def sql_hour_sums(
    columns: dict[str, Columns], start_ms: int, end_ms: int, hold_ms: int
) -> list[Row]:
    """`_PER_HOUR_SQL`'s rows over the readings' view."""
    with transaction.atomic():
        view = prometheus.load_readings(_readings(columns), start_ms=start_ms, end_ms=end_ms)
        with connection.cursor() as cursor:
            cursor.execute(
                rollup._sql(rollup._PER_HOUR_SQL, samples=view),
                {"start": start_ms, "end": end_ms, "hold": hold_ms},
            )
            rows = [tuple(row) for row in cursor.fetchall()]
        transaction.set_rollback(True)
    return _by_device_and_hour(rows)


def python_hour_sums(
    columns: dict[str, Columns], start_ms: int, end_ms: int, hold_ms: int
) -> list[Row]:
    """`reading_sums.hour_sums`, as the SQL's types read back (the weighted sums numeric)."""
    rows = reading_sums.hour_sums(columns, start_ms=start_ms, end_ms=end_ms, hold_ms=hold_ms)
    return _by_device_and_hour(
        (meter, h, covered, Decimal(weighted), spill, None if sw is None else Decimal(sw))
        for meter, h, covered, weighted, spill, sw in rows
    )


def loaded_hour_sums(columns: dict[str, Columns], start_ms: int, end_ms: int) -> list[Row] | None:
    """What the rollup reads of `load_hour_sums`' table (None where it falls back to the
    readings); under the hold in force."""
    with transaction.atomic():
        loaded = prometheus.load_hour_sums(_readings(columns), start_ms=start_ms, end_ms=end_ms)
        if loaded is None:
            transaction.set_rollback(True)
            return None
        assert loaded.samples is None
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT * FROM {loaded.table}")
            rows = [tuple(row) for row in cursor.fetchall()]
        transaction.set_rollback(True)
    return _by_device_and_hour(rows)


def sql_coverage(
    columns: dict[str, Columns],
    pieces: list[tuple[int, str, int, int]],
    *,
    start_ms: int,
    end_ms: int,
    hold_ms: int,
) -> dict[int, tuple[int, int]]:
    """`_PIECE_COVERAGE_SQL`'s coverage of `pieces` over the readings' view of the window."""
    with transaction.atomic():
        view = prometheus.load_readings(_readings(columns), start_ms=start_ms, end_ms=end_ms)
        with connection.cursor() as cursor:
            cursor.execute(
                rollup._sql(
                    rollup._PIECE_COVERAGE_SQL,
                    samples=view,
                    sample="s",
                    pieces=json_rows(
                        "bigint", "text", "bigint", "bigint", placeholder="%(pieces)s"
                    ),
                ),
                {"pieces": json.dumps(pieces), "hold": hold_ms},
            )
            found = {int(p): (int(c), int(w)) for p, c, w in cursor.fetchall()}
        transaction.set_rollback(True)
    return found
