"""What the rollup reads of an engine's readings (`metering.prometheus.load_readings`): a
device's readings stored a run to a row, read back through the view shaped like
`billing_sample` as one row per reading, with its gap to the device's next (NULL after its
last) and no covered time, whatever the number of readings (runs of `_RUN_READINGS` and
over), the meter id's characters or the percents. No engine needed."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering import prometheus

pytestmark = pytest.mark.django_db

START = 1_772_409_600_000  # an hour's start
HOUR = 3_600_000


def _view_rows(readings: prometheus.Readings) -> list[tuple[str, int, float, int | None, None]]:
    with transaction.atomic():
        name = prometheus.load_readings(readings, start_ms=START, end_ms=START + HOUR)
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT device_uuid, ts_ms, gpu_util, gap_ms, covered_ms FROM {name} "
                "ORDER BY device_uuid, ts_ms"
            )
            return [tuple(row) for row in cursor.fetchall()]


def _expected(readings: prometheus.Readings) -> list[tuple[str, int, float, int | None, None]]:
    rows: list[tuple[str, int, float, int | None, None]] = []
    for meter_id, (stamps, percents) in readings.columns.items():
        following: list[int | None] = [*stamps[1:], None]
        rows.extend(
            (meter_id, ts, percent, None if after is None else after - ts, None)
            for ts, percent, after in zip(stamps, percents, following, strict=True)
        )
    return sorted(rows, key=lambda row: (row[0], row[1]))


_meter_ids = st.text(
    alphabet=st.sampled_from("GPU-abc0123\t\\\n\r é{},\"'"), min_size=1, max_size=40
).filter(lambda text: "\x00" not in text)
_percents = st.one_of(
    st.integers(min_value=0, max_value=100).map(float),
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False).map(lambda value: round(value, 2)),
)


@st.composite
def _columns(draw: st.DrawFn) -> tuple[list[int], list[float]]:
    gaps = draw(st.lists(st.integers(min_value=1, max_value=200_000), max_size=200))
    stamps = [START - 120_000]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    return stamps, draw(st.lists(_percents, min_size=len(stamps), max_size=len(stamps)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(devices=st.dictionaries(_meter_ids, _columns(), max_size=4))
def test_the_view_reads_back_each_reading_with_its_gap(
    devices: dict[str, tuple[list[int], list[float]]],
) -> None:
    """Each reading once, its percent the same double, its gap to the device's next reading
    (across the rows a long run is split into), NULL after its last; no covered time."""
    readings = prometheus.Readings(metered=set(devices), mixed=False, columns=devices)
    assert _view_rows(readings) == _expected(readings)


def test_a_long_run_is_split_into_rows_and_read_whole() -> None:
    """An hour of readings every 10 s (361 with the hold's) is six rows of at most
    `_RUN_READINGS`, read back as 361 readings with their gaps, none lost at a row's edge."""
    stamps = [START - 10_000 + 10_000 * index for index in range(361)]
    percents = [float(index % 101) for index in range(361)]
    readings = prometheus.Readings(
        metered={"GPU-long"}, mixed=False, columns={"GPU-long": (stamps, percents)}
    )
    rows = _view_rows(readings)
    assert len(rows) == 361
    assert [row[3] for row in rows] == [10_000] * 360 + [None]
    assert rows == _expected(readings)
    with transaction.atomic():
        prometheus.load_readings(readings, start_ms=START, end_ms=START + HOUR)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {prometheus._READING_RUNS}")
            assert cursor.fetchone()[0] == -(-361 // prometheus._RUN_READINGS)


def test_no_readings_is_an_empty_view() -> None:
    """A window whose devices the engine gave nothing (an empty series too) reads no row."""
    readings = prometheus.Readings(
        metered={"GPU-a", "GPU-b"}, mixed=False, columns={"GPU-a": ([], [])}
    )
    assert _view_rows(readings) == []
