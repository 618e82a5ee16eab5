"""Device shapes no device has any more are deleted by the relist of slices, once unused for
`SHAPE_UNUSED_GRACE`, with their zero counts; never one a device (present or gone) names or a
node counts, nor one a writer gives a device at the same moment (two real PostgreSQL
connections)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction

from inventory import services
from inventory.models import Device, DeviceShape, NodeShapeCount

T1 = datetime(2026, 12, 1, 9, tzinfo=UTC)
LATER = T1 + services.SHAPE_UNUSED_GRACE
DRIVER = "gpu.nvidia.com"


def resource_slice(
    product: str, *, name: str = "node-a-gpu", node: str = "node-a"
) -> dict[str, Any]:
    """One GPU whose product name (an attribute, so part of its shape) the driver may change."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {
                        "type": {"string": "gpu"},
                        "uuid": {"string": f"GPU-{node}"},
                        "productName": {"string": product},
                    },
                    "capacity": {"memory": {"value": "80Gi"}},
                }
            ],
        },
    }


def relist(*slices: dict[str, Any], at: datetime) -> None:
    report = services.import_snapshot(
        cluster=services.get_cluster("lab"), objects=slices, at=at, kinds=["ResourceSlice"]
    )
    assert not report.errors


def shape_of(node: str = "node-a") -> DeviceShape:
    shape = Device.objects.select_related("shape").get(gone_at=None, pool=node).shape
    assert shape is not None
    return shape


@pytest.mark.django_db
def test_a_shape_left_behind_by_a_driver_upgrade_is_deleted_after_the_grace() -> None:
    relist(resource_slice("H100 old name"), at=T1)
    old = shape_of()
    # The upgrade changes an attribute: the device has another shape, the old one no device.
    relist(resource_slice("NVIDIA H100 80GB HBM3"), at=T1)
    new = shape_of()
    assert new.pk != old.pk
    assert NodeShapeCount.objects.get(shape=old).devices == 0

    old.refresh_from_db()
    assert old.unused_since == T1  # noted by the relist, kept for now
    relist(resource_slice("NVIDIA H100 80GB HBM3"), at=LATER - timedelta(seconds=1))
    assert DeviceShape.objects.filter(pk=old.pk).exists()

    relist(resource_slice("NVIDIA H100 80GB HBM3"), at=LATER)
    assert list(DeviceShape.objects.values_list("pk", flat=True)) == [new.pk]
    assert not NodeShapeCount.objects.filter(shape_id=old.pk).exists()
    new.refresh_from_db()
    assert new.unused_since is None


@pytest.mark.django_db
def test_a_gone_devices_shape_is_kept_and_a_shape_taken_again_is_no_longer_unused() -> None:
    relist(resource_slice("A"), resource_slice("B", name="node-b-gpu", node="node-b"), at=T1)
    gone = shape_of("node-b")
    # node-b's slice goes: its device is gone, and keeps its shape (history).
    relist(resource_slice("A"), at=T1)
    assert Device.objects.get(pool="node-b").gone_at == T1
    relist(resource_slice("A"), at=LATER + timedelta(days=30))
    assert DeviceShape.objects.filter(pk=gone.pk).exists()

    # A shape noted unused, then taken again by node-a's device before the grace is over.
    first = shape_of()
    relist(resource_slice("C"), at=LATER)
    first.refresh_from_db()
    assert first.unused_since == LATER
    relist(resource_slice("A"), at=LATER + timedelta(hours=1))
    first.refresh_from_db()
    assert (shape_of().pk, first.unused_since) == (first.pk, None)


def in_thread(work: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # handed to the test thread
            errors.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def wait_for_a_lock_wait() -> None:
    """Until another connection waits on a row lock (the race's second party is blocked)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            (waiting,) = cursor.fetchone()
        if waiting:
            return
        time.sleep(0.05)
    raise AssertionError("no connection waited on the other's lock")


def a_shape_to_delete() -> DeviceShape:
    """node-a's first shape, left unused by an upgrade and noted so at T1."""
    relist(resource_slice("A"), at=T1)
    old = shape_of()
    relist(resource_slice("B"), at=T1)
    old.refresh_from_db()
    assert old.unused_since == T1
    return old


@pytest.mark.django_db(transaction=True)
def test_a_writer_taking_a_shape_first_keeps_it_from_the_cleanup() -> None:
    old = a_shape_to_delete()
    cluster = services.get_cluster("lab")
    locked, release = threading.Event(), threading.Event()

    def writer() -> None:
        # The driver goes back to A: node-a's device takes the old shape again; the
        # transaction stays open until the cleanup is waiting on it.
        with transaction.atomic():
            relist(resource_slice("A"), at=LATER - timedelta(minutes=1))
            locked.set()
            release.wait(20)

    writing, writer_errors = in_thread(writer)
    assert locked.wait(20)
    deleted: list[int] = []
    cleaning, cleanup_errors = in_thread(
        lambda: deleted.append(services.delete_unused_shapes(cluster=cluster, at=LATER))
    )
    wait_for_a_lock_wait()
    release.set()
    writing.join(20)
    cleaning.join(20)

    assert (writer_errors, cleanup_errors, deleted) == ([], [], [0])
    assert shape_of().pk == old.pk
    assert NodeShapeCount.objects.get(shape=old).devices == 1


@pytest.mark.django_db(transaction=True)
def test_a_cleanup_deleting_first_leaves_the_writer_a_shape_made_anew() -> None:
    old = a_shape_to_delete()
    cluster = services.get_cluster("lab")
    deleted, release = threading.Event(), threading.Event()

    def cleanup() -> None:
        with transaction.atomic():
            assert services.delete_unused_shapes(cluster=cluster, at=LATER) == 1
            deleted.set()
            release.wait(20)

    cleaning, cleanup_errors = in_thread(cleanup)
    assert deleted.wait(20)
    writing, writer_errors = in_thread(lambda: relist(resource_slice("A"), at=LATER))
    wait_for_a_lock_wait()
    release.set()
    cleaning.join(20)
    writing.join(20)

    assert (cleanup_errors, writer_errors) == ([], [])
    taken = shape_of()
    assert (taken.key, taken.pk != old.pk) == (old.key, True)
    assert not DeviceShape.objects.filter(pk=old.pk).exists()
    assert NodeShapeCount.objects.get(shape=taken).devices == 1
