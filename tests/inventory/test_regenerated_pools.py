"""A pool a driver republishes unchanged but for its generation (issue 22): the watch moves its
devices' generation without counting the pool again, and leaves every device as counting it
would. A list after any mix of such events and real changes finds nothing to change.
"""

from __future__ import annotations

import copy
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory import services, simulate
from inventory.models import Device, Pool
from tests.quota.fixtures import AT

# What a device row holds, but its id and when it was first seen.
COLUMNS = [
    field.attname
    for field in Device._meta.concrete_fields
    if field.attname not in ("id", "first_seen", "cluster_id")
]


def fleet(seed: int = 1) -> list[dict[str, Any]]:
    """Slices of the simulated fleet's layouts: whole GPUs, MIG and (seed 1) a partitionable
    GPU whose pool is a counter slice and a device slice; seed 3 has only pools of one
    slice."""
    return [
        obj
        for obj in simulate.generate(nodes=8, seed=seed, now=AT)
        if obj["kind"] in ("DeviceClass", "Node", "ResourceSlice")
    ]


def test_the_fleets_have_the_pools_the_tests_say() -> None:
    for seed, most in ((1, 2), (3, 1)):
        pools = Counter(
            obj["spec"]["pool"]["name"] for obj in fleet(seed) if obj["kind"] == "ResourceSlice"
        )
        assert max(pools.values()) == most


def slices_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "ResourceSlice"}


def rows() -> dict[tuple[str, str, str], dict[str, Any]]:
    return {
        (row["driver"], row["pool"], row["name"]): row
        for row in Device.objects.filter(gone_at__isnull=True).values(*COLUMNS)
    }


def event(obj: dict[str, Any], minutes: int) -> services.WatchEvent:
    obj = copy.deepcopy(obj)
    obj["metadata"]["resourceVersion"] = str(1000 + minutes)
    return services.WatchEvent(
        event_type="MODIFIED", obj=obj, at=AT + timedelta(hours=1, minutes=minutes)
    )


def bumped(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["spec"]["pool"]["generation"] = obj["spec"]["pool"].get("generation", 0) + 1
    return obj


def pool_slices(current: dict[str, dict[str, Any]], name: str) -> list[str]:
    """The slices of the pool `name` is in (a pool's generation is moved in all of them)."""
    pool = current[name]["spec"]["pool"]["name"]
    return sorted(n for n, obj in current.items() if obj["spec"]["pool"]["name"] == pool)


def relisted() -> services.SyncReport:
    """A full list of the slices as they are now, which counts every pool again."""
    return services.import_snapshot(
        cluster=services.get_cluster("default"),
        objects=[*STATE.values()],
        at=AT + timedelta(hours=3),
        kinds=["ResourceSlice"],
    )


STATE: dict[str, dict[str, Any]] = {}


@pytest.mark.django_db
def test_a_pool_republished_unchanged_is_carried_and_a_list_finds_nothing_to_change() -> None:
    """Pools of one slice. A pool of several is counted again as before: the watch applies
    events of one pool in runs of their own, so its slices are never all in hand at once."""
    objects = fleet(seed=3)
    cluster = services.get_cluster("default")
    assert services.import_snapshot(cluster=cluster, objects=objects, at=AT).errors == []
    STATE.clear()
    STATE.update(slices_of(objects))
    before = rows()
    every = [bumped(obj) for obj in STATE.values()]
    with CaptureQueriesContext(connection) as queries:
        report = services.apply_watch_events(
            cluster=cluster, events=[event(obj, i) for i, obj in enumerate(every)]
        )
    assert report.errors == []
    # Carried: the devices' JSON columns were never read back to be compared.
    assert not any('"inventory_device"."attributes"' in query["sql"] for query in queries)
    STATE.update(slices_of(every))
    after = rows()
    assert after.keys() == before.keys()
    for key, row in after.items():
        assert row == {**before[key], "pool_generation": before[key]["pool_generation"] + 1}
    assert report.updated["Device"] == len(after)
    assert all(pool.counted_generation == pool.newest_generation for pool in Pool.objects.all())
    again = relisted()
    assert (again.created["Device"], again.updated["Device"], again.gone["Device"]) == (0, 0, 0)
    assert rows() == after


# One step: republish a pool unchanged, or with a device's attribute changed, or without its
# last device, or only one slice of a pool of two (its generation incomplete until the other).
STEPS = st.lists(
    st.tuples(st.sampled_from(["same", "attribute", "fewer", "half"]), st.integers(0, 1000)),
    min_size=1,
    max_size=8,
)


@pytest.mark.django_db
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS, batch=st.booleans())
def test_any_mix_of_republished_and_changed_pools_leaves_what_a_list_counts(
    steps: list[tuple[str, int]], batch: bool
) -> None:
    """Applied as watch events (one batch, or one batch each), then listed: the list changes
    no device, so the watch left each as counting the pools from scratch would."""
    from django.db import transaction

    with transaction.atomic():
        objects = fleet()
        cluster = services.get_cluster("default")
        assert services.import_snapshot(cluster=cluster, objects=objects, at=AT).errors == []
        STATE.clear()
        STATE.update(slices_of(objects))
        events: list[services.WatchEvent] = []
        for n, (step, pick) in enumerate(steps):
            names = sorted(STATE)
            name = names[pick % len(names)]
            members = pool_slices(STATE, name)
            if step == "half":
                members = members[:1]
            for member in members:
                obj = bumped(STATE[member])
                devices = obj["spec"].get("devices") or []
                if member == name and devices and step == "attribute":
                    device = devices[-1]
                    attributes = device.get("attributes") or device.get("basic", {}).get(
                        "attributes", {}
                    )
                    attributes["tally.test/step"] = {"int": n}
                elif member == name and len(devices) > 1 and step == "fewer":
                    obj["spec"]["devices"] = devices[:-1]
                STATE[member] = obj
                events.append(event(obj, len(events)))
        if batch:
            report = services.apply_watch_events(cluster=cluster, events=events)
            assert report.errors == []
        else:
            for one in events:
                assert services.apply_watch_events(cluster=cluster, events=[one]).errors == []
        watched = rows()
        again = relisted()
        assert (again.created["Device"], again.updated["Device"], again.gone["Device"]) == (
            0,
            0,
            0,
        )
        assert rows() == watched
        transaction.set_rollback(True)
