"""Since when each sync warning has been true: an incomplete pool since its newest generation
was first seen, a finding in a pool generation's slices since that generation was first stored,
whatever syncs ran since (relists, slices updated in place, watch events in batches); shown by
`sync_inventory`, `fleet_report`, the API and the fleet page."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.urls import reverse

from inventory import checks, services
from inventory.models import Pool, ResourceSlice
from tests.inventory.test_checks import device, resource_slice

pytestmark = pytest.mark.django_db

T1 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
T2 = T1 + timedelta(hours=3)
T3 = T2 + timedelta(days=2)
DRIVER = "gpu.example.com"


def load(*objects: dict[str, Any], at: datetime) -> None:
    services.import_snapshot(
        cluster=services.get_cluster("lab"),
        objects=objects,
        at=at,
        kinds=["ResourceSlice"],
    )


def since() -> dict[tuple[str, str, int | None], str]:
    return {
        (warning["check"], warning["pool"], warning["generation"]): warning["since"]
        for warning in checks.sync_warnings()
    }


def iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def test_an_incomplete_pool_is_so_since_its_newest_generation_was_first_seen() -> None:
    complete = [resource_slice(f"node-a-{n}", device(f"gpu-{n}"), count=2) for n in range(2)]
    load(*complete, at=T1)
    assert since() == {}

    # The rollout of generation 2 starts at T2 with one of its two slices...
    moved = resource_slice("node-a-0", device("gpu-0"), generation=2, count=2)
    load(moved, complete[1], at=T2)
    assert since() == {("incomplete_pool", "node-a", 2): iso(T2)}

    # ...and is still stuck two days later: relists do not move the time.
    load(moved, complete[1], at=T3)
    assert since() == {("incomplete_pool", "node-a", 2): iso(T2)}
    assert Pool.objects.get().updated_at == T3

    # Generation 3, as incomplete, is a new rollout: since it was first seen.
    load(resource_slice("node-a-0", device("gpu-0"), generation=3, count=2), complete[1], at=T3)
    assert since() == {("incomplete_pool", "node-a", 3): iso(T3)}


def test_a_generations_findings_are_so_since_that_generation_was_first_stored() -> None:
    # A device published in two slices of generation 1, from T1.
    first = resource_slice("node-b-0", device("gpu-0"), pool="node-b", count=2)
    second = resource_slice("node-b-1", device("gpu-0"), pool="node-b", count=2)
    load(first, second, at=T1)
    assert since() == {("duplicate_device", "node-b", 1): iso(T1)}
    # A relist at T2 finds them unchanged.
    load(first, second, at=T2)
    assert since() == {("duplicate_device", "node-b", 1): iso(T1)}

    # Generation 2 keeps the duplicate, each slice updated in place (first seen at T1 still).
    load(
        resource_slice("node-b-0", device("gpu-0"), pool="node-b", generation=2, count=2),
        resource_slice("node-b-1", device("gpu-0"), pool="node-b", generation=2, count=2),
        at=T3,
    )
    assert since() == {("duplicate_device", "node-b", 2): iso(T3)}
    assert set(ResourceSlice.objects.values_list("first_seen", flat=True)) == {T1}


def test_a_slice_stored_again_under_another_api_version_keeps_its_time() -> None:
    sliced = resource_slice("node-c-0", device("gpu-0"), device("gpu-0"), pool="node-c")
    load(sliced, at=T1)
    load({**sliced, "apiVersion": "resource.k8s.io/v1beta2"}, at=T2)
    assert ResourceSlice.objects.get().api_version == "resource.k8s.io/v1beta2"
    assert since() == {("duplicate_device", "node-c", 1): iso(T1)}


def test_watch_events_in_one_batch_each_keep_their_own_time() -> None:
    cluster = services.get_cluster("lab")
    events = [
        services.WatchEvent(
            event_type="ADDED",
            obj=resource_slice("node-d-0", device("gpu-0"), pool="node-d", count=2),
            at=T1,
        ),
        services.WatchEvent(
            event_type="ADDED",
            obj=resource_slice("node-e-0", device("gpu-0", "missing", memory="1Gi"), pool="node-e"),
            at=T2,
        ),
        services.WatchEvent(
            event_type="MODIFIED",
            obj=resource_slice("node-d-0", device("gpu-0"), pool="node-d", generation=2, count=2),
            at=T3,
        ),
    ]
    report = services.apply_watch_events(cluster=cluster, events=events)
    assert not report.errors
    assert since() == {
        ("incomplete_pool", "node-d", 2): iso(T3),
        ("missing_counter_set", "node-e", 1): iso(T2),
    }


@pytest.mark.parametrize(
    ("age", "shown"),
    [
        (timedelta(seconds=42), "since 2026-12-04 10:00 UTC (42 s)"),
        (timedelta(minutes=59, seconds=59), "since 2026-12-04 10:00 UTC (59 min)"),
        (timedelta(hours=3, minutes=10), "since 2026-12-04 10:00 UTC (3 h)"),
        (timedelta(hours=47), "since 2026-12-04 10:00 UTC (47 h)"),
        (timedelta(days=9, hours=23), "since 2026-12-04 10:00 UTC (9 d)"),
    ],
)
def test_since_reads_as_a_time_and_an_age(age: timedelta, shown: str) -> None:
    assert checks.describe_since(iso(T1), now=T1 + age) == shown


def broken() -> list[dict[str, Any]]:
    return [resource_slice("node-f-0", device("gpu-0"), pool="node-f", count=3)]


def test_sync_inventory_and_fleet_report_say_since_when(tmp_path: Path) -> None:
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": broken()}))
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "sync_inventory", "--from-file", str(dump), "--at", iso(T1), stdout=out, stderr=err
    )
    lines = err.getvalue().splitlines()
    warning = lines.index(next(line for line in lines if line.startswith("warning: pool")))
    assert lines[warning + 1].startswith("  since 2026-12-04 10:00 UTC (")

    table = io.StringIO()
    call_command("fleet_report", stdout=table)
    assert "generation 1 is incomplete" in table.getvalue()
    assert "\n    since 2026-12-04 10:00 UTC (" in table.getvalue()
    as_json = io.StringIO()
    call_command("fleet_report", "--format", "json", stdout=as_json)
    [found] = json.loads(as_json.getvalue())["sync_warnings"]
    assert found["since"] == "2026-12-04T10:00:00Z"


def test_the_api_and_the_fleet_page_say_since_when(client: Client, django_user_model) -> None:
    load(*broken(), at=T1)
    client.force_login(django_user_model.objects.create_superuser("op", "op@example.com", None))

    response = client.get("/api/v1/inventory/summary/", {"cluster": "lab"})
    assert response.status_code == 200, response.content
    [found] = response.json()["sync_warnings"]
    assert found["since"] == "2026-12-04T10:00:00Z"

    page = client.get(reverse("fleet")).content.decode()
    assert '<span class="sync-warning-since">since 2026-12-04 10:00 UTC (' in page


@pytest.mark.django_db(transaction=True)
def test_the_migration_fills_in_the_times_of_rows_stored_before() -> None:
    before = [("inventory", "0007_node_shape_counts")]
    after = [("inventory", "0008_seen_times")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old_apps = executor.loader.project_state(before).apps
    cluster = old_apps.get_model("inventory", "Cluster").objects.create(name="lab")
    old_apps.get_model("inventory", "Pool").objects.create(
        cluster=cluster, driver=DRIVER, name="node-a", newest_generation=2, updated_at=T2
    )
    old_apps.get_model("inventory", "ResourceSlice").objects.create(
        cluster=cluster,
        name="node-a-0",
        api_version="resource.k8s.io/v1",
        driver=DRIVER,
        pool="node-a",
        generation=2,
        resource_slice_count=2,
        spec={},
        first_seen=T1,
    )

    executor = MigrationExecutor(connection)
    executor.migrate(after)
    # Read as of that migration: later ones add columns the models of today would ask for.
    new_apps = executor.loader.project_state(after).apps

    assert new_apps.get_model("inventory", "Pool").objects.get().newest_generation_seen_at == T2
    assert new_apps.get_model("inventory", "ResourceSlice").objects.get().generation_seen_at == T1
    # Back to the latest schema: migrating inventory back unapplied every app's migrations
    # that depend on it (billing's), and later tests on this database need them.
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
