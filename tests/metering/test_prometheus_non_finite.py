"""An engine's readings that are no number (NaN, +Inf, -Inf: what an exporter that lost its
device may write, and Prometheus keeps) are left out as the engine's answers are parsed
(`metering.prometheus`): the time they would have covered is unmeasured, exactly as if they
had not been scraped, and every other reading of the run is billed as before. None of them
reaches the per device-hour sums (`metering.reading_sums`) or the rollup's SQL, where one
would refuse the run's rows.

Against real Prometheus servers, backfilled from OpenMetrics with the recorded day of
`test_prometheus_source`: one where the first H100's readings (both of its DCGM metrics)
are NaN and infinities for twenty minutes of one hour, one where those readings are simply
missing, and the day as recorded.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from metering import rollup
from metering.hours import epoch_ms
from metering.models import Sample, UsageHour
from teams.models import Team
from tests.metering import test_prometheus_source as source
from tests.metering.test_prometheus_source import day_engine, team  # noqa: F401

pytestmark = pytest.mark.django_db

HOUR = 5
GONE = (
    epoch_ms(source.DAY + timedelta(hours=HOUR, minutes=10)),
    epoch_ms(source.DAY + timedelta(hours=HOUR, minutes=30)),
)
# What the exporter writes instead of a number, in turn.
NOT_NUMBERS = ("NaN", "+Inf", "-Inf")


def _day(*, non_finite: bool) -> dict[source.Key, list[tuple[int, str]]]:
    """The recorded day with the first H100's readings in `GONE` replaced by NaN and
    infinities (`non_finite`) or left out."""
    series = source.day_series()
    for key, points in series.items():
        if dict(key[1]).get("UUID") != source.H100_A:
            continue
        changed = []
        for index, (ts, value) in enumerate(points):
            if GONE[0] <= ts < GONE[1]:
                if not non_finite:
                    continue
                value = NOT_NUMBERS[index % len(NOT_NUMBERS)]
            changed.append((ts, value))
        series[key] = changed
    return series


def _engine(tmp: Any, series: dict[source.Key, list[tuple[int, str]]]) -> Iterator[str]:
    server, promtool = source._binaries()
    (tmp / "day.om").write_text(source.openmetrics(series))
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(tmp / "day.om"),
         str(tmp / "tsdb")],
        check=True, capture_output=True,
    )  # fmt: skip
    url, process = source._serve(server, tmp, "global:\n  scrape_interval: 1h\n")
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def non_finite_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _engine(tmp_path_factory.mktemp("prometheus-nan"), _day(non_finite=True))


@pytest.fixture(scope="module")
def missing_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _engine(tmp_path_factory.mktemp("prometheus-missing"), _day(non_finite=False))


def _rows(url: str, **more: Any) -> dict[tuple[int, str], tuple[int, int, int]]:
    """The usage rows of `HOUR` and the hour after it rolled up from the engine at `url`."""
    hours = [source.at(HOUR), source.at(HOUR + 1)]
    with source.prometheus_settings(url, **more):
        rollup.rollup_hours(hours=hours, now=source.at(48))
    return {
        (row.allocation_id, row.hour.isoformat()): (
            row.allocated_gpu_ms,
            row.utilised_gpu_ms,
            row.unmeasured_gpu_ms,
        )
        for row in UsageHour.objects.filter(hour__in=hours)
    }


@pytest.mark.parametrize("more", [{}, {"TALLY_PROMETHEUS_STEP_SECONDS": 60}])
def test_readings_that_are_no_number_are_left_out_as_if_never_scraped(
    non_finite_engine: str,
    missing_engine: str,
    day_engine: str,  # noqa: F811
    team: Team,  # noqa: F811
    more: dict[str, int],
) -> None:
    allocations = source.the_day(team)
    source.feed_samples(allocations)
    Sample.objects.filter(device_uuid__in=source.metered_by_engine(allocations)).delete()

    recorded = _rows(day_engine, **more)
    with_non_numbers = _rows(non_finite_engine, **more)
    missing = _rows(missing_engine, **more)

    # Every allocation of the hours has its rows: none refused for the first H100's readings.
    assert with_non_numbers.keys() == recorded.keys()
    assert with_non_numbers == missing
    # The twenty minutes are unmeasured time of the first H100 (billed as such, not as idle),
    # and nothing else changed.
    h100 = allocations["h100-a"].pk
    key = (h100, source.at(HOUR).isoformat())
    allocated, utilised, unmeasured = with_non_numbers[key]
    assert allocated == recorded[key][0]
    assert unmeasured > recorded[key][2] + 15 * 60_000
    assert utilised < recorded[key][1]
    others = {k: v for k, v in with_non_numbers.items() if k[0] != h100}
    assert others == {k: v for k, v in recorded.items() if k[0] != h100}
