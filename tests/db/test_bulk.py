"""`update_rows`: every column type it maps survives the arrays, NULLs included, on PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from db.bulk import update_instances, update_rows
from inventory.models import Cluster, DeviceShape, Pool
from metering.models import Sample
from teams.models import AuditEntry

pytestmark = pytest.mark.django_db

AT = datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)


def _shape(cluster: Cluster, key: str) -> DeviceShape:
    return DeviceShape.objects.create(cluster=cluster, key=key, driver="gpu.nvidia.com", kind="gpu")


def test_every_type_is_written_and_nulls_survive() -> None:
    cluster = Cluster.objects.create(name="a")
    other = Cluster.objects.create(name="b")
    first, second = _shape(cluster, "k1"), _shape(cluster, "k2")
    untouched = _shape(cluster, "k3")
    changed = update_rows(
        DeviceShape,
        ["cluster", "key", "gpu_share", "attributes", "allow_multiple_allocations", "unused_since"],
        [
            # Out of id order on purpose.
            (second.pk, cluster.pk, "k2", Decimal("0.142857"), {}, False, None),
            (first.pk, other.pk, "renamed", Decimal("0.5"), {"a": [1, None]}, True, AT),
        ],
    )
    assert changed == 2
    first.refresh_from_db()
    assert (first.cluster_id, first.key, first.gpu_share) == (other.pk, "renamed", Decimal("0.5"))
    assert (first.attributes, first.allow_multiple_allocations) == ({"a": [1, None]}, True)
    assert first.unused_since == AT
    second.refresh_from_db()
    assert (second.gpu_share, second.allow_multiple_allocations) == (Decimal("0.142857"), False)
    assert second.unused_since is None
    untouched.refresh_from_db()
    assert untouched.key == "k3"


def test_integers_and_bigints_with_nulls() -> None:
    cluster = Cluster.objects.create(name="a")
    pool = Pool.objects.create(
        cluster=cluster, driver="d", name="p", counted_generation=3, updated_at=AT
    )
    update_rows(
        Pool,
        ["counted_generation", "newest_generation", "slices_expected"],
        [(pool.pk, None, 2**40, 7)],
    )
    pool.refresh_from_db()
    assert (pool.counted_generation, pool.newest_generation, pool.slices_expected) == (
        None,
        2**40,
        7,
    )


def test_json_text_keeps_quotes_and_unicode_and_sql_null() -> None:
    tricky = {"quote": 'say "hi"', "back\\slash": "Grüße, 名前 🚀", "nested": ["'", None]}
    entries = [
        AuditEntry.objects.create(
            at=AT, actor="x", action="update", object_type="t", object_repr="r", before={}
        )
        for _ in range(2)
    ]
    update_rows(
        AuditEntry,
        ["before", "after", "actor"],
        [(entries[0].pk, tricky, None, 'o"neil ü'), (entries[1].pk, None, "a string", "y")],
    )
    entries[0].refresh_from_db()
    assert (entries[0].before, entries[0].after, entries[0].actor) == (tricky, None, 'o"neil ü')
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT before IS NULL, jsonb_typeof(after) FROM teams_auditentry WHERE id = %s",
            [entries[1].pk],
        )
        assert cursor.fetchone() == (True, "string")


def test_empty_input_sends_nothing() -> None:
    with CaptureQueriesContext(connection) as queries:
        assert update_rows(Pool, ["slices_seen"], []) == 0
        assert update_instances(Pool, [], ["slices_seen"]) == 0
    assert len(queries) == 0


def test_one_statement_in_id_order_and_only_where_still_null() -> None:
    cluster = Cluster.objects.create(name="a")
    shapes = [_shape(cluster, f"k{n}") for n in range(3)]
    DeviceShape.objects.filter(pk=shapes[1].pk).update(unused_since=AT)
    later = datetime(2026, 3, 2, tzinfo=UTC)
    with CaptureQueriesContext(connection) as queries:
        changed = update_rows(
            DeviceShape,
            ["unused_since"],
            [(shape.pk, later) for shape in reversed(shapes)],
            where_null=["unused_since"],
        )
    assert changed == 2
    assert len(queries) == 1
    assert f"'{{{shapes[0].pk},{shapes[1].pk},{shapes[2].pk}}}'" in queries[0]["sql"]
    assert [s.unused_since for s in DeviceShape.objects.order_by("pk")] == [later, AT, later]


def test_instances_write_their_foreign_keys_by_id() -> None:
    cluster, other = Cluster.objects.create(name="a"), Cluster.objects.create(name="b")
    shape = _shape(cluster, "k")
    shape.cluster = other
    assert update_instances(DeviceShape, [shape], ["cluster"]) == 1
    assert DeviceShape.objects.get(pk=shape.pk).cluster_id == other.pk


def test_a_field_type_without_an_array_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"cannot write Sample\.gpu_util \(FloatField\)"):
        update_rows(Sample, ["gpu_util"], [(1, 0.5)])


def test_json_documents_follow_the_rows_in_id_order() -> None:
    """Each JSON column travels as one document whose elements the rows take by position:
    rows given out of id order still get their own values, a JSON string "null" stays a
    string (only None is SQL NULL), and the values' quotes are not escaped one by one."""
    entries = [
        AuditEntry.objects.create(
            at=AT, actor="x", action="update", object_type="t", object_repr="r", before={}
        )
        for _ in range(12)
    ]
    values: dict[int, Any] = {
        entry.pk: {"n": n, "quoted": '"' * n, "list": [n, None]} for n, entry in enumerate(entries)
    }
    values[entries[3].pk] = "null"
    values[entries[7].pk] = None
    with CaptureQueriesContext(connection) as queries:
        update_rows(
            AuditEntry,
            ["before", "actor", "after"],
            [(pk, value, f"actor-{pk}", [pk]) for pk, value in reversed(values.items())],
        )
    assert len(queries) == 1
    assert queries[0]["sql"].count("::jsonb") == 4  # two documents, two 'null's
    for entry in AuditEntry.objects.filter(pk__in=values):
        assert (entry.actor, entry.after) == (f"actor-{entry.pk}", [entry.pk])
        assert entry.before == values[entry.pk]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT jsonb_typeof(before), before IS NULL FROM teams_auditentry"
            " WHERE id = ANY(%s) ORDER BY id",
            [[entries[3].pk, entries[7].pk]],
        )
        assert cursor.fetchall() == [("string", False), (None, True)]
