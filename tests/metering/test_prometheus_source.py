"""Utilisation from a real Prometheus server (Debian's `prometheus` package) against the samples
path, on the same readings.

A simulated past day cannot be scraped live, so it is backfilled: the exporters' recorded
scrapes (tests/fixtures/prometheus/*.prom: DCGM with whole GPUs and MIG instances, AMD's
device-metrics-exporter, Intel's XPU Manager exporter) are replayed every 30 s over the day as
OpenMetrics with timestamps, loaded with `promtool tsdb create-blocks-from openmetrics`, and
served by `prometheus` on a free local port (a session fixture). The same readings go to the
samples path through `metering.ingest`; both rollups must give the same usage rows and the same
statement lines, to the cent. A live scrape of a local endpoint serving exporter text is
checked too.

Skipped when the binaries are absent, unless TALLY_PROMETHEUS_TESTS=required (.ci/run).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from agent.readings import format_ts
from billing.models import RateCard
from billing.pricing import period_for, usage_lines
from inventory import profiles
from inventory.models import Allocation, Device
from metering import ingest, prometheus, rollup
from metering.hours import epoch_ms, hour_start
from metering.ingest import SampleRow
from metering.models import DirtyHour, MigInstance, Sample, UsageHour
from metering.services import issue_agent_token
from teams.models import Team, TeamNamespace
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "prometheus"
DAY = datetime(2026, 11, 10, tzinfo=UTC)
STEP_MS = 30_000
# Each exporter's scrapes land a little after the step (scrape offsets differ per target).
JITTER_MS = {"dcgm": 250, "amd": 4_100, "intel": 17_900}
# The second H100's exporter is down for a while: those minutes are unmeasured.
OUTAGE = (
    epoch_ms(DAY + timedelta(hours=10, minutes=5)),
    epoch_ms(DAY + timedelta(hours=10, minutes=40)),
)
H100_A = "GPU-5c1e4b7e-3d2a-4a55-9a0e-6f1d2c9b8a01"
H100_B = "GPU-8e2f9d40-71b3-4c0e-b1d7-0a9c3e5f6b02"
A100 = "GPU-a100c0de-0000-4000-8000-000000000a10"
PROM_CLUSTER = "prom-east"
AMD, INTEL = "gpu.amd.com", "gpu.intel.com"
PCI = "resource.kubernetes.io/pciBusID"

pytestmark = pytest.mark.django_db


# --- the recorded day, as OpenMetrics ---------------------------------------------------------

Key = tuple[str, tuple[tuple[str, str], ...]]  # metric name, labels


def recorded() -> list[tuple[str, str, list[dict[str, str]]]]:
    """(exporter, metric, each series' labels) of the recorded scrapes."""
    found = []
    for exporter in ("dcgm", "amd", "intel"):
        text = (FIXTURES / f"{exporter}.prom").read_text()
        for family in text_string_to_metric_families(text):
            found.append((exporter, family.name, [dict(s.labels) for s in family.samples]))
    return found


def value_text(index: int, step: int, metric: str) -> str:
    """The reading of series `index` at step `step`, as the exporter prints it: a percent
    (DCGM_FI_DEV_GPU_UTIL, gpu_gfx_activity) or a ratio (to a tenth of a percent)."""
    k = (index * 7919 + step * 104729 + (step * step) % 97) % 1001
    percent = metric in ("DCGM_FI_DEV_GPU_UTIL", "gpu_gfx_activity")
    return repr(k / 10) if percent else repr(k / 1000)


def day_series() -> dict[Key, list[tuple[int, str]]]:
    """Every recorded series' (ms since the epoch, value text) from half an hour before the day
    to half an hour after it."""
    first = epoch_ms(DAY - timedelta(minutes=30)) // STEP_MS
    last = epoch_ms(DAY + timedelta(hours=24, minutes=30)) // STEP_MS
    series: dict[Key, list[tuple[int, str]]] = {}
    index = 0
    for exporter, metric, labelsets in recorded():
        for labels in labelsets:
            points = []
            for step in range(first, last):
                ts = step * STEP_MS + JITTER_MS[exporter]
                if labels.get("UUID") == H100_B and OUTAGE[0] <= ts < OUTAGE[1]:
                    continue
                points.append((ts, value_text(index, step, metric)))
            # The cluster label a shared engine adds (external labels, relabelling).
            labelled = labels | {"cluster": PROM_CLUSTER}
            series[metric, tuple(sorted(labelled.items()))] = points
            index += 1
    return series


def openmetrics(series: dict[Key, list[tuple[int, str]]]) -> str:
    lines = []
    for metric in dict.fromkeys(name for name, _ in series):
        lines.append(f"# TYPE {metric} gauge")
        for (name, labels), points in series.items():
            if name != metric:
                continue
            text = ",".join(f'{key}="{value}"' for key, value in labels)
            lines.extend(f"{name}{{{text}}} {value} {ts / 1000:.3f}" for ts, value in points)
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


# --- the server -------------------------------------------------------------------------------


def _binaries() -> tuple[str, str]:
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    if os.environ.get("TALLY_PROMETHEUS_TESTS") == "required":
        pytest.fail("TALLY_PROMETHEUS_TESTS=required but prometheus/promtool are not installed")
    pytest.skip("needs Debian's prometheus package (apt-get install prometheus)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(binary: str, data: Path, config: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = _free_port()
    (data / "prometheus.yml").write_text(config)
    process = subprocess.Popen(
        [
            binary,
            f"--storage.tsdb.path={data / 'tsdb'}",
            "--storage.tsdb.retention.time=100y",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--config.file={data / 'prometheus.yml'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(data / "prometheus.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return url, process
        except OSError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"prometheus did not start: {(data / 'prometheus.log').read_text()[-2000:]}")


@pytest.fixture(scope="session")
def day_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus holding the recorded day, backfilled from OpenMetrics; its base URL."""
    server, promtool = _binaries()
    data = tmp_path_factory.mktemp("prometheus-day")
    (data / "day.om").write_text(openmetrics(day_series()))
    subprocess.run(
        [
            promtool,
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            str(data / "day.om"),
            str(data / "tsdb"),
        ],
        check=True,
        capture_output=True,
    )
    url, process = _serve(server, data, "global:\n  scrape_interval: 1h\n")
    yield url
    process.terminate()
    process.wait(timeout=30)


# --- the inventory of the day -----------------------------------------------------------------


@pytest.fixture
def team() -> Team:
    team = Team.objects.create(slug="research", name="Research")
    TeamNamespace.objects.create(team=team, namespace="research")
    return team


def named_device(node: Any, driver: str, name: str, bus: str, product: str) -> Device:
    """An AMD or Intel GPU as their DRA drivers publish it: no uuid, its PCI address."""
    return DeviceFactory.create(
        node=node,
        driver=driver,
        pool=node.name,
        name=name,
        uuid="",
        physical_gpu_key=f"{driver}/{node.name}/{name}",
        meter_id=profiles.meter_id(node.cluster.name, driver, node.name, name),
        attributes={PCI: {"string": bus}},
        product_name=product,
    )


def at(hours: float) -> datetime:
    return DAY + timedelta(seconds=round(hours * 3600, 3))


def the_day(team: Team) -> dict[str, Allocation]:
    """The day's allocations (whole hours and pieces of hours), by what they hold."""
    cluster = ClusterFactory.create(name=PROM_CLUSTER)
    node = {
        name: NodeFactory.create(cluster=cluster, name=name)
        for name in ("gpu-node-1", "gpu-node-2", "mi300x-node-1", "intel-node-1")
    }
    h100_a = DeviceFactory.create(node=node["gpu-node-1"], name="gpu-0", uuid=H100_A)
    h100_b = DeviceFactory.create(node=node["gpu-node-1"], name="gpu-1", uuid=H100_B)
    a100 = DeviceFactory.create(
        node=node["gpu-node-2"], name="gpu-0", uuid=A100, product_name="NVIDIA A100-SXM4-40GB"
    )
    mig = MigDeviceFactory.create(
        parent=a100, name="gpu-0-mig-3g20gb-9-4", profile="3g.20gb", gpu_share=Decimal("0.428571")
    )
    for placement in (0, 1):  # two of one profile: DCGM's series cannot tell them apart
        MigDeviceFactory.create(
            parent=a100, name=f"gpu-0-mig-1g5gb-19-{placement}", profile="1g.5gb"
        )
    mi300x = "AMD_Instinct_MI300X_OAM"
    # Named against address order: the exporter's gpu_id 0 is the lower address, "gpu-b".
    amd_0 = named_device(node["mi300x-node-1"], AMD, "gpu-b", "0000:0c:00.0", mi300x)
    amd_1 = named_device(node["mi300x-node-1"], AMD, "gpu-a", "0000:8c:00.0", mi300x)
    intel = named_device(
        node["intel-node-1"], INTEL, "0000-29-00-0-0x0bd5", "0000:29:00.0", "Intel Max 1550"
    )
    west = NodeFactory.create(cluster=ClusterFactory.create(name="samples-west"), name="w-1")
    sampled = DeviceFactory.create(node=west, name="gpu-0")

    def hold(device: Device, start: float, end: float | None) -> Allocation:
        return AllocationFactory.create(
            device=device,
            team=team,
            start=at(start),
            end=None if end is None else at(end),
            claim__namespace="research",
        )

    for product, price in (
        ("NVIDIA H100 80GB HBM3", "2.49"),
        ("NVIDIA A100-SXM4-40GB", "1.10"),
        (mi300x, "3.20"),
        ("Intel Max 1550", "1.75"),
    ):
        RateCard.objects.create(
            product_name=product,
            per_gpu_hour=Decimal(price),
            idle_factor=Decimal("0.35"),
            currency="USD",
            valid_from=date(2026, 1, 1),
        )
    return {
        "h100-a": hold(h100_a, 0, 24),
        "h100-b": hold(h100_b, 3 + 20 / 60 + 10 / 3600, 17.758333),
        "mig": hold(mig, 6.5, None),
        "amd-0": hold(amd_0, 0, 12),
        "amd-1": hold(amd_1, 8.5, 20.25),
        "intel": hold(intel, 1.25, 23.9999),
        "sampled": hold(sampled, 2, 22),
    }


def percent(text: str, scale: float) -> float:
    """A reading as the node agent sends it (`agent.exporters._percent`)."""
    return round(min(100.0, max(0.0, float(text) * scale)), 2)


def feed_samples(allocations: dict[str, Allocation]) -> None:
    """The readings the Prometheus source prefers for each device, sent as samples; the device
    of the samples cluster gets the first H100's."""
    series = day_series()

    def find(metric: str, **labels: str) -> list[tuple[int, str]]:
        (points,) = [
            points
            for (name, found), points in series.items()
            if name == metric and labels.items() <= dict(found).items()
        ]
        return points

    chosen = {
        "h100-a": (find("DCGM_FI_PROF_GR_ENGINE_ACTIVE", UUID=H100_A), 100.0),
        "h100-b": (find("DCGM_FI_DEV_GPU_UTIL", UUID=H100_B), 1.0),
        "mig": (find("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_I_PROFILE="3g.20gb"), 100.0),
        "amd-0": (find("gpu_gfx_activity", gpu_id="0"), 1.0),
        "amd-1": (find("gpu_gfx_activity", gpu_id="1"), 1.0),
        "intel": (device_level_intel(series), 100.0),
        "sampled": (find("DCGM_FI_DEV_GPU_UTIL", UUID=H100_A), 1.0),
    }  # fmt: skip
    for name, (points, scale) in chosen.items():
        rows = [
            SampleRow(allocations[name].meter_id, ts, percent(text, scale), None, None)
            for ts, text in points
        ]
        ingest.ingest(node="backfill", samples=rows, received_at=DAY + timedelta(days=2))


def device_level_intel(series: dict[Key, list[tuple[int, str]]]) -> list[tuple[int, str]]:
    """Intel's device-level compute series (not a tile's: `sub_dev` marks those)."""
    (points,) = [
        points
        for (name, labels), points in series.items()
        if name == "xpum_engine_group_ratio"
        and ("type", "compute") in labels
        and "sub_dev" not in dict(labels)
    ]
    return points


def roll_up_day() -> None:
    rollup.rollup_hours(hours=[at(n) for n in range(24)], now=DAY + timedelta(days=2))


def usage_rows() -> list[tuple[Any, ...]]:
    return list(
        UsageHour.objects.order_by("allocation_id", "hour").values_list(
            "allocation_id", "hour", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
        )
    )


def statement_lines(team: Team) -> list[tuple[Any, ...]]:
    return sorted(
        (
            line.product_name,
            line.profile,
            line.allocated,
            line.utilised,
            line.unmeasured,
            line.amount,
        )
        for line in usage_lines(team=team, period=period_for(DAY))
    )


def prometheus_settings(url: str, **more: Any) -> Any:
    return override_settings(
        TALLY_METERING_SOURCE=f"samples,{PROM_CLUSTER}=prometheus",
        TALLY_PROMETHEUS_URL=url,
        **more,
    )


def metered_by_engine(allocations: dict[str, Allocation]) -> list[str]:
    return [allocation.meter_id for name, allocation in allocations.items() if name != "sampled"]


def billed_clusters(hour: datetime) -> set[str]:
    """The clusters with usage rows in `hour`."""
    return set(UsageHour.objects.filter(hour=hour).values_list("cluster__name", flat=True))


# --- the day, both ways -----------------------------------------------------------------------


def test_a_day_from_prometheus_bills_to_the_cent_as_from_the_same_samples(
    day_engine: str, team: Team
) -> None:
    allocations = the_day(team)
    feed_samples(allocations)
    roll_up_day()
    from_samples, lines_from_samples = usage_rows(), statement_lines(team)
    # Every device measured, the outage unmeasured, the MIG device counted at its share.
    by_allocation = {
        name: [row for row in from_samples if row[0] == allocation.pk]
        for name, allocation in allocations.items()
    }
    assert all(sum(row[3] for row in rows) > 0 for rows in by_allocation.values())
    outage = sum(row[4] for row in by_allocation["h100-b"])
    # 10:05-10:40 without readings: the last before it (10:04:30.25) holds 2 minutes.
    assert outage == (33 * 60 + 30) * 1000

    # The engine's readings alone for its cluster: the samples of its devices are gone.
    Sample.objects.filter(device_uuid__in=metered_by_engine(allocations)).delete()
    with prometheus_settings(day_engine):
        roll_up_day()
    assert usage_rows() == from_samples
    assert statement_lines(team) == lines_from_samples
    assert sum(line[-1] for line in lines_from_samples) > Decimal("100")

    # Rerunning changes nothing.
    with prometheus_settings(day_engine):
        roll_up_day()
    assert usage_rows() == from_samples


def test_step_means_bill_the_same_hours_and_nearly_the_same_utilisation(
    day_engine: str, team: Team
) -> None:
    allocations = the_day(team)
    feed_samples(allocations)
    roll_up_day()
    exact = {row[:2]: row[2:] for row in usage_rows()}
    with prometheus_settings(day_engine, TALLY_PROMETHEUS_STEP_SECONDS=60):
        roll_up_day()
    means = {row[:2]: row[2:] for row in usage_rows()}
    assert means.keys() == exact.keys()
    for key, (allocated, utilised, unmeasured) in exact.items():
        assert means[key][0] == allocated
        # A mean per minute stands for the minute: it may shift a reading's worth across an
        # hour's edge and the outage's, never more.
        assert abs(means[key][1] - utilised) <= 60_000 + allocated // 50
        assert abs(means[key][2] - unmeasured) <= 2 * 60_000


def test_an_engine_that_does_not_answer_leaves_the_hour_pending_never_idle(
    day_engine: str, team: Team
) -> None:
    allocations = the_day(team)
    hour = at(4)
    closed_port = f"http://127.0.0.1:{_free_port()}"
    with prometheus_settings(closed_port):
        assert rollup.rollup_pending(now=hour + timedelta(hours=1, minutes=10), limit=1) == []
    # Only the cluster that sends samples is billed; the engine's stays to be rolled up.
    assert billed_clusters(hour) == {"samples-west"}
    assert DirtyHour.objects.filter(hour=hour).exists()
    # A query the engine refuses (a bad matcher in the settings) is no answer either.
    bad = {"dcgm": 'DCGM_FI_DEV_GPU_UTIL{UUID=~"("}', "amd": "a", "intel": "b"}
    with (
        prometheus_settings(day_engine, TALLY_PROMETHEUS_EXPORTER_METRICS=bad),
        pytest.raises(prometheus.EngineUnavailable, match="bad_data") as refused,
    ):
        rollup.rollup_hours(hours=[hour], now=hour + timedelta(days=1))
    assert (refused.value.hours, refused.value.clusters) == ([hour], {PROM_CLUSTER})
    assert billed_clusters(hour) == {"samples-west"}
    # Back: the marked hour is rolled up, measured.
    with prometheus_settings(day_engine):
        done = rollup.rollup_pending(now=hour + timedelta(hours=1, minutes=10), limit=5)
    assert hour in done
    assert not DirtyHour.objects.filter(hour=hour).exists()
    row = UsageHour.objects.get(hour=hour, allocation=allocations["h100-a"])
    assert row.unmeasured_gpu_ms == 0 and row.utilised_gpu_ms > 0
    # Rows already written are kept when the engine fails on a rerun.
    with prometheus_settings(closed_port), pytest.raises(prometheus.EngineUnavailable):
        rollup.rollup_hours(hours=[hour], now=hour + timedelta(days=1))
    assert UsageHour.objects.get(hour=hour, allocation=allocations["h100-a"]) == row


def test_run_billing_says_the_engine_did_not_answer_and_leaves_the_hours_marked(
    team: Team,
) -> None:
    the_day(team)
    hour = at(4)
    label = period_for(hour).label
    closed_port = f"http://127.0.0.1:{_free_port()}"
    with prometheus_settings(closed_port), pytest.raises(CommandError) as failed:
        call_command("run_billing", "--period", label, stdout=StringIO())
    assert str(failed.value).startswith("the metrics engine did not answer")
    assert "run again when it answers" in str(failed.value)
    # Nothing of the engine's devices billed as idle: its hours stay to be rolled up.
    assert DirtyHour.objects.filter(hour=hour).exists()


def test_series_are_matched_by_the_inventorys_identities(day_engine: str, team: Team) -> None:
    allocations = the_day(team)
    start, end = epoch_ms(at(9)), epoch_ms(at(10))
    held = Allocation.objects.filter(pk__in=[a.pk for a in allocations.values()])
    with prometheus_settings(day_engine):
        readings = prometheus.window_readings(held=held, start_ms=start, end_ms=end)
    assert readings is not None and readings.mixed  # the samples cluster's device
    engine_ids = set(metered_by_engine(allocations))
    assert readings.metered == engine_ids
    # Held in that hour: all but the MIG device's... which is held from 6:30 too.
    assert set(readings.points) == engine_ids
    # AMD gpu_id 0 is the lower PCI address, whatever the devices' names.
    series = day_series()
    amd_zero = next(
        points
        for (name, labels), points in series.items()
        if name == "gpu_gfx_activity" and ("gpu_id", "0") in labels
    )
    first = next((ts, percent(text, 1)) for ts, text in amd_zero if ts >= start - 120_000)
    assert readings.points[allocations["amd-0"].meter_id][0] == first
    # The 1g.5gb instances share a profile on one GPU: not billed by guess, reported.
    assert any("1g.5gb" in why and "2 MIG devices" in why for why in readings.unmatched)


def test_a_selector_naming_the_cluster_scopes_every_query(day_engine: str, team: Team) -> None:
    allocations = the_day(team)
    held = Allocation.objects.filter(pk__in=[a.pk for a in allocations.values()])
    window: dict[str, Any] = {"start_ms": epoch_ms(at(9)), "end_ms": epoch_ms(at(10))}
    with prometheus_settings(day_engine):
        everything = prometheus.window_readings(held=held, **window)
    with prometheus_settings(day_engine, TALLY_PROMETHEUS_SELECTOR='cluster="{cluster}"'):
        scoped = prometheus.window_readings(held=held, **window)
    with prometheus_settings(day_engine, TALLY_PROMETHEUS_SELECTOR='cluster="gpu-west"'):
        elsewhere = prometheus.window_readings(held=held, **window)
    assert everything is not None and scoped is not None and elsewhere is not None
    assert scoped.points == everything.points and len(everything.points) == 6
    assert elsewhere.points == {}


# --- an engine per cluster --------------------------------------------------------------------


def engines_settings(urls: str, default: str = "") -> Any:
    """Both clusters of the day metered by engines: `urls` names each one's."""
    return override_settings(
        TALLY_METERING_SOURCE=f"samples,{PROM_CLUSTER}=prometheus,samples-west=prometheus",
        TALLY_PROMETHEUS_URL=default,
        TALLY_PROMETHEUS_URLS=urls,
    )


def usage(allocation: Allocation, hour: datetime) -> tuple[int, int, int]:
    row = UsageHour.objects.get(allocation=allocation, hour=hour)
    return row.allocated_gpu_ms, row.utilised_gpu_ms, row.unmeasured_gpu_ms


def test_each_cluster_is_metered_by_its_own_engine(
    day_engine: str, team: Team, tmp_path: Path
) -> None:
    allocations = the_day(team)
    hour = at(4)
    # A second engine, empty: a cluster asked there has no readings (its hours unmeasured).
    empty, process = _serve(_binaries()[0], tmp_path, "global:\n  scrape_interval: 1h\n")
    try:
        with engines_settings(f"{PROM_CLUSTER}={day_engine}", default=empty):
            rollup.rollup_hours(hours=[hour], now=DAY + timedelta(days=2))
        east, west = usage(allocations["h100-a"], hour), usage(allocations["sampled"], hour)
        assert east[1] > 0 and east[2] == 0  # asked at the day's engine: measured
        assert west == (3_600_000, 0, 3_600_000)  # asked at the empty one
        # The other way round: the day's cluster asked at the empty engine.
        with engines_settings(f"{PROM_CLUSTER}={empty},samples-west={day_engine}"):
            rollup.rollup_hours(hours=[hour], now=DAY + timedelta(days=2))
        assert usage(allocations["h100-a"], hour) == (3_600_000, 0, 3_600_000)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_an_engine_down_holds_back_only_its_clusters_hours(day_engine: str, team: Team) -> None:
    allocations = the_day(team)
    hour = at(4)
    with prometheus_settings(day_engine):
        rollup.rollup_hours(hours=[hour], now=DAY + timedelta(days=2))
    rows = {name: usage(allocation, hour) for name, allocation in allocations.items()
            if allocation.start <= hour}  # fmt: skip
    # The day's cluster's rows gone, the other's marked, to see which the next run writes.
    UsageHour.objects.filter(hour=hour, cluster__name=PROM_CLUSTER).delete()
    UsageHour.objects.filter(allocation=allocations["sampled"]).update(utilised_gpu_ms=12345)
    down = f"http://127.0.0.1:{_free_port()}"
    with engines_settings(f"{PROM_CLUSTER}={day_engine}, samples-west={down}"):
        assert rollup.rollup_pending(now=hour + timedelta(hours=1, minutes=10), limit=1) == []
        with pytest.raises(prometheus.EngineUnavailable, match="cluster samples-west: ") as error:
            rollup.rollup_hours(hours=[hour], now=DAY + timedelta(days=2))
    assert (error.value.hours, error.value.clusters) == ([hour], {"samples-west"})
    assert down in str(error.value) and day_engine not in str(error.value)
    # The engine that answered: its cluster billed. The one down: its row as it was, its hour
    # marked to be rolled up again, never billed as idle.
    assert {name: usage(allocations[name], hour) for name in rows if name != "sampled"} == {
        name: row for name, row in rows.items() if name != "sampled"
    }
    assert usage(allocations["sampled"], hour)[1] == 12345
    assert DirtyHour.objects.filter(hour=hour).exists()
    # Back: the marked hour is done, every cluster's row written again. The day's engine has
    # no series of samples-west's device: a silence (`metering.silence`), believed only once
    # the grace has passed.
    with engines_settings(f"{PROM_CLUSTER}={day_engine}, samples-west={day_engine}"):
        assert hour in rollup.rollup_pending(now=hour + timedelta(hours=7), limit=10)
    assert usage(allocations["sampled"], hour) == rows["sampled"]
    assert not DirtyHour.objects.filter(hour=hour).exists()


def test_means_of_a_cluster_that_sends_samples_hold_their_covered_time_beside_an_engine(
    day_engine: str, team: Team
) -> None:
    allocations = the_day(team)
    hour = at(4)
    sampled = allocations["sampled"]
    # Minute means of the samples cluster's device, each of readings over 45 s.
    Sample.objects.bulk_create(
        Sample(
            device_uuid=sampled.meter_id,
            ts_ms=epoch_ms(hour) + minute * 60_000,
            gpu_util=40.0,
            gap_ms=60_000 if minute < 59 else None,
            covered_ms=45_000,
            received_at=hour,
        )
        for minute in range(60)
    )
    # Read beside the engine's readings (one table for the rollup), and alone: the same row.
    with prometheus_settings(day_engine):
        rollup.rollup_hours(hours=[hour], now=DAY + timedelta(days=2))
    assert usage(sampled, hour) == (3_600_000, 60 * 45_000 * 40 // 100, 60 * 15_000)
    assert usage(allocations["h100-a"], hour)[1] > 0
    with override_settings(TALLY_METERING_SOURCE="samples"):
        rollup.rollup_hours(hours=[hour], now=DAY + timedelta(days=2))
    assert usage(sampled, hour) == (3_600_000, 60 * 45_000 * 40 // 100, 60 * 15_000)


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"TALLY_METERING_SOURCE": "promql"}, "TALLY_METERING_SOURCE: 'promql' is not a source"),
        ({"TALLY_METERING_SOURCE": "prometheus,samples"}, "give one default source"),
        (
            {"TALLY_METERING_SOURCE": "prometheus", "TALLY_PROMETHEUS_URL": ""},
            "TALLY_PROMETHEUS_URL",
        ),
        (
            {"TALLY_PROMETHEUS_STEP_SECONDS": 300, "TALLY_SAMPLE_HOLD_SECONDS": 120},
            "TALLY_PROMETHEUS_STEP_SECONDS=300 is longer than TALLY_SAMPLE_HOLD_SECONDS=120",
        ),
        ({"TALLY_PROMETHEUS_EXPORTERS": ["dcgm", "habana"]}, "'habana' is not one of"),
        ({"TALLY_PROMETHEUS_SELECTOR": '{cluster="a"}'}, "TALLY_PROMETHEUS_SELECTOR"),
        (
            {"TALLY_PROMETHEUS_HEADERS": "Bearer abc"},
            "TALLY_PROMETHEUS_HEADERS: each line is `Name: value`",
        ),
        (
            {"TALLY_PROMETHEUS_EXPORTER_METRICS": {"dcgm": "UTIL*x", "amd": "a", "intel": "b"}},
            "TALLY_PROMETHEUS_DCGM_METRICS: 'UTIL*x' is not a metric",
        ),
        (
            {"TALLY_PROMETHEUS_EXPORTER_LABELS": {"dcgm": "", "amd": "", "intel": "bus=pci_bdf"}},
            "TALLY_PROMETHEUS_INTEL_LABELS: 'bus=pci_bdf' is not role=label",
        ),
        (
            {"TALLY_METERING_SOURCE": "prometheus", "TALLY_PROMETHEUS_URLS": "gpu-east"},
            "TALLY_PROMETHEUS_URLS: 'gpu-east' is not cluster=URL",
        ),
        (
            {"TALLY_METERING_SOURCE": "prometheus",
             "TALLY_PROMETHEUS_URLS": "gpu-east=http://a:9090, gpu-west=prom-west:9090"},
            "TALLY_PROMETHEUS_URLS: gpu-west='prom-west:9090' is not a base URL",
        ),
        (
            {"TALLY_METERING_SOURCE": "prometheus",
             "TALLY_PROMETHEUS_URLS": "gpu-east=http://a:9090,gpu-east=http://b:9090"},
            "TALLY_PROMETHEUS_URLS: cluster 'gpu-east' given twice",
        ),
        (
            {"TALLY_METERING_SOURCE": "samples,gpu-east=prometheus",
             "TALLY_PROMETHEUS_URLS": "gpu-east=http://a:9090,gpu-wets=http://b:9090"},
            "TALLY_PROMETHEUS_URLS: cluster 'gpu-wets' is not metered by prometheus",
        ),
        (
            {"TALLY_METERING_SOURCE": "samples,gpu-east=prometheus,gpu-west=prometheus",
             "TALLY_PROMETHEUS_URL": "", "TALLY_PROMETHEUS_URLS": "gpu-east=http://a:9090"},
            "TALLY_PROMETHEUS_URL: set it to the engine's base URL (http://... or https://...) "
            "when TALLY_METERING_SOURCE names prometheus: it meters cluster(s) gpu-west, which "
            "TALLY_PROMETHEUS_URLS does not name",
        ),
        (
            {"TALLY_METERING_SOURCE": "prometheus", "TALLY_PROMETHEUS_URL": "",
             "TALLY_PROMETHEUS_URLS": "gpu-east=http://a:9090"},
            "it meters every cluster TALLY_PROMETHEUS_URLS does not name",
        ),
    ],
)  # fmt: skip
def test_a_bad_setting_is_named(changes: dict[str, Any], message: str) -> None:
    base = {"TALLY_METERING_SOURCE": "samples", "TALLY_PROMETHEUS_URL": "http://prom:9090"}
    with override_settings(**(base | changes)):
        with pytest.raises(ImproperlyConfigured) as error:
            prometheus.config()
        assert message in str(error.value)
        assert [check.id for check in prometheus.check_settings()] == ["billing.E101"]


def test_each_cluster_named_is_asked_at_its_own_url_the_others_at_the_single_one() -> None:
    with override_settings(
        TALLY_METERING_SOURCE="samples,gpu-east=prometheus,gpu-west=prometheus,gpu-north=prometheus",
        TALLY_PROMETHEUS_URL="http://thanos-query:9090/",
        TALLY_PROMETHEUS_URLS=" gpu-east = https://prom.east:9090/ , gpu-west=http://prom-west ",
    ):
        conf = prometheus.config()
        assert prometheus.check_settings() == []
    assert [conf.url_for(name) for name in ("gpu-east", "gpu-west", "gpu-north")] == [
        "https://prom.east:9090",
        "http://prom-west",
        "http://thanos-query:9090",
    ]
    # Every cluster metered by prometheus named: no single URL needed.
    with override_settings(
        TALLY_METERING_SOURCE="samples,gpu-east=prometheus",
        TALLY_PROMETHEUS_URL="",
        TALLY_PROMETHEUS_URLS="gpu-east=http://prom-east:9090",
    ):
        assert prometheus.config().url_for("gpu-east") == "http://prom-east:9090"


def test_the_default_settings_read_every_exporter() -> None:
    conf = prometheus.config()
    assert conf.default_source == "samples" and not conf.used
    # Gaudi's and TPU's too (issue 36): left out, their hours were unmeasured with no word.
    dcgm, amd, intel, gaudi, tpu = conf.exporters
    assert (gaudi.name, tpu.name) == ("gaudi", "tpu")
    assert [(m.selector, m.scale) for m in dcgm.metrics] == [
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 100.0),
        ("DCGM_FI_DEV_GPU_UTIL", 1.0),
    ]
    assert intel.metrics[0].selector == 'xpum_engine_group_ratio{type="compute"}'
    assert intel.skip == ("sub_dev", "card")
    assert amd.labels["serial"] == "serial_number"
    assert prometheus.parse_sources(" samples , gpu-east = prometheus ") == (
        "samples",
        {"gpu-east": "prometheus"},
    )


# --- a live scrape ----------------------------------------------------------------------------


class _Exporter(http.server.BaseHTTPRequestHandler):
    body = (FIXTURES / "dcgm.prom").read_bytes()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: Any) -> None:
        pass


def test_a_live_scrape_of_an_exporter_is_metered(tmp_path: Path, team: Team) -> None:
    server_binary, _ = _binaries()
    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    config = (
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        "  - job_name: dcgm\n    honor_labels: true\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{exporter.server_address[1]}']\n"
    )
    url, process = _serve(server_binary, tmp_path, config)
    try:
        cluster = ClusterFactory.create(name=PROM_CLUSTER)
        node = NodeFactory.create(cluster=cluster, name="gpu-node-1")
        device = DeviceFactory.create(node=node, name="gpu-1", uuid=H100_B)
        started = timezone.now()
        allocation = AllocationFactory.create(
            device=device, team=team, start=started, claim__namespace="research"
        )
        deadline = time.monotonic() + 30
        with prometheus_settings(url):
            while True:
                time.sleep(1)
                now = timezone.now()
                readings = prometheus.window_readings(
                    held=Allocation.objects.filter(pk=allocation.pk),
                    start_ms=epoch_ms(started),
                    end_ms=epoch_ms(now),
                )
                assert readings is not None
                points = readings.points.get(H100_B, [])
                if len(points) >= 3 or time.monotonic() > deadline:
                    break
            assert len(points) >= 3
            assert {value for _, value in points} == {81.0}  # DCGM_FI_DEV_GPU_UTIL as scraped
            # Every hour from the start to now: the scrapes may fall in the next hour (a start
            # in the last second of one), each hour its own row.
            hours = [hour_start(started)]
            while hours[-1] < hour_start(now):
                hours.append(hours[-1] + timedelta(hours=1))
            rollup.rollup_hours(hours=hours, now=now)
        rows = list(UsageHour.objects.filter(allocation=allocation).order_by("hour"))
        assert rows and {row.hour for row in rows} <= set(hours)
        assert sum(row.utilised_gpu_ms for row in rows) > 0
        for row in rows:
            assert row.utilised_gpu_ms == pytest.approx(
                0.81 * (row.allocated_gpu_ms - row.unmeasured_gpu_ms), abs=2
            ), row.hour
    finally:
        process.terminate()
        process.wait(timeout=30)
        exporter.shutdown()


# --- matching without an engine ---------------------------------------------------------------


def test_amd_partitions_are_named_by_their_gpus_address_even_with_a_gpu_missing(
    team: Team,
) -> None:
    """Two MI300X in CPX mode (8 partitions each, gpu_id 0-15 in address order): only the
    second GPU reports in the window, and its partitions are still the second address's."""
    node = NodeFactory.create(name="mi300x-node-2")
    for bus in ("0000:0c:00.0", "0000:8c:00.0"):
        for partition in range(8):
            device = named_device(
                node, AMD, f"gpu-{bus[5:7]}-{partition}", bus, "AMD_Instinct_MI300X_OAM"
            )
            Device.objects.filter(pk=device.pk).update(kind="partition")
    exporter = prometheus.config().exporters[1]
    series = [
        prometheus.Series(
            labels={
                "gpu_id": str(8 + partition),
                "serial_number": "692251001087",
                "hostname": "mi300x-node-2",
                "gpu_partition_id": str(partition),
                "gpu_compute_partition_type": "cpx",
            },
            points=[(0, 50.0)],
        )
        for partition in (0, 3, 7)
    ]
    meters, why = prometheus.match_series(exporter, series, prometheus.Identities(), 0)
    expected = [
        profiles.meter_id(node.cluster.name, AMD, node.name, f"gpu-8c-{partition}")
        for partition in (0, 3, 7)
    ]
    assert (meters, why) == (expected, [])


def test_amd_gpus_publishing_only_pciaddr_are_matched_by_it(team: Team) -> None:
    """AMD's auto-partition and vfio devices publish the GPU's address as `pciAddr` only: the
    engine's series are matched to them as the ingest matches an agent's samples."""
    node = NodeFactory.create(name="mi300x-node-3")
    devices = [
        named_device(node, AMD, f"gpu-{index}-spx-nps1", bus, "AMD_Instinct_MI300X_OAM")
        for index, bus in enumerate(("0000:0c:00.0", "0000:8c:00.0"))
    ]
    for device in devices:
        bus = device.attributes[PCI]
        Device.objects.filter(pk=device.pk).update(attributes={"pciAddr": bus})
    exporter = prometheus.config().exporters[1]
    series = [
        prometheus.Series(
            labels={"gpu_id": str(gpu), "serial_number": f"69225100108{gpu}",
                    "hostname": node.name, "gpu_compute_partition_type": "spx"},
            points=[(0, 50.0)],
        )
        for gpu in (0, 1)
    ]  # fmt: skip
    meters, why = prometheus.match_series(exporter, series, prometheus.Identities(), 0)
    assert (meters, why) == ([device.meter_id for device in devices], [])


def test_meter_prometheus_reports_what_the_engine_gives(day_engine: str, team: Team) -> None:
    allocations = the_day(team)
    out = StringIO()
    with prometheus_settings(day_engine):
        call_command("meter_prometheus", "--hour", "2026-11-10T09:30Z", stdout=out)
    text = out.getvalue()
    assert f"asked at {day_engine}" in text
    # 30 s readings from a hold before the hour: 124 for the DCGM devices.
    assert f"{allocations['h100-a'].meter_id}: 124 readings" in text
    assert allocations["sampled"].meter_id not in text  # its cluster sends samples
    assert "not matched: MIG 1g.5gb (GPU instance 9) of GPU-a100c0de" in text
    with (
        prometheus_settings(f"http://127.0.0.1:{_free_port()}"),
        pytest.raises(CommandError, match="the engine did not answer"),
    ):
        call_command("meter_prometheus", "--hour", "2026-11-10T09:30Z")
    with (
        override_settings(TALLY_METERING_SOURCE="prometheus", TALLY_PROMETHEUS_URL=""),
        pytest.raises(CommandError, match="TALLY_PROMETHEUS_URL"),
    ):
        call_command("meter_prometheus")
    # An hour past the calendar Tally counts in is named, not a traceback (issue 40, 5).
    with prometheus_settings(day_engine), pytest.raises(CommandError, match=r"--hour: .*range"):
        call_command("meter_prometheus", "--hour", "9999-12-31T23:00Z")


class _PartialEngine(http.server.BaseHTTPRequestHandler):
    """An engine (a Thanos querier with a store down) that answers in part, with a warning;
    it keeps the headers it was sent."""

    headers_seen: list[dict[str, str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        body = (
            b'{"status":"success","warnings":["store 10.0.0.7:10901 unavailable"],'
            b'"data":{"resultType":"matrix","result":[]}}'
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_a_partial_answer_leaves_the_hour_pending_and_headers_are_sent(team: Team) -> None:
    allocations = the_day(team)
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PartialEngine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    hour = at(4)
    try:
        with prometheus_settings(
            f"http://127.0.0.1:{engine.server_address[1]}",
            TALLY_PROMETHEUS_HEADERS="Authorization: Bearer s3cret\nX-Scope-OrgID: gpu-east",
        ):
            assert rollup.rollup_pending(now=hour + timedelta(hours=1, minutes=10)) == []
    finally:
        engine.shutdown()
    assert DirtyHour.objects.filter(hour=hour).exists()
    assert billed_clusters(hour) == {"samples-west"}
    assert UsageHour.objects.filter(allocation=allocations["sampled"]).exists()
    sent = _PartialEngine.headers_seen[0]
    assert (sent["authorization"], sent["x-scope-orgid"]) == ("Bearer s3cret", "gpu-east")


def test_an_engine_that_does_not_answer_is_asked_once_a_window_one_in_part_per_cluster(
    team: Team,
) -> None:
    allocations = the_day(team)
    held = Allocation.objects.filter(pk__in=[a.pk for a in allocations.values()])
    window: dict[str, Any] = {"start_ms": epoch_ms(at(4)), "end_ms": epoch_ms(at(5))}
    one_question_per_cluster = {
        "TALLY_METERING_SOURCE": f"samples,{PROM_CLUSTER}=prometheus,samples-west=prometheus",
        "TALLY_PROMETHEUS_SELECTOR": 'cluster="{cluster}"',
    }
    closed_port = f"http://127.0.0.1:{_free_port()}"
    with (
        override_settings(TALLY_PROMETHEUS_URL=closed_port, **one_question_per_cluster),
        pytest.raises(prometheus.EngineUnavailable) as refused,
    ):
        prometheus.window_readings(held=held, **window)
    # Refused once: the second cluster's question was not sent to wait on it again.
    assert str(refused.value).startswith(f"cluster {PROM_CLUSTER}, samples-west: {closed_port}: ")
    assert refused.value.clusters == {PROM_CLUSTER, "samples-west"}
    assert refused.value.answered is not None and refused.value.answered.points == {}
    # An engine that answers in part (a store down) may hold one cluster's data and not the
    # other's: each cluster's question is asked.
    _PartialEngine.headers_seen.clear()
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PartialEngine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        with (
            override_settings(
                TALLY_PROMETHEUS_URL=f"http://127.0.0.1:{engine.server_address[1]}",
                **one_question_per_cluster,
            ),
            pytest.raises(prometheus.EngineUnavailable, match="a partial answer") as partial,
        ):
            prometheus.window_readings(held=held, **window)
    finally:
        engine.shutdown()
    assert len(_PartialEngine.headers_seen) == 2
    assert partial.value.clusters == {PROM_CLUSTER, "samples-west"}


# --- MIG devices by GPU instance id -----------------------------------------------------------


def gi_series(instance: str) -> list[tuple[int, str]]:
    """The recorded day's DCGM_FI_PROF_GR_ENGINE_ACTIVE readings of the A100's GPU instance
    `instance` (9 and 10: its two 1g.5gb MIG devices)."""
    (points,) = [
        points
        for (name, labels), points in day_series().items()
        if name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE" and ("GPU_I_ID", instance) in labels
    ]
    return points


def two_slices(team: Team, *, held: tuple[tuple[float, float], tuple[float, float]]) -> list[Any]:
    """The A100 of gpu-node-2 with its two 1g.5gb MIG devices, each held for a span of hours,
    and the node's agent token."""
    cluster = ClusterFactory.create(name=PROM_CLUSTER)
    node = NodeFactory.create(cluster=cluster, name="gpu-node-2")
    a100 = DeviceFactory.create(
        node=node, name="gpu-0", uuid=A100, product_name="NVIDIA A100-SXM4-40GB"
    )
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-40GB",
        per_gpu_hour=Decimal("1.10"),
        idle_factor=Decimal("0.35"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    slices = []
    for placement, (start, end) in zip((0, 1), held, strict=True):
        mig = MigDeviceFactory.create(
            parent=a100, name=f"gpu-0-mig-1g5gb-19-{placement}", profile="1g.5gb"
        )
        AllocationFactory.create(
            device=mig, team=team, start=at(start), end=at(end), claim__namespace="research"
        )
        slices.append(mig)
    token = issue_agent_token(cluster=cluster, node="gpu-node-2", actor="ops")
    return [*slices, token]


def send(token: str, readings: list[tuple[Device, str, int, str]]) -> None:
    """The node agent's samples of MIG devices: (device, GPU instance id, instant, ratio)."""
    samples = [
        {
            "uuid": device.meter_id,
            "ts": format_ts(datetime.fromtimestamp(ts / 1000, UTC)),
            "gpu_util": percent(text, 100.0),
            "parent_uuid": A100,
            "gpu_instance_id": int(instance),
        }
        for device, instance, ts, text in readings
    ]
    for chunk in range(0, len(samples), 2_000):
        response = Client().post(
            "/ingest/samples",
            data=json.dumps({"node": "gpu-node-2", "samples": samples[chunk : chunk + 2_000]}),
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 200 and response.json()["rejected"] == []


def held_by(device: Device) -> int:
    """The id of the allocation of `device`."""
    return Allocation.objects.get(device=device).pk


def both_ways(day_engine: str, slices: list[Device]) -> tuple[list[Any], list[Any]]:
    """The day's usage rows from the agent's samples, then from the engine's series alone."""
    roll_up_day()
    from_samples = usage_rows()
    Sample.objects.filter(device_uuid__in=[mig.meter_id for mig in slices]).delete()
    with prometheus_settings(day_engine):
        roll_up_day()
    return from_samples, usage_rows()


def test_two_slices_of_one_profile_are_metered_by_their_gpu_instance_ids(
    day_engine: str, team: Team
) -> None:
    first, second, token = two_slices(team, held=((0, 24), (2.25, 23.5)))
    send(
        token,
        [(first, "9", ts, text) for ts, text in gi_series("9")]
        + [(second, "10", ts, text) for ts, text in gi_series("10")],
    )
    assert sorted(MigInstance.objects.values_list("gpu_instance_id", "meter_id")) == [
        (9, first.meter_id),
        (10, second.meter_id),
    ]
    from_samples, from_engine = both_ways(day_engine, [first, second])
    assert from_engine == from_samples  # to the millisecond, every hour of both
    assert len(from_engine) == 24 + 22
    assert all(row[3] > 0 and row[4] == 0 for row in from_engine)
    # The two slices' readings differ: each went to its own device.
    utilised = {
        allocation: sum(row[3] for row in from_engine if row[0] == allocation)
        for allocation in {row[0] for row in from_engine}
    }
    assert len(set(utilised.values())) == 2


def test_a_gpu_instance_id_reused_after_a_reconfiguration_maps_by_time(
    day_engine: str, team: Team
) -> None:
    # GPU instance 9 is the slice at placement 0 until noon; the GPU is reconfigured and
    # instance 9 is then the slice at placement 1. One DCGM series throughout.
    before, after, token = two_slices(team, held=((0, 12), (12, 24)))
    noon = epoch_ms(at(12))
    readings = gi_series("9")
    send(
        token,
        [(after if ts >= noon else before, "9", ts, text) for ts, text in reversed(readings)],
    )
    from_samples, from_engine = both_ways(day_engine, [before, after])
    assert from_engine == from_samples
    # Each hour billed to the slice the instance was then, measured throughout.
    assert [row[:2] for row in from_engine] == [
        (held_by(before), at(hour)) for hour in range(12)
    ] + [(held_by(after), at(hour)) for hour in range(12, 24)]
    assert all(row[3] > 0 for row in from_engine)
    # Unmeasured only from noon until the later slice's first reading, 250 ms after it (GPU
    # time: at the slice's share).
    unmeasured = round(JITTER_MS["dcgm"] * after.gpu_share)
    assert [row[4] for row in from_engine] == [0] * 12 + [unmeasured] + [0] * 11


def test_a_reading_goes_to_the_device_its_gpu_instance_was_at_its_instant() -> None:
    hold = 120_000
    # Instance 1 was "a" over [0, 100 s], then "b" over [200 s, 300 s], then "a" again from
    # 400 s: "a"'s record spans both its times.
    meters = prometheus.InstanceMeters(
        spans=[(0, 500_000, "a"), (200_000, 300_000, "b")], fallback="by-profile", hold_ms=hold
    )
    assert [meters.meter_at(ts) for ts in (0, 150_000, 200_000, 300_000 + hold)] == [
        "a",
        "a",
        "b",
        "b",
    ]
    assert meters.meter_at(300_001 + hold) == "a"  # "b" long gone: "a" again
    # Outside every spell of an instance an agent reports: no device, as the ingest has it.
    assert meters.meter_at(500_000 + hold + 1) is None
    assert meters.meter_at(-1) is None
    # An instance no agent reports (no spells): the device its profile names.
    unseen = prometheus.InstanceMeters(spans=[], fallback="by-profile", hold_ms=hold)
    assert unseen.meter_at(0) == "by-profile"
    # Two devices first seen at one instant under one instance id: neither is guessed.
    tied = prometheus.InstanceMeters(
        spans=[(0, 10, "a"), (0, 10, "b")], fallback="by-profile", hold_ms=hold
    )
    assert tied.meter_at(5) is None
