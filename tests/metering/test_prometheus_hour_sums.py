"""An engine's readings summed per device and hour here (`metering.reading_sums`) give exactly
the rows the rollup's SQL makes of the same readings loaded and read through the view shaped
like `billing_sample` (`metering.prometheus.load_readings`): the per-hour sums
(`_PER_HOUR_SQL`) and the coverage of pieces of hours (`_PIECE_COVERAGE_SQL`), on awkward
readings: odd offsets, gaps past the hold, instants on an hour's edge or the window's, one
reading, readings before the hold and after the window, windows ending inside an hour. No
engine needed."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metering import prometheus, reading_sums
from tests.metering import reading_sums_reference as reference

pytestmark = pytest.mark.django_db

HOUR = 3_600_000
START = 1_772_409_600_000  # an hour's start
HOLD = 120_000

Columns = reference.Columns


_percents = st.one_of(
    st.integers(min_value=0, max_value=100).map(float),
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False).map(lambda value: round(value, 2)),
    # Halves of a millionth, where rounding half to even shows.
    st.integers(min_value=0, max_value=200).map(lambda n: n * 0.5e-6 + 12.0),
)
# Instants near the edges that matter: hours' starts, the hold before the window, the end.
_anchors = st.sampled_from(
    [START - HOLD, START - HOUR, START, START + HOUR, START + 2 * HOUR, START + 3 * HOUR]
)


@st.composite
def _columns(draw: st.DrawFn) -> Columns:
    first = draw(_anchors) + draw(st.integers(min_value=-200_000, max_value=200_000))
    gaps = draw(
        st.lists(
            st.one_of(
                st.integers(min_value=1, max_value=90_000),
                st.integers(min_value=HOLD - 2, max_value=HOLD + 2),
                st.integers(min_value=1, max_value=2 * HOUR),
                st.sampled_from([60_000, 1, HOUR]),
            ),
            max_size=80,
        )
    )
    stamps = [first]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    percents = draw(st.lists(_percents, min_size=len(stamps), max_size=len(stamps)))
    return stamps, percents


_windows = st.tuples(
    st.integers(min_value=0, max_value=2).map(lambda hour: START + hour * HOUR),
    st.one_of(
        st.integers(min_value=1, max_value=3).map(lambda hours: hours * HOUR),
        st.integers(min_value=1, max_value=3 * HOUR),
    ),
)


@override_settings(TALLY_SAMPLE_HOLD_SECONDS=HOLD // 1000)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    devices=st.dictionaries(st.sampled_from(["GPU-a", "GPU-b", "MIG-c", "d\te"]), _columns()),
    window=_windows,
)
@example(  # readings exactly on hours' starts, a gap past the hold across one
    devices={"GPU-a": ([START - HOUR, START, START + HOUR - 1, START + HOUR], [10.0, 20, 30, 40])},
    window=(START, 2 * HOUR),
)
@example(devices={"GPU-a": ([START - 1], [50.0])}, window=(START, HOUR))  # one, before it
@example(devices={"GPU-a": ([START + HOUR - 1_000], [50.0])}, window=(START, HOUR))  # its end
@example(  # the window ending inside an hour, a reading after it
    devices={"GPU-a": ([START + 10_000, START + 70_000, START + 130_000], [1.0, 2.0, 3.0])},
    window=(START, 100_000),
)
def test_the_hour_sums_made_here_are_the_sqls(
    devices: dict[str, Columns], window: tuple[int, int]
) -> None:
    start_ms, length = window
    end_ms = start_ms + length
    expected = reference.sql_hour_sums(devices, start_ms, end_ms, HOLD)
    assert reference.python_hour_sums(devices, start_ms, end_ms, HOLD) == expected
    assert reference.loaded_hour_sums(devices, start_ms, end_ms) == expected


@override_settings(TALLY_SAMPLE_HOLD_SECONDS=HOLD // 1000)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    devices=st.dictionaries(st.sampled_from(["GPU-a", "GPU-b"]), _columns(), min_size=1),
    cuts=st.lists(
        st.tuples(
            st.sampled_from(["GPU-a", "GPU-b", "GPU-none"]),
            st.integers(min_value=0, max_value=HOUR),
            st.integers(min_value=0, max_value=HOUR),
        ),
        max_size=6,
    ),
)
def test_the_coverage_of_pieces_made_here_is_the_sqls(
    devices: dict[str, Columns], cuts: list[tuple[str, int, int]]
) -> None:
    """Pieces of an hour (a piece may come under two names, as a renamed device's does)."""
    pieces = [
        (index // 2, meter, START + min(a, b), START + max(a, b) + 1)
        for index, (meter, a, b) in enumerate(cuts)
    ]
    found = reading_sums.piece_coverage(devices, pieces, hold_ms=HOLD)
    assert found == reference.sql_coverage(
        devices, pieces, start_ms=START, end_ms=START + HOUR, hold_ms=HOLD
    )


def test_a_nan_percent_is_left_to_the_sql() -> None:
    """A percent the sums cannot round (NaN) loads nothing here: the rollup loads the
    readings as before, whose SQL refuses what it cannot make."""
    readings = prometheus.Readings(
        metered={"GPU-a"}, mixed=False, columns={"GPU-a": ([START], [float("nan")])}
    )
    with transaction.atomic():
        assert prometheus.load_hour_sums(readings, start_ms=START, end_ms=START + HOUR) is None


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.integers(min_value=-5, max_value=105).map(float),
            st.sampled_from([0.0, -0.0, 100.0, 1e-9, 99.999]),
            st.floats(min_value=-10.0, max_value=110.0, allow_nan=False),
        ),
        max_size=8,
    ),
    scale=st.sampled_from([1.0, 100.0, 0.5]),
)
def test_the_percents_of_a_series_are_each_readings(values: list[float], scale: float) -> None:
    """`_percents` (a series' values at once) gives each value's `_percent`, to the bit
    (-0.0 read as 0.0)."""
    expected = [repr(prometheus._percent(value, scale)) for value in values]
    assert [repr(value) for value in prometheus._percents(list(values), scale)] == expected
