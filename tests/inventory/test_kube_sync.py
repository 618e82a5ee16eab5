"""The live sync, through the real `kubernetes` client, against `devtools.fake_kube` over HTTP.

Tests whose sync runs in threads use `transaction=True`, so the threads' writes are visible.
The sync retries a failed write, and `wait_until` polls again after a failed read.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import OperationalError, connection
from django.utils import timezone

from db.embedded import postgres_url
from devtools.fake_kube import FakeKube, RecordedRequest
from inventory import kube, kube_sync, services
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    Node,
    ResourceClaim,
    ResourceSlice,
    SyncState,
)
from tests.conftest import REPO
from tests.fixtures import DRA

DRIVER = "gpu.nvidia.com"
QUICK_BACKOFF = kube.Backoff(initial_seconds=0.01, maximum_seconds=0.05)
# How long to wait for a background sync step (every wait returns as soon as it is done): a
# bound, not a measure, generous for a busy two-core machine.
WAIT_SECONDS = 30.0
# A process of its own imports Django and the project before its first request: on a busy
# two-core machine that alone has taken more than 5 s. A bound, not a measure.
PROCESS_SECONDS = 60.0


# Objects as the NVIDIA DRA driver and the scheduler publish them -------------------------


def gpu(name: str, node: str) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{name}')}"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "driverVersion": {"version": "580.82.7"},
            "cudaDriverVersion": {"version": "13.0.0"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }


def resource_slice(node: str, *devices: str, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-x7k2p"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [gpu(device, node) for device in devices or ("gpu-0",)],
        },
    }


def slice_name(node: str) -> str:
    return str(resource_slice(node)["metadata"]["name"])


def claim(name: str, *, node: str, device: str, namespace: str = "team-a") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": node, "device": device}
                    ]
                }
            }
        },
    }


def node(name: str, clique: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.clique": clique}},
    }


def device_class() -> dict[str, Any]:
    expression = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


# Fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(autouse=True)
def sync_settings(settings: Any) -> None:
    settings.TALLY_SYNC_PAGE_SIZE = 2
    settings.TALLY_SYNC_WATCH_TIMEOUT_SECONDS = 30


@contextmanager
def running_sync(api_client: Any, cluster: Cluster, *kinds: str) -> Iterator[None]:
    """The live sync in a background thread, stopped (and checked stopped) on exit."""
    stop = threading.Event()
    thread = threading.Thread(
        target=kube_sync.sync,
        kwargs={
            "api_client": api_client,
            "cluster": cluster,
            "kinds": kinds,
            "stop": stop,
            "backoff": QUICK_BACKOFF,
        },
        daemon=True,
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive(), "the sync did not stop"


def wait_until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            if condition():
                return
        except OperationalError:
            pass  # a read that failed (the connection, not the condition): poll again
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_SECONDS}s waiting for {what}")
        time.sleep(0.02)


def present_devices(cluster: Cluster) -> set[tuple[str, str]]:
    rows = Device.objects.filter(cluster=cluster, gone_at__isnull=True)
    return set(rows.values_list("pool", "name"))


def sync_state(cluster: Cluster, kind: str) -> SyncState:
    return SyncState.objects.get(cluster=cluster, kind=kind)


def watching(kind: str, resource_version: str | None = None) -> Callable[[RecordedRequest], bool]:
    def match(request: RecordedRequest) -> bool:
        return (
            request.watch
            and request.kind == kind
            and request.status == 200
            and resource_version in (None, request.query.get("resourceVersion"))
        )

    return match


def wait_watching(fake: FakeKube, kind: str, resource_version: str | None = None) -> None:
    fake.wait_for_request(watching(kind, resource_version), timeout=WAIT_SECONDS)


# LIST -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_once_lists_in_pages_and_imports_every_object(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    nodes = [f"node-{index}" for index in range(5)]
    for name in nodes:
        fake.add(resource_slice(name))

    reports = kube_sync.sync(
        api_client=api_client, cluster=cluster, kinds=["ResourceSlice"], once=True
    )

    pages = fake.lists("ResourceSlice")
    assert [request.query.get("limit") for request in pages] == ["2", "2", "2"]
    assert ["continue" in request.query for request in pages] == [False, True, True]
    assert present_devices(cluster) == {(name, "gpu-0") for name in nodes}
    assert reports["ResourceSlice"].created["ResourceSlice"] == 5
    state = sync_state(cluster, "ResourceSlice")
    assert (state.resource_version, state.relists) == (fake.resource_version, 1)
    assert not fake.watches("ResourceSlice")


@pytest.mark.django_db
def test_list_starts_over_when_its_continue_token_expires(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    for index in range(5):
        fake.add(resource_slice(f"node-{index}"))

    def change_and_compact_between_pages(request: RecordedRequest) -> None:
        if "continue" in request.query and fake.on_request is not None:
            fake.on_request = None
            fake.add(resource_slice("node-5"))
            fake.compact()

    fake.on_request = change_and_compact_between_pages

    kube_sync.sync(api_client=api_client, cluster=cluster, kinds=["ResourceSlice"], once=True)

    statuses = [
        (request.status, "continue" in request.query) for request in fake.lists("ResourceSlice")
    ]
    assert statuses[:2] == [(200, False), (410, True)]
    assert statuses[2] == (200, False), "the list must start over from the first page"
    assert present_devices(cluster) == {(f"node-{index}", "gpu-0") for index in range(6)}
    assert sync_state(cluster, "ResourceSlice").resource_version == fake.resource_version


# WATCH ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_watch_applies_added_modified_and_deleted(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    fake.add(resource_slice("node-a", "gpu-0", "gpu-1"))
    with running_sync(api_client, cluster, "ResourceSlice", "ResourceClaim"):
        wait_watching(fake, "ResourceSlice")
        wait_watching(fake, "ResourceClaim")

        fake.add(claim("train", node="node-a", device="gpu-0"))
        wait_until(
            lambda: Allocation.objects.filter(
                claim__name="train", device__name="gpu-0", end__isnull=True
            ).exists(),
            "the claim's allocation of gpu-0",
        )

        fake.modify(resource_slice("node-a", "gpu-0", "gpu-1", "gpu-2", generation=2))
        wait_until(
            lambda: present_devices(cluster) == {("node-a", f"gpu-{i}") for i in range(3)},
            "gpu-2 added by the modified slice",
        )

        fake.delete("ResourceClaim", "train", namespace="team-a")
        wait_until(
            lambda: ResourceClaim.objects.filter(name="train", released_at__isnull=False).exists(),
            "the deleted claim released",
        )
        assert not Allocation.objects.filter(claim__name="train", end__isnull=True).exists()

        deleted_at = fake.delete("ResourceSlice", slice_name("node-a"))
        wait_until(lambda: not present_devices(cluster), "the deleted slice's devices gone")

    assert ResourceSlice.objects.get(name=slice_name("node-a")).gone_at is not None
    assert Device.objects.filter(cluster=cluster, gone_at__isnull=True).count() == 0
    state = sync_state(cluster, "ResourceSlice")
    assert (state.resource_version, state.events_applied) == (deleted_at, 2)


@pytest.mark.django_db(transaction=True)
def test_bookmarks_advance_the_stored_resource_version(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    fake.add(resource_slice("node-a"))
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice")
        # A change to another kind moves the server on without an event for slices.
        later = fake.add(node("node-a", "clique-1"))

        def bookmarked() -> bool:
            # Offered again on each poll: a stream restarted after a failed write would
            # otherwise never get one.
            fake.send_bookmarks()
            return sync_state(cluster, "ResourceSlice").resource_version == later

        wait_until(bookmarked, f"the bookmark's resourceVersion {later} stored")

    watch = fake.watches("ResourceSlice")[0]
    assert watch.query["allowWatchBookmarks"].lower() == "true"
    assert sync_state(cluster, "ResourceSlice").events_applied == 0


@pytest.mark.django_db(transaction=True)
def test_a_restart_resumes_the_watch_from_the_stored_resource_version(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    fake.add(resource_slice("node-a"))
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice")
        stored = fake.add(resource_slice("node-b"))
        wait_until(lambda: ("node-b", "gpu-0") in present_devices(cluster), "node-b's slice")
    assert sync_state(cluster, "ResourceSlice").resource_version == stored

    fake.add(resource_slice("node-c"))  # while no sync runs
    received_before = len(fake.requests)
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_until(lambda: ("node-c", "gpu-0") in present_devices(cluster), "node-c's slice")

    after_restart = fake.requests[received_before:]
    assert after_restart[0].watch
    assert after_restart[0].query["resourceVersion"] == stored
    assert not [request for request in after_restart if not request.watch], "no list again"
    assert sync_state(cluster, "ResourceSlice").relists == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
def test_gone_relists_and_reconciles_what_changed_while_away(
    fake: FakeKube, api_client: Any, cluster: Cluster, gone_as_http: bool
) -> None:
    fake.gone_as_http = gone_as_http
    fake.add(resource_slice("node-a"))
    fake.add(resource_slice("node-b"))
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice")
    stale = sync_state(cluster, "ResourceSlice").resource_version

    fake.delete("ResourceSlice", slice_name("node-a"))
    fake.add(resource_slice("node-c"))
    fake.compact()
    received_before = len(fake.requests)
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice", fake.resource_version)
        wait_until(
            lambda: present_devices(cluster) == {("node-b", "gpu-0"), ("node-c", "gpu-0")},
            "node-a gone and node-c present",
        )

    expired, relisted = fake.requests[received_before : received_before + 2]
    assert expired.watch and expired.query["resourceVersion"] == stale
    assert not relisted.watch
    assert expired.status == (410 if gone_as_http else 200)
    assert ResourceSlice.objects.get(name=slice_name("node-a")).gone_at is not None
    assert sync_state(cluster, "ResourceSlice").relists == 2


@pytest.mark.django_db(transaction=True)
def test_a_dropped_stream_is_resumed_without_losing_events(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    fake.add(resource_slice("node-a"))
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice")
        last_seen = fake.add(resource_slice("node-b"))
        wait_until(
            lambda: sync_state(cluster, "ResourceSlice").resource_version == last_seen,
            "node-b's event applied",
        )

        received_before = len(fake.requests)
        fake.drop_streams(partial=True)
        fake.add(resource_slice("node-c"))
        fake.modify(resource_slice("node-b", "gpu-0", "gpu-1", generation=2))
        wait_until(
            lambda: {("node-c", "gpu-0"), ("node-b", "gpu-1")} <= present_devices(cluster),
            "the events sent after the drop",
        )

    resumed = fake.requests[received_before]
    assert resumed.watch and resumed.query["resourceVersion"] == last_seen
    assert sync_state(cluster, "ResourceSlice").relists == 1


@pytest.mark.django_db(transaction=True)
def test_an_unavailable_server_is_retried_with_backoff_then_relisted_when_too_old(
    fake: FakeKube, api_client: Any, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    fake.add(resource_slice("node-a"))
    fake.add(resource_slice("node-b"))
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice")
        fake.unavailable = True
        fake.drop_streams(partial=False)

        def refused() -> int:
            return sum(1 for request in fake.watches("ResourceSlice") if request.status == 503)

        wait_until(lambda: refused() >= 3, "three refused watches")
        fake.delete("ResourceSlice", slice_name("node-a"))
        fake.compact()
        fake.unavailable = False
        wait_until(lambda: present_devices(cluster) == {("node-b", "gpu-0")}, "node-a marked gone")

    assert sync_state(cluster, "ResourceSlice").relists == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ResourceSlice" in message and "503" in message for message in warnings)


@pytest.mark.django_db(transaction=True)
def test_a_watch_that_times_out_is_started_again_from_the_same_version(
    fake: FakeKube, api_client: Any, cluster: Cluster, settings: Any
) -> None:
    settings.TALLY_SYNC_WATCH_TIMEOUT_SECONDS = 1
    fake.add(resource_slice("node-a"))
    with running_sync(api_client, cluster, "ResourceSlice"):
        listed = fake.wait_for_request(
            lambda r: r.kind == "ResourceSlice" and not r.watch, timeout=WAIT_SECONDS
        )
        wait_until(lambda: len(fake.watches("ResourceSlice")) >= 2, "a second watch")
        fake.add(resource_slice("node-b"))
        wait_until(lambda: ("node-b", "gpu-0") in present_devices(cluster), "node-b's slice")

    first, second = fake.watches("ResourceSlice")[:2]
    assert first.query["timeoutSeconds"] == "1"
    assert first.query["resourceVersion"] == second.query["resourceVersion"]
    assert listed.status == 200
    assert sync_state(cluster, "ResourceSlice").relists == 1


@pytest.mark.django_db(transaction=True)
def test_a_rejected_object_is_logged_and_the_watch_goes_on(
    fake: FakeKube, api_client: Any, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    broken = resource_slice("node-x")
    del broken["spec"]["pool"]
    with running_sync(api_client, cluster, "ResourceSlice"):
        wait_watching(fake, "ResourceSlice")
        fake.add(broken)
        good = fake.add(resource_slice("node-a"))
        wait_until(
            lambda: sync_state(cluster, "ResourceSlice").resource_version == good,
            "the event after the rejected one",
        )

    assert present_devices(cluster) == {("node-a", "gpu-0")}
    logged = [r.getMessage() for r in caplog.records if r.name == "inventory.kube"]
    assert any(
        "ResourceSlice" in message and "node-x" in message and "spec.pool" in message
        for message in logged
    ), logged


# The command ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_command_once_imports_every_kind(fake: FakeKube, kubeconfig: Path) -> None:
    fake.add(node("node-a", "clique-1"))
    fake.add(device_class())
    fake.add(resource_slice("node-a", "gpu-0", "gpu-1"))
    fake.add(claim("train", node="node-a", device="gpu-1"))
    out = io.StringIO()

    call_command(
        "sync_inventory", "--once", "--kubeconfig", str(kubeconfig), "--cluster", "lab", stdout=out
    )

    cluster = Cluster.objects.get(name="lab")
    assert Node.objects.get(cluster=cluster, name="node-a").clique == "clique-1"
    assert DeviceClass.objects.get(cluster=cluster, name=DRIVER).selectors
    assert present_devices(cluster) == {("node-a", "gpu-0"), ("node-a", "gpu-1")}
    allocation = Allocation.objects.get(claim__name="train")
    assert allocation.device is not None and allocation.device.name == "gpu-1"
    assert {request.kind for request in fake.requests} == set(services.KINDS)
    for kind in services.KINDS:
        assert kind in out.getvalue()
        assert sync_state(cluster, kind).resource_version == fake.resource_version


@pytest.mark.django_db(transaction=True)
def test_command_syncs_live_until_sigterm(fake: FakeKube, kubeconfig: Path) -> None:
    # A process of its own, as deployed, on the test database; a real signal to stop it.
    env = {**os.environ, "DATABASE_URL": postgres_url(connection.settings_dict), "DEBUG": "true"}
    manage = [sys.executable, str(REPO / "manage.py")]
    fake.add(resource_slice("node-a"))
    command = [
        *manage,
        "sync_inventory",
        "--kubeconfig",
        str(kubeconfig),
        "--kinds",
        "ResourceSlice",
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        fake.wait_for_request(watching("ResourceSlice", None), timeout=PROCESS_SECONDS)
        applied = fake.add(resource_slice("node-b"))

        def stored_resource_version() -> str | None:
            return SyncState.objects.values_list("resource_version", flat=True).first()

        wait_until(lambda: stored_resource_version() == applied, "node-b's event applied")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=PROCESS_SECONDS)
    finally:
        process.kill()
        process.wait(WAIT_SECONDS)

    assert process.returncode == 0, err.decode()
    assert "ResourceSlice: 1 created" in out.decode()


@pytest.mark.django_db
def test_command_once_fails_when_the_api_cannot_be_reached(
    fake: FakeKube, kubeconfig: Path
) -> None:
    fake.stop()
    with pytest.raises(CommandError, match="could not list ResourceSlice"):
        call_command(
            "sync_inventory", "--once", "--kubeconfig", str(kubeconfig), "--kinds", "ResourceSlice"
        )


@pytest.mark.django_db
def test_command_rejects_an_unknown_context(kubeconfig: Path) -> None:
    with pytest.raises(CommandError, match="elsewhere"):
        call_command(
            "sync_inventory", "--once", "--kubeconfig", str(kubeconfig), "--context", "elsewhere"
        )


@pytest.mark.django_db
def test_command_imports_a_dump_file_as_a_snapshot_at_the_given_time() -> None:
    dump = DRA / "example-driver-slices.yaml"
    out = io.StringIO()

    call_command(
        "sync_inventory", "--from-file", str(dump), "--at", "2025-01-02T03:04:05Z", stdout=out
    )

    devices = Device.objects.filter(driver="gpu.example.com", gone_at__isnull=True)
    assert sorted(devices.values_list("name", flat=True)) == [f"gpu-{i}" for i in range(8)]
    assert {device.first_seen for device in devices} == {datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)}
    assert "ResourceSlice" in out.getvalue()


@pytest.mark.django_db
def test_command_rejects_a_bad_at() -> None:
    dump = DRA / "example-driver-slices.yaml"
    with pytest.raises(CommandError, match="--at"):
        call_command("sync_inventory", "--from-file", str(dump), "--at", "yesterday")
    assert not Cluster.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("at", ["0001-01-01T00:00:00Z", "2999-01-01T00:00:00Z", "future"])
def test_command_refuses_a_snapshot_dated_before_1970_or_ahead_of_now(at: str) -> None:
    """A dump dated ahead would release the claims it lacks in the future (charged until
    then); one dated in year 1 is a typo. Both are refused before anything is written."""
    if at == "future":
        at = (timezone.now() + timedelta(hours=1)).isoformat()
    dump = DRA / "example-driver-slices.yaml"
    with pytest.raises(CommandError, match="a dump is a snapshot taken in the past"):
        call_command("sync_inventory", "--from-file", str(dump), "--at", at)
    assert not Cluster.objects.exists()


@pytest.mark.django_db
def test_command_loads_the_rest_of_a_dump_and_fails_on_a_rejected_object(
    tmp_path: Path,
) -> None:
    broken = resource_slice("node-x")
    del broken["spec"]["pool"]
    dump = tmp_path / "dump.json"
    dump.write_text(
        json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": [resource_slice("node-a"), broken]}
        )
    )
    err = io.StringIO()

    with pytest.raises(CommandError, match="1 object"):
        call_command("sync_inventory", "--from-file", str(dump), stderr=err, stdout=io.StringIO())

    assert present_devices(Cluster.objects.get()) == {("node-a", "gpu-0")}
    assert "node-x" in err.getvalue()
