"""Watch events applied in batches (`services.apply_watch_events`, and the sync's watch loop
that takes them as they arrive) leave the rows that applying them one by one leaves.

The property test applies random sequences of claim and slice events (the same object several
times, deleted and added again with a new uid, older resourceVersions, malformed objects,
claims allocated from slices of the same batch, gangs) to the same starting inventory twice,
one event a call and cut into random batches, and compares every row they write.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.fake_kube import FakeKube
from inventory import kube, kube_sync, owners, services
from inventory.gangs import GangRef
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    Gang,
    Node,
    Pool,
    ResourceClaim,
    ResourceSlice,
    SyncState,
)
from metering.models import DirtyHour
from tests.waits import wait_until

DRIVER = "gpu.nvidia.com"
NAMESPACE = "team-a"
T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
POOLS = ("pool-a", "pool-b")
SLICES = ("slice-1", "slice-2", "slice-3")
DEVICES = ("gpu-0", "gpu-1", "gpu-2")
CLAIMS = ("train", "serve", "eval")
GANGS = (GangRef("jobset", "JobSet/train", 2, (), ""), GangRef("jobset", "JobSet/other", 3, (), ""))
JOBS = (
    owners.Resolution(chain=("Job/train-x", "CronJob/nightly"), complete=True),
    owners.Resolution(chain=("Job/train-x",), complete=False),
)


# Objects ----------------------------------------------------------------------------------


def gpu(name: str, node: str) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{node}-{name}"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }


def resource_slice(
    name: str,
    *,
    pool: str,
    devices: tuple[str, ...],
    generation: int = 1,
    slices: int = 1,
    version: int = 1,
    uid: int = 0,
) -> dict[str, Any]:
    node = f"node-{pool}"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "uid": f"{name}-{uid}", "resourceVersion": str(version)},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": slices},
            "devices": [gpu(device, node) for device in devices],
        },
    }


def claim(
    name: str,
    *,
    uid: int = 0,
    device: tuple[str, str] | None = None,
    owner: str = "Job",
    version: int = 1,
) -> dict[str, Any]:
    results = (
        [{"request": "gpu", "driver": DRIVER, "pool": device[0], "device": device[1]}]
        if device is not None
        else []
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}-{uid}",
            "resourceVersion": str(version),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": owner,
                    "name": f"{name}-x",
                    "uid": f"{owner}-{name}",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
        "status": {"allocation": {"devices": {"results": results}}} if results else {},
    }


def malformed(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with a field no parser accepts: rejected, and nothing else changes."""
    broken = copy.deepcopy(obj)
    if broken["kind"] == "ResourceSlice":
        del broken["spec"]["pool"]
    else:
        broken["spec"] = "not a mapping"
    return broken


def starting_inventory(cluster: Cluster) -> None:
    """Two pools, a claim allocated from one in a gang, one waiting."""
    services.import_snapshot(
        cluster=cluster,
        objects=[
            resource_slice("slice-1", pool="pool-a", devices=("gpu-0", "gpu-1")),
            resource_slice("slice-2", pool="pool-b", devices=("gpu-0",)),
            claim("train", device=("pool-a", "gpu-0")),
            claim("serve"),
        ],
        at=T0 - timedelta(hours=2),
        gangs={"uid-train-0": GANGS[0]},
    )


# Random event sequences -------------------------------------------------------------------


@st.composite
def slice_events(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    obj = resource_slice(
        draw(st.sampled_from(SLICES)),
        pool=draw(st.sampled_from(POOLS)),
        devices=tuple(draw(st.lists(st.sampled_from(DEVICES), min_size=1, unique=True))),
        generation=draw(st.integers(1, 3)),
        slices=draw(st.integers(1, 2)),
        version=draw(st.integers(1, 50)),
        uid=draw(st.integers(0, 1)),
    )
    return draw(st.sampled_from(("ADDED", "MODIFIED", "DELETED"))), obj


@st.composite
def claim_events(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    obj = claim(
        draw(st.sampled_from(CLAIMS)),
        uid=draw(st.integers(0, 1)),
        device=draw(st.none() | st.tuples(st.sampled_from(POOLS), st.sampled_from(DEVICES))),
        owner=draw(st.sampled_from(("Job", "Pod"))),
        version=draw(st.integers(1, 50)),
    )
    return draw(st.sampled_from(("ADDED", "MODIFIED", "DELETED"))), obj


@st.composite
def watch_events(draw: st.DrawFn) -> list[tuple[services.WatchEvent, bool]]:
    """Events, each with whether a batch ends after it; times that cross hours, or repeat."""
    at = T0
    events = []
    for _ in range(draw(st.integers(1, 14))):
        event_type, obj = draw(slice_events() | claim_events())
        if draw(st.integers(0, 9)) == 0:
            obj = malformed(obj)
        is_claim = obj["kind"] == "ResourceClaim"
        at += timedelta(minutes=draw(st.sampled_from((0, 1, 7, 45))))
        event = services.WatchEvent(
            event_type=event_type,
            obj=obj,
            at=at,
            job=draw(st.none() | st.sampled_from(JOBS)) if is_claim else None,
            gang=draw(st.none() | st.sampled_from(GANGS)) if is_claim else None,
        )
        events.append((event, draw(st.booleans())))
    return events


# The rows compared --------------------------------------------------------------------------


def rows(cluster: Cluster) -> dict[str, list[str]]:
    """Every row the sync writes, by natural key (ids differ between the two runs)."""
    tables = {
        "claims": ResourceClaim.objects.filter(cluster=cluster).values_list(
            "uid",
            "namespace",
            "name",
            "job",
            "created_by",
            "first_seen",
            "released_at",
            "resource_version",
            "owner_references",
            "status",
            "gang__key",
        ),
        "allocations": Allocation.objects.filter(cluster=cluster).values_list(
            "claim__uid",
            "request",
            "pool",
            "device_name",
            "start",
            "end",
            "device__name",
            "device__first_seen",
            "meter_id",
            "gpu_share",
            "job",
            "username",
        ),
        "devices": Device.objects.filter(cluster=cluster).values_list(
            "pool",
            "name",
            "first_seen",
            "gone_at",
            "slice_name",
            "pool_generation",
            "node__name",
            "shape__key",
        ),
        "pools": Pool.objects.filter(cluster=cluster).values_list(
            "name",
            "counted_generation",
            "newest_generation",
            "slices_expected",
            "slices_seen",
            "updated_at",
        ),
        "slices": ResourceSlice.objects.filter(cluster=cluster).values_list(
            "name", "uid", "pool", "generation", "first_seen", "gone_at", "resource_version"
        ),
        "nodes": Node.objects.filter(cluster=cluster).values_list("name", "first_seen", "gone_at"),
        "gangs": Gang.objects.filter(cluster=cluster).values_list(
            "namespace", "key", "source", "size", "first_seen", "last_seen", "ended_at"
        ),
    }
    return {name: sorted(map(repr, query)) for name, query in tables.items()}


class _RolledBack(Exception):
    pass


def outcome(cluster: Cluster, apply: Callable[[], None]) -> dict[str, Any]:
    """The rows after the starting inventory and `apply`, all rolled back after."""
    result: dict[str, Any] = {}
    try:
        with transaction.atomic():
            starting_inventory(cluster)
            fleet_version = Cluster.objects.get(pk=cluster.pk).fleet_version
            apply()
            result.update(rows(cluster))
            result["fleet changed"] = (
                Cluster.objects.get(pk=cluster.pk).fleet_version > fleet_version
            )
            result["marked at"] = dict(DirtyHour.objects.values_list("hour", "marked_at"))
            raise _RolledBack
    except _RolledBack:
        pass
    return result


def batches(events: list[tuple[services.WatchEvent, bool]]) -> Iterator[list[services.WatchEvent]]:
    batch: list[services.WatchEvent] = []
    for event, ends_batch in events:
        batch.append(event)
        if ends_batch:
            yield batch
            batch = []
    if batch:
        yield batch


# The property -------------------------------------------------------------------------------


@pytest.mark.django_db
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(events=watch_events())
def test_batches_leave_the_rows_one_event_at_a_time_leaves(
    events: list[tuple[services.WatchEvent, bool]],
) -> None:
    cluster = services.get_cluster("lab")

    def one_by_one() -> None:
        for event, _ in events:
            key = event.obj["metadata"].get("uid", "")
            services.apply_watch_event(
                cluster=cluster,
                event_type=event.event_type,
                obj=event.obj,
                at=event.at,
                jobs={key: event.job} if event.job is not None else None,
                gangs={key: event.gang} if event.gang is not None else None,
            )

    def batched() -> None:
        for batch in batches(events):
            services.apply_watch_events(cluster=cluster, events=batch)

    expected = outcome(cluster, one_by_one)
    actual = outcome(cluster, batched)
    # One mark an hour either way; a batch marks its hours as of its last event, which is no
    # earlier than the event that marked them alone. A batch may mark more hours (a claim held
    # to its last event, not to the claim's own): re-rolled, they come out the same; never
    # fewer, or later than the batch's last event.
    expected_marks, actual_marks = expected.pop("marked at"), actual.pop("marked at")
    assert actual == expected
    last = events[-1][0].at
    assert set(expected_marks) <= set(actual_marks)
    for hour in set(actual_marks) - set(expected_marks):
        assert hour <= last
    for hour, marked_at in expected_marks.items():
        batch_marked_at = actual_marks[hour]
        assert marked_at is not None and batch_marked_at is not None
        assert marked_at <= batch_marked_at <= max(last, marked_at)


@pytest.mark.django_db
@pytest.mark.parametrize("order", [("slice-1", "slice-3"), ("slice-3", "slice-1")])
def test_a_device_published_in_two_slices_is_counted_from_the_same_one_whatever_the_order(
    order: tuple[str, str],
) -> None:
    """Which of two slices publishing one device name is kept does not depend on which was
    written last, nor on the order PostgreSQL returns the stored slices in (which follows the
    rows' updates and the plan PostgreSQL picks): the property above found the two paths
    keeping different ones. Scanned in the heap's order, not the name index's."""
    cluster = services.get_cluster("lab")
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_indexscan = off")
        cursor.execute("SET LOCAL enable_indexonlyscan = off")
        cursor.execute("SET LOCAL enable_bitmapscan = off")
    for index, name in enumerate(order):
        report = services.apply_watch_event(
            cluster=cluster,
            event_type="ADDED",
            obj=resource_slice(name, pool="pool-a", devices=("gpu-0",), slices=2),
            at=T0 + timedelta(minutes=index),
        )
    assert [error for error in report.errors if "'gpu-0' is published twice" in error]
    device = Device.objects.get(cluster=cluster, pool="pool-a", gone_at__isnull=True)
    assert (device.name, device.slice_name) == ("gpu-0", "slice-1")


@pytest.mark.django_db
def test_a_claim_allocated_from_a_slice_of_its_batch_is_tied_to_its_device() -> None:
    cluster = services.get_cluster("lab")
    events = [
        services.WatchEvent(
            event_type="ADDED",
            obj=claim("train", uid=1, device=("pool-c", "gpu-0")),
            at=T0,
        ),
        services.WatchEvent(
            event_type="ADDED",
            obj=resource_slice("slice-c", pool="pool-c", devices=("gpu-0",)),
            at=T0 + timedelta(seconds=1),
        ),
        services.WatchEvent(
            event_type="ADDED",
            obj=claim("serve", uid=1, device=("pool-c", "gpu-0")),
            at=T0 + timedelta(seconds=2),
        ),
    ]
    report = services.apply_watch_events(cluster=cluster, events=events)

    assert report.created["Allocation"] == 2 and not report.errors
    allocations = Allocation.objects.filter(cluster=cluster).order_by("start")
    assert [(a.claim.name, a.device.name if a.device else None, a.start) for a in allocations] == [
        ("train", "gpu-0", T0),
        ("serve", "gpu-0", T0 + timedelta(seconds=2)),
    ]
    device = Device.objects.get(cluster=cluster, pool="pool-c")
    assert device.first_seen == T0 + timedelta(seconds=1)


@pytest.mark.django_db
def test_a_malformed_object_is_reported_and_the_rest_of_its_batch_applied() -> None:
    cluster = services.get_cluster("lab")
    events = [
        services.WatchEvent(
            event_type="ADDED",
            obj=malformed(resource_slice("slice-x", pool="pool-x", devices=("gpu-0",))),
            at=T0,
        ),
        services.WatchEvent(
            event_type="ADDED",
            obj=resource_slice("slice-a", pool="pool-a", devices=("gpu-0",)),
            at=T0,
        ),
    ]
    report = services.apply_watch_events(cluster=cluster, events=events)

    assert [error for error in report.errors if "slice-x" in error and "spec.pool" in error]
    assert set(Device.objects.values_list("pool", "name")) == {("pool-a", "gpu-0")}


@pytest.mark.django_db
def test_a_slice_whose_counter_sets_alone_change_bumps_the_fleet_version() -> None:
    """A driver that grows a shared counter set and changes none of its devices changes what
    an `allocationMode: All` request can be given (`quota.admission.shapes.counter_shortfall`,
    cached per fleet version)."""
    cluster = services.get_cluster("lab")
    published = resource_slice("slice-a", pool="pool-a", devices=("gpu-0",))
    services.apply_watch_event(cluster=cluster, event_type="ADDED", obj=published, at=T0)
    before = Cluster.objects.get(pk=cluster.pk).fleet_version
    grown = copy.deepcopy(published)
    grown["spec"]["sharedCounters"] = [{"name": "gpu-0", "counters": {"memory": {"value": "80Gi"}}}]
    report = services.apply_watch_event(
        cluster=cluster, event_type="MODIFIED", obj=grown, at=T0 + timedelta(minutes=1)
    )
    assert report.updated["ResourceSlice"] == 1 and not report.updated["Device"]
    assert Cluster.objects.get(pk=cluster.pk).fleet_version > before


@pytest.mark.django_db
def test_an_unknown_event_type_writes_nothing() -> None:
    cluster = services.get_cluster("lab")
    good = services.WatchEvent(
        event_type="ADDED",
        obj=resource_slice("slice-a", pool="pool-a", devices=("gpu-0",)),
        at=T0,
    )
    bookmark = services.WatchEvent(event_type="BOOKMARK", obj=good.obj, at=T0)
    with pytest.raises(ValueError, match="BOOKMARK"):
        services.apply_watch_events(cluster=cluster, events=[good, bookmark])
    assert not ResourceSlice.objects.exists()


# The watch loop ---------------------------------------------------------------------------


@contextmanager
def running_sync(api_client: Any, cluster: Cluster, kind: str) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(
        target=kube_sync.sync,
        kwargs={
            "api_client": api_client,
            "cluster": cluster,
            "kinds": [kind],
            "stop": stop,
            "backoff": kube.Backoff(initial_seconds=0.01, maximum_seconds=0.05),
        },
        daemon=True,
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the sync did not stop"


@pytest.fixture
def backlog(fake: FakeKube, cluster: Cluster) -> str:
    """A slice listed, then 60 changes to 20 claims the sync has not seen: its watch starts
    from before them, so they arrive at once. The last resourceVersion."""
    fake.add(resource_slice("slice-1", pool="pool-a", devices=DEVICES))
    SyncState.objects.create(cluster=cluster, kind="ResourceClaim", resource_version="1")
    last = ""
    for index in range(20):
        name = f"job-{index}"
        fake.add(claim(name))
        fake.modify(claim(name, device=("pool-a", DEVICES[index % 3])))
        last = fake.delete("ResourceClaim", name, namespace=NAMESPACE) if index % 2 else last
        if not index % 2:
            last = fake.modify(claim(name, device=("pool-a", DEVICES[index % 3]), version=9))
    return last


@pytest.mark.django_db(transaction=True)
def test_a_backlog_is_applied_in_batches_with_its_last_resource_version(
    fake: FakeKube, api_client: Any, cluster: Cluster, backlog: str
) -> None:
    with running_sync(api_client, cluster, "ResourceClaim"):
        wait_until(
            lambda: SyncState.objects.get(kind="ResourceClaim").resource_version == backlog,
            "the backlog applied",
            seconds=20.0,
        )

    state = SyncState.objects.get(kind="ResourceClaim")
    assert state.events_applied == 60
    claims = ResourceClaim.objects.filter(cluster=cluster)
    assert claims.count() == 20
    assert claims.filter(released_at__isnull=True).count() == 10
    # Each event keeps the time it was read: a claim's allocation starts before it ends.
    for start, end in Allocation.objects.filter(cluster=cluster, end__isnull=False).values_list(
        "start", "end"
    ):
        assert end is not None and start <= end
    assert Allocation.objects.filter(end__isnull=True).count() == 10


@pytest.mark.django_db(transaction=True)
def test_a_batch_the_database_fails_is_applied_again_and_loses_nothing(
    fake: FakeKube,
    api_client: Any,
    cluster: Cluster,
    backlog: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    apply = services.apply_watch_events
    calls: list[int] = []

    def failing_once(**kwargs: Any) -> services.SyncReport:
        calls.append(len(kwargs["events"]))
        if len(calls) == 1:
            raise OperationalError("the server closed the connection unexpectedly")
        return apply(**kwargs)

    monkeypatch.setattr(services, "apply_watch_events", failing_once)
    with running_sync(api_client, cluster, "ResourceClaim"):
        wait_until(
            lambda: SyncState.objects.get(kind="ResourceClaim").resource_version == backlog,
            "the backlog applied after the failure",
            seconds=20.0,
        )

    assert len(calls) >= 2
    state = SyncState.objects.get(kind="ResourceClaim")
    assert state.events_applied == 60
    assert ResourceClaim.objects.filter(cluster=cluster).count() == 20
    assert Allocation.objects.filter(end__isnull=True).count() == 10
