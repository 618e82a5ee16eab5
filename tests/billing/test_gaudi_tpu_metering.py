"""A day of Gaudi and of TPU utilisation reaches a statement, through the node agent reading
each vendor's exporter (`agent.exporters`: GAUDI, TPU) and posting to the ingest, and through
the Prometheus source (`metering.prometheus`) reading the same series from a real Prometheus,
backfilled with promtool as tests/metering/test_prometheus_source.py does.

The inventory is the vendors' own fixtures (tests/fixtures/dra/vendors/gaudi2.yaml, tpu.yaml)
with a claim holding every device for a day; the exporters' text is the project's recordings
(tests/agent/fixtures/gaudi-hl225.prom, tpu-v4-gke.prom), scraped once a minute. Devices the
exporter reports are billed as measured (utilised at what it read), the others unmeasured,
never idle.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.test import Client, override_settings
from django.urls import path
from prometheus_client.parser import text_string_to_metric_families

from agent.exporters import GAUDI, PROFILES, TPU, ExporterProfile, parse_metrics
from inventory import services as inventory_services
from inventory.dumps import iter_objects
from inventory.models import Device
from metering import prometheus, views
from metering.hours import epoch_ms
from metering.models import Sample
from metering.services import issue_agent_token
from tests.billing.test_vendor_billing import (
    DAY,
    VENDOR_CARDS,
    VENDOR_DAYS,
    card,
    close_october,
    usage_lines,
)
from tests.fixtures import DRA
from tests.metering.test_prometheus_source import Key, _binaries, _serve, openmetrics

urlpatterns = [path("ingest/samples", views.ingest_samples)]

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

AGENT_FIXTURES = Path(__file__).resolve().parent.parent / "agent" / "fixtures"
SCRAPE = timedelta(minutes=1)
# Where each recording was scraped: the node label a scrape job adds to the exporter's series
# (relabelled from the pod's node, as the operator guide says), the cluster label an engine
# shared by clusters adds.
RECORDINGS = {
    "gaudi-hl225.prom": (GAUDI, "gaudi-node-1"),
    "tpu-v4-gke.prom": (TPU, "tpu-v4-node-1"),
}
# What HLML reports on gaudi-node-1 (`agent.exporters.hlml_serial_buses`): each card's serial
# number and PCI address, as tests/fixtures/dra/vendors/gaudi2.yaml publishes them.
GAUDI_HLML = {
    "AN402031": "0000:0f:00.0",
    "AN402038": "0000:17:00.0",
    "AN402045": "0000:1c:00.0",
    "AN402052": "0000:33:00.0",
}


def recorded_day() -> dict[Key, list[tuple[int, str]]]:
    """Every utilisation series of the recordings, at its recorded value once a minute from
    a few minutes before the day to its end, labelled with its node and cluster."""
    series: dict[Key, list[tuple[int, str]]] = {}
    for recording, (profile, node) in RECORDINGS.items():
        wanted = {metric.name for metric in profile.utilisation}
        text = (AGENT_FIXTURES / recording).read_text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in wanted:
                    continue
                labels = dict(sample.labels) | {"node": node, "cluster": "fx"}
                first = epoch_ms(DAY - 5 * SCRAPE)
                points = [
                    (first + step * 60_000, repr(float(sample.value)))
                    for step in range(24 * 60 + 5)
                ]
                series[sample.name, tuple(sorted(labels.items()))] = points
    return series


@pytest.fixture(scope="module")
def vendor_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus holding the recorded day of the Gaudi and TPU exporters; its base URL."""
    server, promtool = _binaries()
    data = tmp_path_factory.mktemp("prometheus-vendors")
    (data / "day.om").write_text(openmetrics(recorded_day()))
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(data / "day.om"),
         str(data / "tsdb")],
        check=True,
        capture_output=True,
    )  # fmt: skip
    url, process = _serve(server, data, "global:\n  scrape_interval: 1h\n")
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def team() -> Any:
    from teams.models import Team, TeamNamespace

    team = Team.objects.create(slug="research", name="Research")
    TeamNamespace.objects.create(team=team, namespace="research")
    return team


def a_day_held(fixture: str) -> Any:
    """The fixture's devices synced and held by its claims for the day (VENDOR_DAYS)."""
    slices = [
        obj
        for obj in iter_objects(DRA / "vendors" / fixture)
        if obj["kind"] in ("ResourceSlice", "DeviceClass")
    ]
    claims, _ = VENDOR_DAYS[fixture]
    for product, price in VENDOR_CARDS.items():
        card(product, price)
    cluster = inventory_services.get_cluster("fx")
    kinds = ["ResourceSlice", "DeviceClass", "ResourceClaim"]
    for objects, at in ((slices + claims, DAY), (slices, DAY + timedelta(days=1))):
        report = inventory_services.import_snapshot(
            cluster=cluster, objects=objects, at=at, kinds=kinds
        )
        assert report.errors == []
    return cluster


def agent_scrapes_the_day(
    cluster: Any, node: str, recording: str, profile: ExporterProfile
) -> None:
    """The node agent's readings of the recording, once a minute over the day, posted as it
    posts them (a batch every 500 samples)."""
    text = (AGENT_FIXTURES / recording).read_text()
    token = issue_agent_token(cluster=cluster, node=node, actor="ops")
    samples: list[dict[str, Any]] = []
    at = DAY
    while at < DAY + timedelta(days=1):
        readings = parse_metrics(text, profile, at=at, serial_buses=GAUDI_HLML)
        samples.extend(reading.as_sample() for reading in readings)
        at += SCRAPE
    for start in range(0, len(samples), 500):
        response = Client().post(
            "/ingest/samples",
            data=json.dumps({"node": node, "samples": samples[start : start + 500]}),
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 200, response.content
        answer = response.json()
        assert answer["rejected"] == [] and answer["unknown_devices"] == [], answer


@pytest.mark.parametrize(
    ("fixture", "node", "recording", "profile", "product", "utilised", "unmeasured"),
    [
        # Two of eight cards report, at 87 % and 12.5 %: 0.995 x 24 utilised card-hours; six
        # cards a day unmeasured.
        ("gaudi2.yaml", "gaudi-node-1", "gaudi-hl225.prom", GAUDI, "Gaudi2", "23.88", "144"),
        # accel0 at 90 % (the node series), accel1 at 64 %, accel3 idle; accel2 unmeasured.
        ("tpu.yaml", "tpu-v4-node-1", "tpu-v4-gke.prom", TPU, "v4", "36.96", "24"),
    ],
)
def test_a_day_of_exporter_readings_through_the_agent_reaches_the_statement(
    team: Any,
    fixture: str,
    node: str,
    recording: str,
    profile: ExporterProfile,
    product: str,
    utilised: str,
    unmeasured: str,
) -> None:
    cluster = a_day_held(fixture)
    agent_scrapes_the_day(cluster, node, recording, profile)
    assert Sample.objects.exists()
    line = usage_lines(close_october())[product]
    assert line.allocated_gpu_hours == Decimal(VENDOR_DAYS[fixture][1][product][1])
    assert line.utilised_gpu_hours.normalize() == Decimal(utilised)
    assert line.unmeasured_gpu_hours.normalize() == Decimal(unmeasured)


@pytest.mark.parametrize(
    ("fixture", "product", "utilised", "unmeasured"),
    [
        ("gaudi2.yaml", "Gaudi2", "23.88", "144"),
        ("tpu.yaml", "v4", "36.96", "24"),
    ],
)
def test_the_same_day_through_the_prometheus_source_reaches_the_statement(
    vendor_engine: str, team: Any, fixture: str, product: str, utilised: str, unmeasured: str
) -> None:
    """The engine's series named as the agent names them (the profile's own key), the same
    figures as through the agent, no sample sent."""
    a_day_held(fixture)
    with override_settings(
        TALLY_METERING_SOURCE="samples,fx=prometheus",
        TALLY_PROMETHEUS_URL=vendor_engine,
        TALLY_PROMETHEUS_EXPORTERS=["gaudi", "tpu"],
    ):
        line = usage_lines(close_october())[product]
    assert not Sample.objects.exists()
    assert line.allocated_gpu_hours == Decimal(VENDOR_DAYS[fixture][1][product][1])
    assert line.utilised_gpu_hours.normalize() == Decimal(utilised)
    assert line.unmeasured_gpu_hours.normalize() == Decimal(unmeasured)


# --- the seam, without an engine -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_prometheus_source_asks_for_what_the_agent_reads(name: str) -> None:
    """The source's default metrics are the agent profile's utilisation metrics, in its order
    and at its scale: written once, in `agent.exporters`."""
    with override_settings(TALLY_PROMETHEUS_EXPORTERS=sorted(PROFILES)):
        (exporter,) = [one for one in prometheus.config().exporters if one.name == name]
    profile = PROFILES[name]
    assert [(m.selector.partition("{")[0], m.scale) for m in exporter.metrics] == [
        (metric.name, metric.scale) for metric in profile.utilisation
    ]
    assert exporter.skip == profile.skip
    assert set(exporter.labels.values()) == set(profile.labels.values())


def test_tpu_series_relabelled_by_the_operator_are_named_through_their_roles(team: Any) -> None:
    """Label names are settings: a node under another label, a chip under another, still name
    the chip the agent would (a chip of another node, or an id without index, names none)."""
    cluster = a_day_held("tpu.yaml")
    labels = "chip=tpu_chip, node=kubernetes_node"
    with override_settings(
        TALLY_PROMETHEUS_EXPORTERS=["tpu"], TALLY_PROMETHEUS_EXPORTER_LABELS={"tpu": labels}
    ):
        (exporter,) = prometheus.config().exporters
    series = [
        prometheus.Series(labels={"tpu_chip": chip, "kubernetes_node": node}, points=[(0, 5.0)])
        for chip, node in (
            ("4804690994094478883-2", "tpu-v4-node-1"),
            ("4804690994094478883", "tpu-v4-node-1"),
            ("4804690994094478883-2", "tpu-v4-node-9"),
        )
    ]
    meters, _ = prometheus.match_series(exporter, series, prometheus.Identities(), 0)
    accel2 = Device.objects.get(cluster=cluster, name="accel2")
    assert meters == [accel2.meter_id, None, None]


def test_gaudi_series_are_matched_by_serial_to_the_card_of_their_node(team: Any) -> None:
    """`MatchBy.SERIAL` in the Prometheus source: a series names the card of its node whose
    `serial` attribute its `Serial` is (as the exporter writes its labels); a serial no card of
    that node publishes, a series of another node, or one without a node name none, each
    said why."""
    cluster = a_day_held("gaudi2.yaml")
    with override_settings(TALLY_PROMETHEUS_EXPORTERS=["gaudi"]):
        (exporter,) = prometheus.config().exporters
    assert exporter.labels == {"serial": "Serial", "node": "node"}
    series = [
        prometheus.Series(labels={"Serial": serial, "node": node}, points=[(0, 5.0)])
        for serial, node in (
            ("AN402045", "gaudi-node-1"),
            ("AN402999", "gaudi-node-1"),
            ("AN402045", "gaudi-node-9"),
            ("AN402045", ""),
        )
    ]
    meters, why = prometheus.match_series(exporter, series, prometheus.Identities(), 0)
    card = Device.objects.get(cluster=cluster, name="0000-1c-00-0-0x1020")
    assert meters == [card.meter_id, None, None, None]
    assert len(why) == 3 and "AN402999 on gaudi-node-1" in why[0]
    # Two cards of one node publishing one serial: neither is named.
    other = Device.objects.get(cluster=cluster, name="0000-33-00-0-0x1020")
    other.attributes = other.attributes | {"serial": {"string": "AN402045"}}
    other.save(update_fields=["attributes"])
    meters, _ = prometheus.match_series(exporter, series[:1], prometheus.Identities(), 0)
    assert meters == [None]
