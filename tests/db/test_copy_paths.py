"""`bulk_insert` and `insert_values` (COPY, values prepared by shortcuts) store what Django's
own save stores; `AnyOf` and `NoneOf` pick the same rows as `__in` and its negation, `AnyRowOf`
the rows whose columns hold one of its tuples exactly. On PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from db.bulk import AnyOf, AnyRowOf, NoneOf
from db.copy import bulk_insert, insert_values
from inventory.models import Cluster, Device, DeviceKind, Node

pytestmark = pytest.mark.django_db

AT = datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)
# What a JSON column may hold that orjson and `json.dumps` write differently (unicode, floats)
# or orjson refuses (an integer over 64 bits, a key that is not a string).
ATTRIBUTES: list[dict[Any, Any]] = [
    {"productName": {"string": "H100 “SXM” é\t\n\\"}, "x": {"int": 80}},
    {"f": 0.1, "big": 10**30, "nested": [None, True, 1.5e-7, {"a": []}]},
    {1: "a key that is no string"},
    {},
]


def _values(device: Device) -> tuple[Any, ...]:
    return tuple(
        getattr(device, field.attname)
        for field in Device._meta.concrete_fields
        if not field.primary_key and field.attname != "name"
    )


def _device(cluster: Cluster, node: Node, name: str, attributes: dict[Any, Any]) -> Device:
    return Device(
        cluster=cluster,
        node=node,
        driver="gpu.nvidia.com",
        pool="p",
        name=name,
        slice_name="s",
        pool_generation=2**40,
        kind=DeviceKind.GPU,  # a TextChoices member, not a plain str
        gpu_share=Decimal("0.142857"),
        attributes=attributes,
        capacity={"memory": {"value": "80Gi"}},
        memory_bytes=None,
        first_seen=AT,
    )


@pytest.mark.parametrize("attributes", ATTRIBUTES)
def test_copied_rows_read_back_as_saved_ones(attributes: dict[Any, Any]) -> None:
    cluster = Cluster.objects.create(name="a")
    node = Node.objects.create(cluster=cluster, name="n", first_seen=AT)
    _device(cluster, node, "saved", attributes).save()
    bulk_insert(Device, [_device(cluster, node, "copied", attributes)])
    row = {
        field.attname: getattr(_device(cluster, node, "as-row", attributes), field.attname)
        for field in Device._meta.concrete_fields
        if not field.primary_key and field.attname not in ("unit", "extra", "uuid")
    }  # fields left out take their defaults
    insert_values(Device, [row])
    saved, copied, as_row = (Device.objects.get(name=n) for n in ("saved", "copied", "as-row"))
    assert _values(copied) == _values(saved)
    assert _values(as_row) == _values(saved)
    assert (as_row.unit, as_row.extra, as_row.uuid) == ("gpu", {}, "")


def test_none_of_is_the_negation_of_any_of_and_empty_means_all() -> None:
    cluster = Cluster.objects.create(name="a")
    names = [f"n{index}" for index in range(50)]
    Node.objects.bulk_create(Node(cluster=cluster, name=name, first_seen=AT) for name in names)
    present = set(names[::3]) | {"not-stored"}
    assert (
        set(Node.objects.filter(NoneOf("name", present)).values_list("name", flat=True))
        == set(names) - present
    )
    assert set(Node.objects.filter(AnyOf("name", present)).values_list("name", flat=True)) == (
        present - {"not-stored"}
    )
    assert Node.objects.filter(NoneOf("name", [])).count() == 50
    assert Node.objects.filter(AnyOf("name", [])).count() == 0
    # Integers, over a foreign key's column.
    assert Node.objects.filter(NoneOf("cluster", [cluster.pk + 1])).count() == 50


# Few values per column, so that a tuple asked for often shares each of its values with others
# stored (the superset that `AnyOf` per column would pick) without being stored itself.
_NAMES = st.sampled_from(["a", "b", "c", "a b", "é", "'"])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    stored=st.sets(st.tuples(_NAMES, _NAMES, _NAMES), max_size=12),
    wanted=st.sets(st.tuples(_NAMES, _NAMES, _NAMES), max_size=12),
)
def test_any_row_of_picks_the_rows_holding_one_of_the_tuples(
    stored: set[tuple[str, str, str]], wanted: set[tuple[str, str, str]]
) -> None:
    # A cluster of its own per example: the examples share the test's transaction.
    cluster = Cluster.objects.create(name=f"c{Cluster.objects.count()}")
    node = Node.objects.create(cluster=cluster, name="n", first_seen=AT)
    devices = [_device(cluster, node, name, {}) for _, _, name in sorted(stored)]
    for device, (driver, pool, _) in zip(devices, sorted(stored), strict=True):
        device.driver, device.pool = driver, pool
    bulk_insert(Device, devices)
    rows = Device.objects.filter(AnyRowOf(("driver", "pool", "name"), wanted), cluster=cluster)
    assert set(rows.values_list("driver", "pool", "name")) == stored & wanted
    pairs = {(driver, pool) for driver, pool, _ in wanted}
    assert set(
        Device.objects.filter(AnyRowOf(("driver", "pool"), pairs), cluster=cluster).values_list(
            "driver", "pool", "name"
        )
    ) == {row for row in stored if row[:2] in pairs}
    # Over a foreign key's column (integers) and a text one.
    pools = {pool for _, pool in pairs}
    assert Device.objects.filter(
        AnyRowOf(("cluster", "pool"), [(cluster.pk, pool) for pool in pools]),
        node__cluster=cluster,
    ).count() == len([row for row in stored if row[1] in pools])
