"""Sync warnings: what the sync stored but cannot trust, found in the stored slices and pools,
and reported by `sync_inventory` (a dump and the live API), `fleet_report` and the API."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from devtools.fake_kube import FakeKube
from inventory import checks, services
from inventory.dumps import iter_objects
from inventory.models import Cluster, Device
from inventory.selectors import fleet_report
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

DRIVER = "gpu.example.com"
AT = datetime(2026, 6, 1, 12, tzinfo=UTC)


def device(name: str, counter_set: str = "", **counters: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": "Example X1"}},
        "capacity": {"memory": {"value": "80Gi"}},
    }
    if counter_set:
        entry["consumesCounters"] = [
            {
                "counterSet": counter_set,
                "counters": {key: {"value": value} for key, value in counters.items()},
            }
        ]
    return entry


def resource_slice(
    name: str,
    *devices: dict[str, Any],
    pool: str = "node-a",
    generation: int = 1,
    count: int = 1,
    counter_sets: dict[str, dict[str, str]] | None = None,
    api_version: str = "resource.k8s.io/v1",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": DRIVER,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
        "nodeName": pool,
        "devices": list(devices),
    }
    if counter_sets is not None:
        spec["sharedCounters"] = [
            {"name": set_name, "counters": {key: {"value": v} for key, v in counters.items()}}
            for set_name, counters in counter_sets.items()
        ]
    return {
        "apiVersion": api_version,
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def load(*objects: dict[str, Any], cluster: str = "lab") -> services.SyncReport:
    return services.import_snapshot(cluster=services.get_cluster(cluster), objects=objects, at=AT)


def found(cluster: Cluster | None = None) -> list[tuple[str, str, int | None, list[str]]]:
    return [
        (warning["check"], warning["pool"], warning["generation"], warning["devices"])
        for warning in checks.sync_warnings(cluster=cluster)
    ]


def messages() -> list[str]:
    return [warning["message"] for warning in checks.sync_warnings()]


# -- incomplete pools ---------------------------------------------------------------------


def test_a_pool_never_complete_is_reported_and_counts_nothing() -> None:
    load(resource_slice("node-a-0", device("gpu-0"), count=2))

    assert found() == [("incomplete_pool", "node-a", 1, [])]
    assert messages() == [
        "pool gpu.example.com/node-a: generation 1 is incomplete (1 of 2 slices seen); "
        "no generation of it is complete yet, so none of its devices are counted"
    ]
    assert not Device.objects.exists()


def test_a_newer_incomplete_generation_names_the_one_still_counted() -> None:
    first = resource_slice("node-a-0", device("gpu-0"), count=2)
    second = resource_slice("node-a-1", device("gpu-1"), count=2)
    load(first, second)
    assert found() == []

    # The driver moved to generation 2; one of its two slices has been updated so far.
    moved = resource_slice("node-a-0", device("gpu-0"), device("gpu-2"), generation=2, count=2)
    load(moved, second)

    assert messages() == [
        "pool gpu.example.com/node-a: generation 2 is incomplete (1 of 2 slices seen); "
        "its devices are still counted from generation 1"
    ]
    assert set(Device.objects.filter(gone_at=None).values_list("name", flat=True)) == {
        "gpu-0",
        "gpu-1",
    }
    # Once its second slice arrives the warning goes.
    load(moved, resource_slice("node-a-1", device("gpu-1"), generation=2, count=2))
    assert found() == []


# -- duplicate device names ---------------------------------------------------------------


def test_a_device_name_published_twice_in_a_pool_generation() -> None:
    report = load(
        resource_slice("node-a-0", device("gpu-0"), device("gpu-1"), count=2),
        resource_slice("node-a-1", device("gpu-1"), device("gpu-2"), count=2),
        resource_slice("node-b-0", device("gpu-1"), pool="node-b"),
    )

    # The same name in another pool is another device.
    assert found() == [("duplicate_device", "node-a", 1, ["gpu-1"])]
    assert messages() == [
        "pool gpu.example.com/node-a generation 1: device gpu-1 published more than once "
        "(slices node-a-0, node-a-1); the scheduler allocates no device of the pool"
    ]
    # The sync counted it once and said so for that run; the warning stays while it lasts.
    assert Device.objects.filter(pool="node-a", name="gpu-1").count() == 1
    assert len(report.errors) == 1


def test_a_slice_name_listed_twice_in_a_dump_is_reported_and_the_last_kept() -> None:
    """Slice names are unique in a cluster, so only a dump can repeat one (files concatenated,
    two clusters' dumps mixed): the stored rows cannot show it, the import says it."""
    first = resource_slice("node-a-0", device("gpu-0"))
    second = resource_slice("node-a-0", device("gpu-0"), device("gpu-1"), generation=2)
    report = load(first, dict(first), second)  # the same listing twice is no conflict
    assert report.errors == [
        "ResourceSlice node-a-0: listed twice with different contents (pool "
        "gpu.example.com/node-a generation 1, then gpu.example.com/node-a generation 2); "
        "the last listing is kept"
    ]
    assert sorted(Device.objects.values_list("name", flat=True)) == ["gpu-0", "gpu-1"]


def test_a_slice_listed_twice_alike_but_for_the_order_of_its_keys_is_no_conflict() -> None:
    """The import keeps a digest of each slice's spec, not the spec: two listings that differ
    only in the order of their JSON keys are the same, as they compare equal as objects."""
    first = resource_slice("node-a-0", device("gpu-0"), device("gpu-1"))
    reordered = json.loads(json.dumps(first))
    reordered["spec"] = dict(reversed(list(reordered["spec"].items())))
    reordered["spec"]["devices"] = [
        dict(reversed(list(d.items()))) for d in first["spec"]["devices"]
    ]
    assert list(reordered["spec"]) != list(first["spec"])
    assert load(first, reordered).errors == []
    changed = json.loads(json.dumps(first))
    changed["spec"]["devices"][1]["name"] = "gpu-2"
    assert len(load(first, changed, cluster="other").errors) == 1


def test_many_duplicates_are_one_line_naming_the_first_few() -> None:
    names = [f"gpu-{index}" for index in range(5)]
    load(
        resource_slice("node-a-0", *map(device, names), count=2),
        # A slice the driver published twice under two names.
        resource_slice("node-a-0-again", *map(device, names), count=2),
    )

    [warning] = checks.sync_warnings()
    assert warning["devices"] == names
    assert "devices gpu-0, gpu-1, gpu-2 and 2 more published more than once" in (warning["message"])


# -- counter sets ---------------------------------------------------------------------------


def test_a_counter_set_no_slice_publishes_and_counters_it_lacks() -> None:
    load(
        resource_slice(
            "node-a-counters", count=2, counter_sets={"gpu-0-counters": {"memory": "80Gi"}}
        ),
        resource_slice(
            "node-a-devices",
            device("gpu-0", "gpu-0-counters", memory="80Gi"),
            device("gpu-0-half", "gpu-0-counters", memory="40Gi", cores="54"),
            device("gpu-0-huge", "gpu-0-counters", memory="160Gi"),
            # A typo'd set: nothing limits what these hand out.
            device("gpu-1-half-0", "gpu-1-countres", memory="40Gi"),
            device("gpu-1-half-1", "gpu-1-countres", memory="40Gi"),
            count=2,
        ),
    )

    assert found() == [
        ("missing_counter_set", "node-a", 1, ["gpu-1-half-0", "gpu-1-half-1"]),
        ("unknown_counter", "node-a", 1, ["gpu-0-half"]),
        ("counter_over_set", "node-a", 1, ["gpu-0-huge"]),
    ]
    assert messages() == [
        "pool gpu.example.com/node-a generation 1: counter set 'gpu-1-countres', consumed by "
        "devices gpu-1-half-0, gpu-1-half-1, is published by no slice",
        "pool gpu.example.com/node-a generation 1: counter 'cores', consumed by device "
        "gpu-0-half, is not in set 'gpu-0-counters'",
        "pool gpu.example.com/node-a generation 1: counter 'memory' of set 'gpu-0-counters' "
        "holds less than consumed by device gpu-0-huge, which can never be allocated",
    ]


def test_v1beta1_counters_under_basic_are_checked_too() -> None:
    beta = resource_slice("node-a-0", count=1, api_version="resource.k8s.io/v1beta1")
    beta["spec"]["devices"] = [
        {"name": "gpu-0-half", "basic": device("ignored", "nowhere", memory="40Gi")}
    ]
    del beta["spec"]["devices"][0]["basic"]["name"]
    load(beta)

    assert found() == [("missing_counter_set", "node-a", 1, ["gpu-0-half"])]


def test_a_counter_set_in_a_slice_not_seen_yet_is_not_reported_missing() -> None:
    load(resource_slice("node-a-devices", device("gpu-0-half", "gpu-0", memory="40Gi"), count=2))

    # Only the incomplete pool: the set may well be in the other slice.
    assert [check for check, *_ in found()] == ["incomplete_pool"]


def test_a_sound_partitionable_pool_has_no_warnings() -> None:
    load(*iter_objects(DRA / "partitionable-slices.yaml"))
    assert found() == []


def test_warnings_are_per_cluster() -> None:
    load(resource_slice("node-a-0", device("gpu-0"), count=2), cluster="east")
    load(resource_slice("node-a-0", device("gpu-0")), cluster="west")

    assert [warning["cluster"] for warning in checks.sync_warnings()] == ["east"]
    assert found(Cluster.objects.get(name="west")) == []


# -- reported by sync_inventory, fleet_report and the API -----------------------------------


def broken_pool() -> list[dict[str, Any]]:
    """A pool with a dangling counter set and a duplicate device; another pool incomplete."""
    return [
        resource_slice("node-a-0", device("gpu-0"), device("gpu-0-half", "gone", memory="1Gi")),
        resource_slice("node-b-0", device("gpu-0"), device("gpu-0"), pool="node-b"),
        resource_slice("node-c-0", device("gpu-0"), pool="node-c", count=3),
    ]


def test_sync_inventory_from_a_dump_warns_on_stderr_and_counts_in_its_summary(
    tmp_path: Path,
) -> None:
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": broken_pool()}))
    out, err = io.StringIO(), io.StringIO()

    # The duplicate is also rejected by the sync itself, so the command fails on it.
    with pytest.raises(CommandError, match="1 object"):
        call_command("sync_inventory", "--from-file", str(dump), stdout=out, stderr=err)

    warnings = [line for line in err.getvalue().splitlines() if line.startswith("warning: ")]
    assert warnings == [
        "warning: pool gpu.example.com/node-a generation 1: counter set 'gone', consumed by "
        "device gpu-0-half, is published by no slice",
        "warning: pool gpu.example.com/node-b generation 1: device gpu-0 published more than "
        "once (slices node-b-0); the scheduler allocates no device of the pool",
        "warning: pool gpu.example.com/node-c: generation 1 is incomplete (1 of 3 slices seen); "
        "no generation of it is complete yet, so none of its devices are counted",
    ]
    assert (
        "Sync warnings: 3 (incomplete pools: 1, duplicate device names: 1, "
        "missing counter sets: 1)" in out.getvalue()
    )


def test_sync_inventory_once_against_the_api_warns(fake: FakeKube, kubeconfig: Path) -> None:
    for obj in broken_pool()[::2]:
        fake.add(obj)
    out, err = io.StringIO(), io.StringIO()

    call_command(
        "sync_inventory",
        "--once",
        "--kubeconfig",
        str(kubeconfig),
        "--kinds",
        "ResourceSlice",
        stdout=out,
        stderr=err,
    )

    assert err.getvalue().count("warning: ") == 2
    assert "counter set 'gone'" in err.getvalue()
    assert "Sync warnings: 2 (incomplete pools: 1, missing counter sets: 1)" in out.getvalue()


def test_a_clean_sync_says_so(tmp_path: Path) -> None:
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps(resource_slice("node-a-0", device("gpu-0"))))
    out, err = io.StringIO(), io.StringIO()

    call_command("sync_inventory", "--from-file", str(dump), stdout=out, stderr=err)

    assert "Sync warnings: none" in out.getvalue()
    assert "warning" not in err.getvalue()


def test_fleet_report_lists_the_warnings() -> None:
    load(*broken_pool())

    report = fleet_report()
    assert [row["check"] for row in report["sync_warnings"]] == [
        "missing_counter_set",
        "duplicate_device",
        "incomplete_pool",
    ]
    assert json.loads(json.dumps(report)) == report

    table = io.StringIO()
    call_command("fleet_report", stdout=table)
    text = table.getvalue()
    assert "Sync warnings (3)" in text
    assert "  lab: pool gpu.example.com/node-c: generation 1 is incomplete" in text


def test_fleet_report_table_without_warnings() -> None:
    table = io.StringIO()
    call_command("fleet_report", stdout=table)
    assert "Sync warnings (0)\n  none" in table.getvalue()


def test_api_summary_lists_the_warnings(client: Client, django_user_model) -> None:
    load(*broken_pool())
    client.force_login(django_user_model.objects.create_superuser("op", "op@example.com", None))

    response = client.get("/api/v1/inventory/summary/", {"cluster": "lab"})

    assert response.status_code == 200, response.content
    [missing, duplicate, incomplete] = response.json()["sync_warnings"]
    assert (incomplete["check"], incomplete["pool"], incomplete["generation"]) == (
        "incomplete_pool",
        "node-c",
        1,
    )
    assert duplicate["devices"] == ["gpu-0"]
    assert missing["message"].startswith("pool gpu.example.com/node-a generation 1: ")
