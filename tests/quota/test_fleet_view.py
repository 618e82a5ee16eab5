"""The webhook's view of the fleet: reloaded when a sync changed the fleet, not on a timer."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from inventory import services as inventory_services
from inventory.models import Cluster
from quota.admission import shapes
from tests.quota.fixtures import AT, fleet_objects, nvidia_gpu, nvidia_slice

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]


def _version() -> int:
    return Cluster.objects.get(name="default").fleet_version


def _import(objects: list[dict]) -> inventory_services.SyncReport:
    return inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=objects,
        at=AT + timedelta(hours=1),
    )


def test_an_unchanged_fleet_costs_one_row_to_check_and_is_not_loaded_again(settings) -> None:
    settings.TALLY_SHAPE_CACHE_SECONDS = 0  # check on every call
    cluster = inventory_services.get_cluster("default")
    first = shapes.fleet_shapes(cluster=cluster)
    with CaptureQueriesContext(connection) as queries:
        again = shapes.fleet_shapes(cluster=cluster)
    assert again is first
    assert len(queries) == 1 and "fleet_version" in queries[0]["sql"]


def test_a_sync_that_changes_nothing_keeps_the_version() -> None:
    before = _version()
    report = _import(fleet_objects())
    assert report.created["Device"] == report.gone["Device"] == 0
    assert _version() == before


def test_a_sync_that_adds_devices_moves_the_version_and_the_webhook_sees_them(settings) -> None:
    settings.TALLY_SHAPE_CACHE_SECONDS = 0
    cluster = inventory_services.get_cluster("default")
    before = shapes.fleet_shapes(cluster=cluster)
    h200 = nvidia_slice("h200-a", [nvidia_gpu(0, "h200-a", "NVIDIA H200", "141Gi")])
    report = _import([*fleet_objects(), h200])
    assert report.created["Device"] == 1
    after = shapes.fleet_shapes(cluster=cluster)
    assert after is not before and after.version == before.version + 1  # type: ignore[operator]
    h200_selector = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H200"'
    assert not any(before.match(h200_selector, shape) for shape in before.shapes.values())
    assert any(after.match(h200_selector, shape) for shape in after.shapes.values())
    assert len(after.per_node) == len(before.per_node) + 1


def test_a_sync_that_removes_devices_moves_the_version() -> None:
    before = _version()
    report = _import(fleet_objects()[:-1])  # the MIG node's slice is gone
    assert report.gone["Device"] == 4
    assert _version() == before + 1
