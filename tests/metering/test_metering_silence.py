"""Metering sources that cannot lie by silence (issue 33, finding 6).

An engine that answers "success" with no series billed every hour as unmeasured and nothing
said so; one that accepts connections and never answers held a worker for the timeout of each
hour. Now a silence keeps the hours pending for a grace, warned of, counted and alerted to the
operators, before they are billed unmeasured; and one rollup run is bounded in time.

Against the real Prometheus of `test_prometheus_source` (a selector that matches nothing: the
engine's own "success, no series") and against local HTTP servers that answer empty, slowly
(a proxy to the real one) or never.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Generator, Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from prometheus_client import REGISTRY

from billing.alerts import evaluate_alerts
from metering import prometheus, rollup
from metering.models import DirtyHour, UsageHour
from teams.models import Alert, AlertKind, AlertState, Team
from tests.metering.test_prometheus_source import (
    PROM_CLUSTER,
    at,
    billed_clusters,
    day_engine,  # noqa: F401 (fixture)
    prometheus_settings,
    team,  # noqa: F401 (fixture)
    the_day,
)

pytestmark = pytest.mark.django_db

HOUR = at(4)
WITHIN_GRACE = HOUR + timedelta(hours=1, minutes=10)
PAST_GRACE = HOUR + timedelta(hours=7)  # the grace is 6 hours by default
NOWHERE = 'cluster="nowhere"'  # matches no series: the engine answers success, empty


def silent_hours(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "tally_metering_silent_hours_total", {"cluster": PROM_CLUSTER, "outcome": outcome}
    )
    return value or 0.0


def silence_alert() -> Alert:
    return Alert.objects.get(kind=AlertKind.METERING_SILENT, key=PROM_CLUSTER)


def test_a_real_engine_answering_no_series_keeps_the_hours_pending_then_bills_them_unmeasured(
    day_engine: str,  # noqa: F811
    team: Team,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    allocations = the_day(team)
    pending_before = silent_hours("pending")

    with prometheus_settings(day_engine, TALLY_PROMETHEUS_SELECTOR=NOWHERE):
        caplog.set_level(logging.WARNING, logger="metering.silence")
        done = rollup.rollup_pending(now=WITHIN_GRACE, limit=1)

    # Within the grace: not billed, still to do, and said three ways.
    assert done == []
    assert billed_clusters(HOUR) == {"samples-west"}
    assert DirtyHour.objects.filter(hour=HOUR).exists()
    assert silent_hours("pending") == pending_before + 1
    assert f"cluster {PROM_CLUSTER}: {day_engine} answered with no reading" in caplog.text
    alert = silence_alert()
    assert alert.state == AlertState.FIRING and alert.labels["outcome"] == "pending"

    # Past the grace: billed as the engine said, unmeasured, and still said.
    with prometheus_settings(day_engine, TALLY_PROMETHEUS_SELECTOR=NOWHERE):
        rollup.rollup_hours(hours=[HOUR], now=PAST_GRACE)
    row = UsageHour.objects.get(hour=HOUR, allocation=allocations["h100-a"])
    assert row.unmeasured_gpu_ms == row.allocated_gpu_ms > 0
    assert silent_hours("unmeasured") >= 1
    assert silence_alert().labels["outcome"] == "unmeasured"

    # An engine that answers again: measured; the alert resolves after its hour.
    with prometheus_settings(day_engine):
        rollup.rollup_hours(hours=[HOUR], now=PAST_GRACE)
    assert UsageHour.objects.get(hour=HOUR, allocation=allocations["h100-a"]).unmeasured_gpu_ms == 0
    evaluate_alerts(now=PAST_GRACE + timedelta(minutes=30))
    assert silence_alert().state == AlertState.FIRING
    evaluate_alerts(now=PAST_GRACE + timedelta(hours=2))
    assert silence_alert().state == AlertState.RESOLVED


def test_the_grace_is_a_setting(day_engine: str, team: Team) -> None:  # noqa: F811
    allocations = the_day(team)
    with prometheus_settings(
        day_engine, TALLY_PROMETHEUS_SELECTOR=NOWHERE, TALLY_PROMETHEUS_SILENCE_GRACE_SECONDS=0
    ):
        assert rollup.rollup_pending(now=WITHIN_GRACE, limit=1) == [HOUR]
    row = UsageHour.objects.get(hour=HOUR, allocation=allocations["h100-a"])
    assert row.unmeasured_gpu_ms == row.allocated_gpu_ms


class _Empty(http.server.BaseHTTPRequestHandler):
    """An engine that answers every query "success" with no series."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"status":"success","data":{"resultType":"matrix","result":[]}}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Generator[str, None, None]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.handle_error = lambda *_: None  # type: ignore[method-assign]  # a client gone: ours
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def empty_engine() -> Iterator[str]:
    yield from serve(_Empty)


def test_an_empty_engine_is_held_back_and_meter_prometheus_warns(
    empty_engine: str,
    team: Team,  # noqa: F811
) -> None:
    the_day(team)
    with prometheus_settings(empty_engine):
        assert rollup.rollup_pending(now=WITHIN_GRACE, limit=1) == []
        err = StringIO()
        call_command("meter_prometheus", "--hour", HOUR.isoformat(), stdout=StringIO(), stderr=err)
    assert billed_clusters(HOUR) == {"samples-west"}
    assert DirtyHour.objects.filter(hour=HOUR).exists()
    assert silence_alert().state == AlertState.FIRING
    assert f"warning: cluster {PROM_CLUSTER}: {empty_engine} answered with no reading" in (
        err.getvalue()
    )


@pytest.fixture
def mute_engine() -> Iterator[str]:
    """An engine that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_an_engine_that_never_answers_holds_a_run_for_one_timeout_not_one_per_hour(
    mute_engine: str,
    team: Team,  # noqa: F811
) -> None:
    """24 windows of an hour each: before, each waited the timeout (24 s at 1 s)."""
    the_day(team)
    hours = [at(n) for n in range(24)]
    started = time.monotonic()
    with (
        prometheus_settings(mute_engine, TALLY_PROMETHEUS_TIMEOUT_SECONDS=1),
        pytest.raises(prometheus.EngineUnavailable) as failed,
    ):
        rollup.rollup_hours(hours=hours, now=at(48))
    assert time.monotonic() - started < 6
    assert set(failed.value.hours) == set(hours)
    assert set(DirtyHour.objects.values_list("hour", flat=True)) >= set(hours)
    assert billed_clusters(at(4)) == {"samples-west"}


class _Slow(http.server.BaseHTTPRequestHandler):
    """A slow engine: each query forwarded to the real one after a pause."""

    upstream = ""
    pause = 0.02

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.pause)
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{self.upstream}{self.path}",
                data=body,
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            ),
            timeout=30,
        ) as answer:
            answered = answer.read()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answered)))
        self.end_headers()
        self.wfile.write(answered)

    def log_message(self, *_: Any) -> None:
        pass


def test_a_slow_engine_is_asked_until_the_runs_deadline_and_the_next_run_goes_on(
    day_engine: str,  # noqa: F811
    team: Team,  # noqa: F811
) -> None:
    allocations = the_day(team)
    _Slow.upstream = day_engine
    hours = [at(n) for n in range(24)]
    slow = serve(_Slow)
    url = next(slow)
    try:
        started = time.monotonic()
        with (
            prometheus_settings(url, TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS=2),
            pytest.raises(prometheus.EngineUnavailable, match="RUN_DEADLINE") as failed,
        ):
            rollup.rollup_hours(hours=hours, now=at(48))
        # The question under way when the deadline came is cut at it.
        elapsed = time.monotonic() - started
        left = set(failed.value.hours)
        assert elapsed < 2 + 2 * _Slow.pause + 2
        assert left and left < set(hours)
        done = [hour for hour in hours if hour not in left]
        assert all(PROM_CLUSTER in billed_clusters(hour) for hour in done)
        assert not any(PROM_CLUSTER in billed_clusters(hour) for hour in left)
        # The next runs go on where it stopped.
        with prometheus_settings(url, TALLY_PROMETHEUS_RUN_DEADLINE_SECONDS=60):
            rollup.rollup_pending(now=at(48), limit=100)
    finally:
        slow.close()
    assert all(PROM_CLUSTER in billed_clusters(hour) for hour in hours)
    row = UsageHour.objects.get(hour=at(4), allocation=allocations["h100-a"])
    assert row.unmeasured_gpu_ms == 0 and row.utilised_gpu_ms > 0
