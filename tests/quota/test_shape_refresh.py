"""The webhook's fleet snapshot: read from device counts the database keeps with the devices,
brought up to date from only the counts that changed, off the request path."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.db.models import Count
from django.test.utils import CaptureQueriesContext

from inventory import services as inventory_services
from inventory import simulate
from inventory.models import Cluster, Device, DeviceShape, NodeShapeCount
from quota.admission import shapes
from quota.admission.refresher import Refresher
from tests.quota.fixtures import AT, fleet_objects, nvidia_gpu, nvidia_slice

H200 = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H200"'


def _import(objects: list[dict[str, Any]], *, hours: int = 1) -> None:
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=objects,
        at=AT + timedelta(hours=hours),
    )
    assert report.errors == []


def _recount() -> dict[tuple[int | None, int], int]:
    """The present devices per (node, shape), counted from the devices themselves."""
    return {
        (node, shape): devices
        for node, shape, devices in Device.objects.filter(gone_at__isnull=True, shape__isnull=False)
        .values_list("node_id", "shape_id")
        .annotate(devices=Count("id"))
        .order_by()
    }


def _counted() -> dict[tuple[int | None, int], int]:
    return {
        (node, shape): devices
        for node, shape, devices in NodeShapeCount.objects.filter(devices__gt=0).values_list(
            "node_id", "shape_id", "devices"
        )
    }


def _view(fleet: shapes.FleetShapes) -> tuple[Any, ...]:
    """What admissions read of a snapshot (shapes in order, counts, classes)."""
    return (
        list(fleet.shapes),
        fleet.per_node,
        fleet.off_node,
        fleet.shape_devices,
        fleet.class_selectors,
    )


def _cluster() -> Cluster:
    return Cluster.objects.get(name="default")


def _h200_node(node: str = "h200-a", memory: str = "141Gi") -> dict[str, Any]:
    return nvidia_slice(node, [nvidia_gpu(i, node, "NVIDIA H200", memory) for i in range(2)])


def _shared_slice() -> dict[str, Any]:
    """Two GPUs published for every node: devices without a node."""
    shared = nvidia_slice(
        "shared", [nvidia_gpu(i, "shared", "NVIDIA H200", "141Gi") for i in (0, 1)]
    )
    del shared["spec"]["nodeName"]
    shared["spec"]["allNodes"] = True
    return shared


# --- the counts ---------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("seed", [0, 1])
def test_the_counts_are_a_recount_of_the_present_devices_whatever_changed_them(seed: int) -> None:
    cluster = inventory_services.get_cluster("default")
    for step, nodes in enumerate([6, 4, 7, 0, 5]):
        inventory_services.import_snapshot(
            cluster=cluster,
            objects=list(simulate.generate(nodes=nodes, seed=seed + step % 2)),
            at=AT + timedelta(hours=step),
        )
        assert _counted() == _recount()
    _import([*fleet_objects(), _shared_slice()], hours=10)
    assert _counted() == _recount()
    assert any(node is None for node, _ in _counted())
    # Writes that are not the sync's: a device moved to another node, one deleted outright.
    first, second = Device.objects.filter(gone_at__isnull=True, node__isnull=False)[:2]
    Device.objects.filter(pk=first.pk).update(node=second.node_id)
    Device.objects.filter(pk=second.pk).delete()
    assert _counted() == _recount()
    # Counts that fell to zero are kept (a reader of what changed sees them fall).
    assert NodeShapeCount.objects.filter(devices=0).exists()


# --- a refresh: only what changed ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_refresh_reads_only_the_counts_that_changed_and_equals_a_full_load(fleet: None) -> None:
    cluster = _cluster()
    before = shapes.load_fleet(cluster=cluster)  # in autocommit: refreshable from here
    assert before.counted_as_of is not None
    kept = _view(before)
    _import([*fleet_objects(), _h200_node()])
    _, changes = shapes._counts_since(cluster.pk, before.counted_as_of)
    h200 = Device.objects.get(gone_at__isnull=True, name="gpu-0", node__name="h200-a")
    assert changes == [(h200.node_id, h200.shape_id, 2)]  # not the rest of the fleet
    after = shapes.refreshed(before, cluster_id=cluster.pk, version=7)
    assert after.version == 7 and after.counted_as_of is not None
    assert _view(after) == _view(shapes.load_fleet(cluster=cluster))
    assert any(after.match(H200, shape) for shape in after.shapes.values())
    assert _view(before) == kept  # requests may still be reading it


@pytest.mark.django_db(transaction=True)
def test_a_fleet_that_shrinks_or_whose_shapes_change_is_reflected(fleet: None) -> None:
    cluster = _cluster()
    _import([*fleet_objects(), _h200_node(), _shared_slice()])
    snapshot = shapes.load_fleet(cluster=cluster)
    assert snapshot.off_node
    steps: list[list[dict[str, Any]] | None] = [
        fleet_objects()[:-1],  # the MIG node's slice is gone, and the H200s, and the shared
        [*fleet_objects()[:-1], _h200_node(memory="96Gi")],  # H200s back, of another shape
        None,  # every device gone
    ]
    for hours, objects in enumerate(steps, start=2):
        if objects is None:
            Device.objects.update(gone_at=AT + timedelta(hours=hours))
        else:
            _import(objects, hours=hours)
        snapshot = shapes.refreshed(snapshot, cluster_id=cluster.pk, version=hours)
        assert _view(snapshot) == _view(shapes.load_fleet(cluster=cluster))
        present = {shape for _, shape in _recount()}
        assert set(snapshot.shapes) == present
        nodes = {node for node, _ in _recount() if node is not None}
        assert set(snapshot.per_node) == nodes  # no node kept with nothing on it
    assert snapshot.shapes == {} and snapshot.per_node == {} and snapshot.off_node == {}


@pytest.mark.django_db(transaction=True)
def test_a_shape_deleted_with_its_counts_unseen_is_dropped_by_the_next_refresh(
    fleet: None,
) -> None:
    """A snapshot that did not see a shape's count fall (the inventory deletes an unused
    shape, with its count rows, a day after) must not keep its devices."""
    cluster = _cluster()
    _import([*fleet_objects(), _h200_node()])
    snapshot = shapes.load_fleet(cluster=cluster)
    h200 = list(Device.objects.filter(gone_at__isnull=True, node__name="h200-a"))
    old_shape = h200[0].shape_id
    assert old_shape is not None
    # The H200s take another shape in place, then the old one is cleaned up, counts and all,
    # before this snapshot is refreshed.
    other = Device.objects.filter(gone_at__isnull=True).exclude(shape_id=old_shape).first()
    assert other is not None
    Device.objects.filter(pk__in=[d.pk for d in h200]).update(shape_id=other.shape_id)
    NodeShapeCount.objects.filter(shape_id=old_shape).delete()
    DeviceShape.objects.filter(pk=old_shape).delete()
    refreshed = shapes.refreshed(snapshot, cluster_id=cluster.pk, version=9)
    assert old_shape not in refreshed.shapes
    assert _view(refreshed) == _view(shapes.load_fleet(cluster=cluster))


@pytest.mark.django_db(transaction=True)
def test_a_change_committed_after_a_read_began_is_seen_by_the_next_refresh(fleet: None) -> None:
    cluster = _cluster()
    h100 = list(Device.objects.filter(node__name="h100-a").values_list("pk", flat=True))
    devices = sum(_recount().values())
    with _other_connection() as other:
        # Begun (and its transaction id taken) before the snapshot is read; committed after.
        other.execute("UPDATE inventory_device SET gone_at = now() WHERE id = ANY(%s)", [h100])
        first = shapes.load_fleet(cluster=cluster)
        other.commit()
    assert sum(first.shape_devices.values()) == devices  # the H100s still there
    second = shapes.refreshed(first, cluster_id=cluster.pk, version=None)
    assert _view(second) == _view(shapes.load_fleet(cluster=cluster))
    assert sum(second.shape_devices.values()) == devices - len(h100) == devices - 4


@pytest.mark.django_db(transaction=True)
def test_a_change_rolled_back_changes_nothing(fleet: None) -> None:
    cluster = _cluster()
    first = shapes.load_fleet(cluster=cluster)
    with pytest.raises(RuntimeError), transaction.atomic():
        Device.objects.filter(node__name="h100-a").update(gone_at=AT)
        raise RuntimeError("rolled back")
    assert shapes._counts_since(cluster.pk, first.counted_as_of)[1] == []
    assert _view(shapes.refreshed(first, cluster_id=cluster.pk, version=None)) == _view(first)


@pytest.mark.django_db(transaction=True)
def test_a_snapshot_from_before_transaction_ids_went_back_is_read_again_in_full(
    fleet: None,
) -> None:
    # As after the database was restored from a dump behind the same name.
    cluster = _cluster()
    stale = shapes.load_fleet(cluster=cluster)
    stale.counted_as_of = "9000000000:9000000000:"
    _import([*fleet_objects(), _h200_node()])
    fresh = shapes.refreshed(stale, cluster_id=cluster.pk, version=None)
    assert _view(fresh) == _view(shapes.load_fleet(cluster=cluster))
    assert fresh.counted_as_of is not None and not fresh.counted_as_of.startswith("9000000000")


@pytest.mark.django_db
def test_within_a_transaction_a_snapshot_is_read_in_full_next_time(fleet: None) -> None:
    # The transaction's own writes are counted, and may be rolled back: no other reader could
    # tell, so what it read is not a base to read changes from.
    snapshot = shapes.load_fleet(cluster=_cluster())
    assert connection.in_atomic_block and snapshot.counted_as_of is None
    again = shapes.refreshed(snapshot, cluster_id=_cluster().pk, version=None)
    assert _view(again) == _view(snapshot)


# --- off the request path -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_due_snapshot_is_served_while_the_background_refresher_loads_the_next(
    fleet: None, settings: Any
) -> None:
    settings.TALLY_SHAPE_CACHE_SECONDS = 10
    cluster = _cluster()
    backends = _backends()  # before the refresher has run
    shapes.fleet_shapes(cluster=cluster)  # the first load: on this connection
    shapes.refresher.join(timeout=30)  # its pools checked in the background
    first = shapes.fleet_shapes(cluster=cluster)
    assert not first.pools_pending
    _import([*fleet_objects(), _h200_node()])
    first.loaded_at -= 10  # due
    with CaptureQueriesContext(connection) as queries:
        served = shapes.fleet_shapes(cluster=cluster)
    assert served is first and len(queries) == 0  # no request waits for the reload
    shapes.refresher.join(timeout=30)
    after = shapes.fleet_shapes(cluster=cluster)
    assert after is not first and after.version == _cluster().fleet_version
    assert any(after.match(H200, shape) for shape in after.shapes.values())
    assert _view(after) == _view(shapes.load_fleet(cluster=cluster))
    assert _backends_begun_since(backends) == set()  # the refresher's connections closed
    # Due again with nothing changed: the version is read, the snapshot kept.
    after.loaded_at -= 10
    assert shapes.fleet_shapes(cluster=cluster) is after
    shapes.refresher.join(timeout=30)
    assert shapes.fleet_shapes(cluster=cluster) is after
    assert after.loaded_at > first.loaded_at + 10


@pytest.mark.django_db(transaction=True)
def test_a_snapshot_forgotten_during_a_refresh_is_not_brought_back(fleet: None) -> None:
    cluster = _cluster()
    first = shapes.fleet_shapes(cluster=cluster)
    first.loaded_at -= 3600
    shapes.forget_fleet_shapes()
    shapes.refresh_due()  # what a refresh begun before the forgetting would do now
    assert shapes._cache == {}


def test_the_refresher_runs_one_piece_of_work_at_a_time_and_outlives_a_failure() -> None:
    refresher = Refresher("test")
    release = threading.Event()
    ran: list[str] = []

    def blocked() -> None:
        release.wait(10)
        ran.append("first")

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("the database went away")

    assert refresher.start(blocked)
    assert not refresher.start(lambda: ran.append("second"))  # one at a time
    release.set()
    refresher.join(timeout=10)
    assert refresher.start(failing)
    refresher.join(timeout=10)
    assert refresher.start(lambda: ran.append("third"))
    refresher.join(timeout=10)
    assert ran == ["first", "failing", "third"]


def _backends() -> set[int]:
    """The server processes of the sessions on the test database."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        return {pid for (pid,) in cursor.fetchall()}


def _backends_begun_since(before: set[int]) -> set[int]:
    """Sessions on the test database that were not there `before`, waiting a little for a
    closed one's server process to end (it ends after the client has gone). A session that
    was there before and ends meanwhile (a previous test's, or the first refresh's) is no
    business of the caller's."""
    deadline = time.monotonic() + 5
    while (begun := _backends() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return begun


@contextlib.contextmanager
def _other_connection() -> Iterator[psycopg.Connection[Any]]:
    """A second connection to the test database, in a transaction of its own."""
    database = connection.settings_dict
    with psycopg.connect(
        dbname=database["NAME"],
        user=database["USER"],
        password=database["PASSWORD"],
        host=database["HOST"],
        port=database["PORT"],
    ) as other:
        yield other
