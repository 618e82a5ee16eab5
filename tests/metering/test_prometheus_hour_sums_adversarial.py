"""Adversarial checks of the engine's readings summed per device and hour in Python
(`metering.reading_sums`, `metering.prometheus.load_hour_sums`) against what the rollup made
of the same readings before: its SQL over the readings loaded as a view shaped like
`billing_sample` (`metering.prometheus.load_readings`, `_PER_HOUR_SQL`, `_PIECE_COVERAGE_SQL`).

Two levels:

- the functions, on readings the author's property tests do not draw: holds from a second to
  an hour, windows of several hours ending anywhere, readings long before the hold and long
  after the window, percents of every kind a `Readings` can hold (past 100, negative, tiny,
  halves of a millionth);
- the whole rollup (`rollup.rollup_hours`), its usage rows with the new path against the
  old one forced (`load_hour_sums` answering None, the fallback that loads the readings as
  before) and against the samples path given the same readings as samples: whole and part
  hours, renamed devices (pieces under two names), MIG shares, clusters metered by samples
  beside the engine's, hours in progress, reruns, an engine that answers in part.

The engine is stood in for by `prometheus.window_readings` patched to answer the readings
(what an engine returns for `[start - hold, end]`), so no Prometheus is needed.

Of the differences this review found, one is mended, its test kept: a run that fell back to
the readings, then a run summed here, in one transaction (the view over the samples' table now
goes first). Left as it is: a percent so large (3,000,000%, in a `Readings` made by hand) that
the SQL's bigint refuses it is summed here as a Python integer; parsed readings are clamped to
[0, 100] (`prometheus._percents`), so none reaches the sums. A NaN or an infinity from an
engine never reaches `Readings` either: the parse leaves it out
(`tests/metering/test_prometheus_non_finite.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from inventory.models import Allocation, Device
from metering import ingest, prometheus, reading_sums, rollup
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from metering.models import Sample, UsageHour
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
)
from tests.metering import reading_sums_reference as reference
from tests.metering import test_prometheus_source as source
from tests.metering.test_prometheus_source import day_engine, team  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

HOUR = 3_600_000
START = 1_772_409_600_000  # an hour's start

Columns = reference.Columns


# --- the functions against the SQL ------------------------------------------------------------


# Every percent a `Readings` may hold once parsed (clamped to [0, 100], two decimals or whole)
# and some it may not (what a caller building `Readings` by hand could pass).
_parsed_percents = st.one_of(
    st.sampled_from([0.0, 100.0, 12.5, 0.01, 99.99, 33.33, 66.67, 0.5, 50.0]),
    st.integers(min_value=0, max_value=10_000).map(lambda n: round(n / 100, 2)),
)
_odd_percents = st.one_of(
    _parsed_percents,
    # Halves of a millionth (rounding half to even), tiny and denormal values, past 100.
    st.integers(min_value=0, max_value=400).map(lambda n: n * 0.5e-6 + 12.0),
    st.sampled_from([1e-7, 4.9e-7, 5e-7, 5.000001e-7, 1e-300, 150.0, 1e6, 0.0000015]),
    st.floats(min_value=0.0, max_value=1000.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def _columns(draw: st.DrawFn, percents: st.SearchStrategy[float]) -> Columns:
    first = START + draw(st.integers(min_value=-3 * HOUR, max_value=4 * HOUR))
    gaps = draw(
        st.lists(
            st.one_of(
                st.integers(min_value=1, max_value=120_000),
                st.sampled_from([1, 1_000, 30_000, 60_000, HOUR, HOUR - 1, HOUR + 1, 2 * HOUR]),
                st.integers(min_value=1, max_value=3 * HOUR),
            ),
            max_size=60,
        )
    )
    stamps = [first]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    values = draw(st.lists(percents, min_size=len(stamps), max_size=len(stamps)))
    return stamps, values


_holds = st.one_of(
    st.sampled_from([1_000, 30_000, 120_000, 600_000, HOUR - 1_000, HOUR]),
    st.integers(min_value=1, max_value=3600).map(lambda seconds: seconds * 1000),
)
_windows = st.tuples(
    st.integers(min_value=-1, max_value=3).map(lambda hour: START + hour * HOUR),
    st.one_of(
        st.integers(min_value=1, max_value=4).map(lambda hours: hours * HOUR),
        st.integers(min_value=1, max_value=4 * HOUR),
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    devices=st.dictionaries(
        st.sampled_from(["GPU-a", "GPU-b", "MIG-c", "x\\y", "n\nl", "é", "\\N", "c\rr"]),
        _columns(_odd_percents),
    ),
    window=_windows,
    hold_ms=_holds,
)
@example(  # a hold of an hour: a span reaching over a whole hour into the one after
    devices={"GPU-a": ([START - HOUR + 10, START + 2 * HOUR], [40.0, 60.0])},
    window=(START, 3 * HOUR),
    hold_ms=HOUR,
)
@example(  # readings on every edge: the hold's start, the window's start and end
    devices={"GPU-a": ([START - 120_000, START, START + HOUR - 1, START + HOUR], [1.0, 2, 3, 4])},
    window=(START, HOUR),
    hold_ms=120_000,
)
@example(  # a window of one millisecond
    devices={"GPU-a": ([START - 1, START, START + 1], [10.0, 20, 30])},
    window=(START, 1),
    hold_ms=120_000,
)
@example(  # the window ends a millisecond into an hour, the hour before's last reading spills
    devices={"GPU-a": ([START + HOUR - 1_000, START + HOUR + 50_000], [70.0, 80.0])},
    window=(START, HOUR + 1),
    hold_ms=120_000,
)
def test_hour_sums_agree_with_the_sql_on_any_hold_and_window(
    devices: dict[str, Columns], window: tuple[int, int], hold_ms: int
) -> None:
    start_ms, length = window
    end_ms = start_ms + length
    expected = reference.sql_hour_sums(devices, start_ms, end_ms, hold_ms)
    assert reference.python_hour_sums(devices, start_ms, end_ms, hold_ms) == expected
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=hold_ms // 1000):
        assert reference.loaded_hour_sums(devices, start_ms, end_ms) == expected


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    devices=st.dictionaries(st.sampled_from(["GPU-a", "GPU-b"]), _columns(_odd_percents)),
    cuts=st.lists(
        st.tuples(
            st.sampled_from(["GPU-a", "GPU-b", "GPU-none"]),
            st.integers(min_value=-HOUR, max_value=3 * HOUR),
            st.integers(min_value=1, max_value=2 * HOUR),
        ),
        max_size=8,
    ),
    hold_ms=_holds,
)
def test_piece_coverage_agrees_with_the_sql_on_any_hold(
    devices: dict[str, Columns], cuts: list[tuple[str, int, int]], hold_ms: int
) -> None:
    """Pieces anywhere (before the window too), a piece under one, two or three names (the
    same name twice counts twice in the SQL's join: so it must here)."""
    pieces = [
        (index // 3, meter, START + offset, START + offset + length)
        for index, (meter, offset, length) in enumerate(cuts)
    ]
    found = reading_sums.piece_coverage(devices, pieces, hold_ms=hold_ms)
    assert found == reference.sql_coverage(
        devices, pieces, start_ms=START, end_ms=START + HOUR, hold_ms=hold_ms
    )


def test_rounding_half_to_even_matches_the_sql() -> None:
    """x.5 millionths: 12.0000005 rounds to 12000000 or 12000001 by the double it is; each
    percent's units as PostgreSQL's round() of the same double makes them."""
    percents = [n * 0.5e-6 + 12.0 for n in range(0, 64)] + [0.0000005, 0.0000015, 0.0000025]
    stamps = [START + 60_000 * index for index in range(len(percents))]
    columns = {"GPU-a": (stamps, percents)}
    expected = reference.sql_hour_sums(columns, START, START + 2 * HOUR, 120_000)
    assert reference.python_hour_sums(columns, START, START + 2 * HOUR, 120_000) == expected
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CAST(round(p * 1000000) AS bigint) FROM unnest(%s::float8[]) AS p",
            [percents],
        )
        assert [row[0] for row in cursor.fetchall()] == reading_sums._units(percents)


def test_nan_outside_the_window_is_summed_as_the_sql_does() -> None:
    """A NaN reading before the hold or after the window: neither sums it (the SQL never
    reads its row), so the new path does not fall back for it."""
    columns = {
        "GPU-a": (
            [START - 10 * HOUR, START + 1_000, START + 5 * HOUR],
            [float("nan"), 50.0, float("nan")],
        )
    }
    expected = reference.sql_hour_sums(columns, START, START + HOUR, 120_000)
    assert reference.python_hour_sums(columns, START, START + HOUR, 120_000) == expected
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=120):
        assert reference.loaded_hour_sums(columns, START, START + HOUR) == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_percent_the_sums_cannot_take_falls_back(value: float) -> None:
    """NaN and infinities inside the window: `load_hour_sums` answers None (the readings are
    loaded as before), and the SQL refuses them too (it cannot cast them to bigint)."""
    columns = {"GPU-a": ([START + 1_000], [value])}
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=120):
        assert reference.loaded_hour_sums(columns, START, START + HOUR) is None
    with pytest.raises(Exception, match="out of range"):
        reference.sql_hour_sums(columns, START, START + HOUR, 120_000)


# --- the whole rollup: new path against the old, and against samples -------------------------

T0 = datetime(2026, 11, 10, 8, tzinfo=UTC)
T0_MS = epoch_ms(T0)
MINUTE = 60_000


@contextmanager
def _engine_answers(
    columns: dict[str, Columns],
    *,
    mixed: bool,
    metered: set[str],
    unavailable: frozenset[str] = frozenset(),
) -> Iterator[None]:
    """`prometheus.window_readings` answering `columns` as an engine would for a window:
    each device's readings in `[start - hold, end]`. `unavailable`: clusters it does not
    answer for (EngineUnavailable carrying the others' readings)."""
    original = prometheus.window_readings

    def answer(*, held: Any, start_ms: int, end_ms: int, **_: Any) -> prometheus.Readings:
        low = start_ms - prometheus.sample_hold_ms()
        found: dict[str, Columns] = {}
        for meter, (stamps, values) in columns.items():
            kept = [(ts, v) for ts, v in zip(stamps, values, strict=True) if low <= ts <= end_ms]
            found[meter] = ([ts for ts, _ in kept], [v for _, v in kept])
        readings = prometheus.Readings(metered=set(metered), mixed=mixed, columns=found)
        if unavailable:
            raise prometheus.EngineUnavailable(
                "down", clusters=sorted(unavailable), answered=readings
            )
        return readings

    prometheus.window_readings = answer
    try:
        yield
    finally:
        prometheus.window_readings = original


@contextmanager
def _old_path() -> Iterator[None]:
    """The rollup as before the change: the readings loaded and summed by the SQL (the
    fallback `load_hour_sums` answering None takes)."""
    original = prometheus.load_hour_sums
    prometheus.load_hour_sums = lambda *args, **kwargs: None
    try:
        yield
    finally:
        prometheus.load_hour_sums = original


def _rows() -> list[tuple[Any, ...]]:
    fields = [f.name for f in UsageHour._meta.concrete_fields if f.name != "id"]
    return sorted(tuple(values) for values in UsageHour.objects.values_list(*fields))


def _rollup_rows(
    hours: list[datetime], now: datetime, *, unanswered: bool = False
) -> list[tuple[Any, ...]]:
    """The usage rows a rollup of `hours` leaves, rolled back after; with `unanswered`, an
    engine that did not answer for some clusters (`EngineUnavailable`) leaves the others'."""
    with transaction.atomic():
        with suppress(prometheus.EngineUnavailable) if unanswered else nullcontext():
            rollup.rollup_hours(hours=hours, now=now)
        rows = _rows()
        transaction.set_rollback(True)
    return rows


@st.composite
def _history(draw: st.DrawFn) -> dict[str, Any]:
    """Readings of two GPUs and a MIG device, allocations over them (whole hours, parts,
    open), a window of hours and a `now`."""
    devices = ["gpu-a", "gpu-b", "mig"]
    columns: dict[str, tuple[list[int], list[float]]] = {}
    for name in devices:
        count = draw(st.integers(min_value=0, max_value=40))
        offsets = draw(
            st.lists(
                st.one_of(
                    st.integers(min_value=-10 * MINUTE, max_value=3 * HOUR + 10 * MINUTE),
                    st.sampled_from(
                        [
                            -120_000,
                            -120_001,
                            -119_999,
                            0,
                            -1,
                            1,
                            HOUR - 1,
                            HOUR,
                            HOUR + 1,
                            2 * HOUR,
                            3 * HOUR,
                            3 * HOUR - 1,
                            30 * MINUTE,
                        ]
                    ),
                ),
                min_size=count,
                max_size=count,
                unique=True,
            )
        )
        offsets.sort()
        values = draw(st.lists(_parsed_percents, min_size=len(offsets), max_size=len(offsets)))
        columns[name] = ([T0_MS + offset for offset in offsets], values)
    bounds = st.tuples(
        st.sampled_from(devices),
        st.integers(min_value=-90, max_value=200),  # start, minutes from T0
        st.one_of(st.none(), st.integers(min_value=1, max_value=240)),  # minutes held
        st.booleans(),  # renamed since
    )
    holds = draw(st.lists(bounds, min_size=1, max_size=5))
    hours = draw(st.integers(min_value=1, max_value=3))
    now_minutes = draw(
        st.one_of(st.just(24 * 60), st.integers(min_value=1, max_value=hours * 60 + 30))
    )
    return {"columns": columns, "holds": holds, "hours": hours, "now": now_minutes}


def _fleet(cluster: str) -> dict[str, Device]:
    node = NodeFactory.create(cluster=ClusterFactory.create(name=cluster))
    gpu_a = DeviceFactory.create(node=node)
    gpu_b = DeviceFactory.create(node=node)
    mig = MigDeviceFactory.create(parent=gpu_b)
    return {"gpu-a": gpu_a, "gpu-b": gpu_b, "mig": mig}


def _node_name(device: Device) -> str:
    assert device.node is not None
    return device.node.name


def _allocate(fleet: dict[str, Device], holds: list[tuple[str, int, int | None, bool]]) -> None:
    for index, (name, start, held, renamed) in enumerate(holds):
        device = fleet[name]
        allocation = AllocationFactory.create(
            device=device,
            start=T0 + timedelta(minutes=start),
            end=None if held is None else T0 + timedelta(minutes=start + held),
        )
        if renamed:
            # The allocation kept the name its device had when it started: its readings go
            # by two names, the hours it holds all pieces.
            Allocation.objects.filter(pk=allocation.pk).update(
                meter_id=f"{device.meter_id}-was{index}"
            )


def _renamed_columns(
    fleet: dict[str, Device],
    columns: dict[str, Columns],
    holds: list[tuple[str, int, int | None, bool]],
) -> dict[str, Columns]:
    """Readings by meter id: each device's under its name now, and, for a renamed
    allocation, the first half of them under its old name."""
    found: dict[str, Columns] = {}
    for name, (stamps, values) in columns.items():
        found[fleet[name].meter_id] = (list(stamps), list(values))
    for index, (name, _, _, renamed) in enumerate(holds):
        if not renamed:
            continue
        current = fleet[name].meter_id
        stamps, values = found[current]
        half = len(stamps) // 2
        found[f"{current}-was{index}"] = (stamps[:half], values[:half])
        found[current] = (stamps[half:], values[half:])
    return found


def _compare_new_and_old(history: dict[str, Any], *, mixed: bool) -> None:
    """Usage rows with the new path and with the old; asserts they are the same. In a
    transaction rolled back after (each example starts from an empty fleet)."""
    with transaction.atomic():
        _compare_in_transaction(history, mixed=mixed)
        transaction.set_rollback(True)


def _compare_in_transaction(history: dict[str, Any], *, mixed: bool) -> None:
    fleet = _fleet("prom-east")
    holds = history["holds"]
    _allocate(fleet, holds)
    columns = _renamed_columns(fleet, history["columns"], holds)
    if mixed:
        # A cluster metered by samples beside it: its devices' samples in billing_sample.
        other = _fleet("samp-west")
        _allocate(other, holds)
        rows = [
            SampleRow(other[name].meter_id, ts, value, None, None)
            for name, (stamps, values) in history["columns"].items()
            for ts, value in zip(stamps, values, strict=True)
        ]
        ingest.ingest(
            node=_node_name(other["gpu-a"]), samples=rows, received_at=T0 + timedelta(hours=4)
        )
    metered = set(columns) | {device.meter_id for device in fleet.values()}
    hours = [T0 + index * timedelta(hours=1) for index in range(history["hours"])]
    now = T0 + timedelta(minutes=history["now"])
    with _engine_answers(columns, mixed=mixed, metered=metered):
        with _sums_used() as used:
            new = _rollup_rows(hours, now, unanswered=True)
        with _old_path():
            old = _rollup_rows(hours, now, unanswered=True)
    # The new path did sum the readings here (no fallback), for every run with readings.
    assert used and all(used)
    assert new == old


@contextmanager
def _sums_used() -> Iterator[list[bool]]:
    """Whether each call of `load_hour_sums` summed the readings (rather than falling back)."""
    original = prometheus.load_hour_sums
    used: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> prometheus.HourSums | None:
        loaded = original(*args, **kwargs)
        used.append(loaded is not None)
        return loaded

    prometheus.load_hour_sums = spy
    try:
        yield used
    finally:
        prometheus.load_hour_sums = original


_SETTINGS = {"TALLY_SAMPLE_HOLD_SECONDS": 120, "TALLY_METERING_SOURCE": "samples"}


@override_settings(**_SETTINGS)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history())
def test_the_rollup_writes_the_same_rows_as_the_old_path(history: dict[str, Any]) -> None:
    _compare_new_and_old(history, mixed=False)


@override_settings(**_SETTINGS)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history())
def test_a_mixed_fleet_writes_the_same_rows_as_the_old_path(history: dict[str, Any]) -> None:
    """Some clusters send samples: the engine's sums beside the samples' SQL."""
    _compare_new_and_old(history, mixed=True)


@override_settings(TALLY_SAMPLE_HOLD_SECONDS=3600, TALLY_METERING_SOURCE="samples")
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history())
def test_an_hour_long_hold_writes_the_same_rows_as_the_old_path(history: dict[str, Any]) -> None:
    _compare_new_and_old(history, mixed=True)


@override_settings(TALLY_SAMPLE_HOLD_SECONDS=1, TALLY_METERING_SOURCE="samples")
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history())
def test_a_one_second_hold_writes_the_same_rows_as_the_old_path(history: dict[str, Any]) -> None:
    _compare_new_and_old(history, mixed=False)


def _no_renames(history: dict[str, Any]) -> dict[str, Any]:
    return history | {"holds": [(n, s, h, False) for n, s, h, _ in history["holds"]]}


@override_settings(**_SETTINGS)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history().map(_no_renames))
def test_the_rollup_writes_the_same_rows_as_from_samples(history: dict[str, Any]) -> None:
    """The reference the bench uses: the same readings sent as samples, rolled up by the
    samples path (the sums kept of samples for the hours that have ended), give the same
    usage rows as the engine's readings summed here."""
    with transaction.atomic():
        fleet = _fleet("prom-east")
        _allocate(fleet, history["holds"])
        columns = _renamed_columns(fleet, history["columns"], history["holds"])
        hours = [T0 + index * timedelta(hours=1) for index in range(history["hours"])]
        now = T0 + timedelta(minutes=history["now"])
        with _engine_answers(columns, mixed=False, metered=set(columns)), _sums_used() as used:
            engine = _rollup_rows(hours, now)
        assert all(used)
        # The samples an agent would have sent, up to `now`.
        rows = [
            SampleRow(meter, ts, value, None, None)
            for meter, (stamps, values) in columns.items()
            for ts, value in zip(stamps, values, strict=True)
            if ts <= epoch_ms(now)
        ]
        ingest.ingest(node=_node_name(fleet["gpu-a"]), samples=rows, received_at=now)
        samples = _rollup_rows(hours, now)
        assert engine == samples
        transaction.set_rollback(True)


@override_settings(**_SETTINGS)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history())
def test_a_rerun_writes_the_same_rows(history: dict[str, Any]) -> None:
    """Idempotent: the same window rolled up twice in a row (in one transaction: the temporary
    tables of the first are still there) leaves the rows one run leaves."""
    with transaction.atomic():
        fleet = _fleet("prom-east")
        _allocate(fleet, history["holds"])
        columns = _renamed_columns(fleet, history["columns"], history["holds"])
        hours = [T0 + index * timedelta(hours=1) for index in range(history["hours"])]
        now = T0 + timedelta(minutes=history["now"])
        with _engine_answers(columns, mixed=True, metered=set(columns)):
            once = _rollup_rows(hours, now)
            with transaction.atomic():
                rollup.rollup_hours(hours=hours, now=now)
                rollup.rollup_hours(hours=hours, now=now)
                twice = _rows()
                transaction.set_rollback(True)
        assert once == twice
        transaction.set_rollback(True)


@override_settings(**_SETTINGS)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history(), changed=st.sampled_from([0.0, 100.0, 37.25]))
def test_an_engine_answering_in_part_leaves_its_clusters_rows(
    history: dict[str, Any], changed: float
) -> None:
    """Two clusters metered by the engine: once both answer; then one does not
    (EngineUnavailable carrying the other's readings). The unanswered cluster's rows stay as
    they were, the other's are rewritten from its new readings; as the old path does."""
    with transaction.atomic():
        east, west = _fleet("prom-east"), _fleet("prom-west")
        holds = history["holds"]
        _allocate(east, holds)
        _allocate(west, holds)
        columns = _renamed_columns(east, history["columns"], holds) | _renamed_columns(
            west, history["columns"], holds
        )
        metered = set(columns)
        hours = [T0 + index * timedelta(hours=1) for index in range(history["hours"])]
        now = T0 + timedelta(minutes=history["now"])
        with _engine_answers(columns, mixed=False, metered=metered):
            rollup.rollup_hours(hours=hours, now=now)
        before = _rows()
        west_ids = {d.cluster_id for d in west.values()}
        # The east cluster's readings change; west's engine is down (answers nothing of west).
        east_ids = {d.meter_id for d in east.values()}
        answered = {
            meter: (stamps, [changed] * len(stamps))
            for meter, (stamps, _) in columns.items()
            if meter.split("-was")[0] in east_ids
        }
        with _engine_answers(
            answered, mixed=False, metered=metered, unavailable=frozenset({"prom-west"})
        ):
            with _sums_used() as used:
                new = _rollup_rows(hours, now, unanswered=True)
            with _old_path():
                old = _rollup_rows(hours, now, unanswered=True)
        assert all(used)
        assert new == old
        cluster_at = 2  # hour, allocation, cluster, ... (`_rows`)
        assert [r for r in new if r[cluster_at] in west_ids] == [
            r for r in before if r[cluster_at] in west_ids
        ]
        transaction.set_rollback(True)


def _nan_then_sums_setup() -> tuple[dict[str, Columns], list[datetime]]:
    """A fleet of an engine's cluster and a samples cluster; readings with a NaN in the first
    of two runs (hours apart), none in the second."""
    fleet = _fleet("prom-east")
    other = _fleet("samp-west")
    for devices in (fleet, other):
        AllocationFactory.create(device=devices["gpu-a"], start=T0 - timedelta(hours=1))
    stamps = [T0_MS + 30 * MINUTE, T0_MS + 3 * HOUR + 30 * MINUTE]
    columns = {fleet["gpu-a"].meter_id: (stamps, [float("nan"), 50.0])}
    ingest.ingest(
        node=_node_name(other["gpu-a"]),
        samples=[SampleRow(other["gpu-a"].meter_id, ts, 40.0, None, None) for ts in stamps],
        received_at=T0 + timedelta(hours=5),
    )
    return columns, [T0, T0 + timedelta(hours=3)]


@override_settings(**_SETTINGS)
def test_a_fallback_run_then_a_summed_run_in_one_transaction() -> None:
    """Once a discrepancy (fixed: the samples' table is dropped after the view over it).
    rollup_hours over two runs (hours apart) inside the caller's transaction
    (each run's atomic a savepoint: its ON COMMIT DROP tables outlive it): the first run's
    readings hold a NaN (the readings loaded as before, with the samples cluster's samples
    under the view), the second's do not (summed here, the samples reloaded). The old path
    wrote the second run's rows; the new one raises."""
    columns, hours = _nan_then_sums_setup()
    metered = set(columns)
    now = T0 + timedelta(days=1)
    with _engine_answers(columns, mixed=True, metered=metered), transaction.atomic():
        with _old_path(), transaction.atomic():
            rollup.rollup_hours(hours=hours, now=now)
            old = _rows()
            transaction.set_rollback(True)
        rollup.rollup_hours(hours=hours, now=now)
        assert _rows() == old


@override_settings(**_SETTINGS, TALLY_ROLLUP_DEVICE_HOURS=1)
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history())
def test_runs_of_one_hour_write_the_same_rows_as_the_old_path(history: dict[str, Any]) -> None:
    """Each hour its own run (its own window and question): what spills into a window's
    first hour comes from the readings within the hold before it, every hour."""
    _compare_new_and_old(history, mixed=True)


@override_settings(**_SETTINGS, TALLY_ROLLUP_DEVICE_HOURS=1)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(history=_history().map(_no_renames))
def test_runs_of_one_hour_write_the_same_rows_as_from_samples(history: dict[str, Any]) -> None:
    test_the_rollup_writes_the_same_rows_as_from_samples.hypothesis.inner_test(  # type: ignore[attr-defined]
        history=history
    )


# --- a real engine's day, new path against the old --------------------------------------------


@pytest.mark.parametrize(
    ("more", "now_hours"),
    [
        ({}, 48.0),
        ({"TALLY_PROMETHEUS_STEP_SECONDS": 60}, 48.0),  # subquery mode: a mean per step
        ({"TALLY_SAMPLE_HOLD_SECONDS": 45}, 48.0),
        ({"TALLY_ROLLUP_DEVICE_HOURS": 1, "TALLY_SAMPLE_HOLD_SECONDS": 600}, 48.0),
        ({}, 10.5),  # the last hour in progress, during the outage of one GPU
        ({"TALLY_PROMETHEUS_STEP_SECONDS": 60}, 3 + 20 / 60 + 5 / 3600),  # just after a start
    ],
)
def test_a_real_engines_day_writes_the_same_rows_as_the_old_path(
    request: pytest.FixtureRequest, more: dict[str, int], now_hours: float
) -> None:
    """The recorded day served by Prometheus (DCGM with MIG instances, AMD, Intel; a cluster
    that sends samples beside it): the usage rows the new path writes are the old path's,
    with readings as scraped or as means per step, other holds, runs of one hour, and hours
    still in progress."""
    # The fixtures of `test_prometheus_source` (imported above): the engine, the team.
    url: str = request.getfixturevalue("day_engine")
    allocations = source.the_day(request.getfixturevalue("team"))
    source.feed_samples(allocations)
    Sample.objects.filter(device_uuid__in=source.metered_by_engine(allocations)).delete()
    now = source.DAY + timedelta(hours=now_hours)
    hours = [source.at(n) for n in range(24) if source.at(n) < now]
    with source.prometheus_settings(url, **more):
        with _sums_used() as used:
            rollup.rollup_hours(hours=hours, now=now)
        new = _rows()
        with _old_path():
            rollup.rollup_hours(hours=hours, now=now)
        old = _rows()
    assert used and all(used)
    assert sum(row[-2] for row in new) > 0  # utilised
    assert new == old


# Whole percents, summed in doubles without a rounding per reading (`reading_sums._units`
# answering None): clamped ones as parsed, and (by hand) negative, past 100 and large ones
# whose products still fit the SQL's bigint.
_whole_percents = st.one_of(
    st.integers(min_value=0, max_value=100).map(float),
    st.sampled_from([-0.0, 0.0, 100.0, -5.0, 150.0, 1_000.0, 2_000_000.0]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    devices=st.dictionaries(st.sampled_from(["GPU-a", "GPU-b"]), _columns(_whole_percents)),
    window=_windows,
    hold_ms=_holds,
)
@example(  # a reading an hour long at 100%, a spill past a window ending mid-hour
    devices={"GPU-a": ([START - HOUR, START + HOUR - 1, START + 2 * HOUR], [100.0, 100.0, 7.0])},
    window=(START, HOUR + 30 * MINUTE),
    hold_ms=HOUR,
)
def test_whole_percents_summed_in_doubles_agree_with_the_sql(
    devices: dict[str, Columns], window: tuple[int, int], hold_ms: int
) -> None:
    start_ms, length = window
    end_ms = start_ms + length
    expected = reference.sql_hour_sums(devices, start_ms, end_ms, hold_ms)
    assert reference.python_hour_sums(devices, start_ms, end_ms, hold_ms) == expected
    pieces = [(0, "GPU-a", start_ms, end_ms), (1, "GPU-b", start_ms, end_ms)]
    found = reading_sums.piece_coverage(devices, pieces, hold_ms=hold_ms)
    assert found == reference.sql_coverage(
        devices, pieces, start_ms=START, end_ms=START + HOUR, hold_ms=hold_ms
    )


@pytest.mark.parametrize("mixed", [False, True])
@override_settings(**_SETTINGS)
def test_a_refused_row_refuses_only_its_allocation_as_in_the_old_path(mixed: bool) -> None:
    """The database refuses one allocation's rows (a check added here stands for a value that
    does not fit): the rollup writes the others' one allocation at a time, the engine's sums
    read again for each (its table read as it is, or beside the samples); as the old path."""
    with connection.cursor() as cursor:
        cursor.execute(
            "ALTER TABLE billing_usagehour ADD CONSTRAINT promreview_refused "
            "CHECK (claim_name <> 'refuse-me')"
        )
    fleet = _fleet("prom-east")
    start = T0 - timedelta(hours=1)
    AllocationFactory.create(device=fleet["gpu-a"], start=start, claim__name="refuse-me")
    kept = [
        AllocationFactory.create(device=fleet["gpu-a"], start=start),
        AllocationFactory.create(device=fleet["gpu-b"], start=T0 + timedelta(minutes=7)),
        AllocationFactory.create(device=fleet["mig"], start=start, end=T0 + timedelta(hours=2)),
    ]
    stamps = [T0_MS + offset * MINUTE for offset in range(-3, 190, 2)]
    columns = {
        device.meter_id: (stamps, [float(index % 101) for index in range(len(stamps))])
        for device in fleet.values()
    }
    if mixed:
        other = _fleet("samp-west")
        kept.append(AllocationFactory.create(device=other["gpu-a"], start=start))
        ingest.ingest(
            node=_node_name(other["gpu-a"]),
            samples=[SampleRow(other["gpu-a"].meter_id, ts, 33.0, None, None) for ts in stamps],
            received_at=T0 + timedelta(hours=4),
        )
    hours = [T0, T0 + timedelta(hours=1), T0 + timedelta(hours=2)]
    now = T0 + timedelta(hours=2, minutes=41)
    with _engine_answers(columns, mixed=mixed, metered=set(columns)):
        with _sums_used() as used:
            new = _rollup_rows(hours, now)
        with _old_path():
            old = _rollup_rows(hours, now)
    assert used == [True]
    assert new == old
    assert {row[1] for row in new} == {allocation.pk for allocation in kept}


@pytest.mark.parametrize("mixed", [False, True])
@override_settings(**_SETTINGS)
def test_an_empty_answer_writes_unmeasured_hours_as_the_old_path(mixed: bool) -> None:
    """The engine answers no reading at all (an empty series for one device, none for the
    others): every allocated millisecond is unmeasured, none utilised; the sums table is
    empty and the samples beside it are still read."""
    fleet = _fleet("prom-east")
    for device in fleet.values():
        AllocationFactory.create(device=device, start=T0 - timedelta(minutes=30))
    columns: dict[str, Columns] = {fleet["gpu-a"].meter_id: ([], [])}
    metered = {device.meter_id for device in fleet.values()}
    if mixed:
        other = _fleet("samp-west")
        AllocationFactory.create(device=other["gpu-a"], start=T0 + timedelta(minutes=5))
        ingest.ingest(
            node=_node_name(other["gpu-a"]),
            samples=[SampleRow(other["gpu-a"].meter_id, T0_MS + 10 * MINUTE, 80.0, None, None)],
            received_at=T0 + timedelta(hours=4),
        )
    hours = [T0, T0 + timedelta(hours=1)]
    now = T0 + timedelta(hours=1, minutes=20)
    with _engine_answers(columns, mixed=mixed, metered=metered):
        with _sums_used() as used:
            new = _rollup_rows(hours, now)
        with _old_path():
            old = _rollup_rows(hours, now)
    assert used == [True]
    assert new == old
    engine_rows = [row for row in new if row[3] in metered]
    assert len(engine_rows) == 6
    assert all(row[-2] == 0 and row[-1] == row[-3] for row in engine_rows)
    assert any(row[-2] > 0 for row in new) == mixed
