"""A large import analyses the tables the sync looks rows up in, in its own transaction (their
statistics count its rows); a small one leaves that to autovacuum."""

from __future__ import annotations

import pytest
from django.db import connection

from inventory import services
from inventory.models import Device
from tests.inventory.test_import import T0, gpu, slice_

pytestmark = pytest.mark.django_db


def _device_reltuples() -> float:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [Device._meta.db_table]
        )
        return float(cursor.fetchone()[0])


def _import(nodes: int) -> None:
    objects = [
        slice_(
            f"node-{n}-gpu",
            [gpu(f"gpu-{i}", f"GPU-{n}-{i}") for i in range(4)],
            pool=f"node-{n}",
            node=f"node-{n}",
        )
        for n in range(nodes)
    ]
    report = services.import_snapshot(cluster=services.get_cluster("test"), objects=objects, at=T0)
    assert not report.errors


def test_a_large_import_analyses_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "ANALYZE_AFTER_OBJECTS", 10)
    _import(12)
    assert Device.objects.count() == 48
    assert _device_reltuples() == 48  # ANALYZE counted the import's own rows


def test_a_small_import_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "ANALYZE_AFTER_OBJECTS", 1000)
    # (ANALYZE writes reltuples in place: what an earlier test's left survives its rollback.)
    before = _device_reltuples()
    _import(11)
    assert Device.objects.count() == 44
    assert _device_reltuples() == before
