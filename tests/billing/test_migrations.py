"""Migrating `billing_sample` keeps its rows and gives the columns and indexes the writes need."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from billing.ingest import ingest, validate_samples
from billing.models import Sample
from tests.factories import DeviceFactory

BEFORE = [("billing", "0001_initial")]
AFTER = [("billing", "0003_sample_gap_usage_cheaper_writes")]
T0 = datetime(2025, 3, 1, 10, 0, tzinfo=UTC)


@pytest.fixture
def migrated_back() -> Iterator[MigrationExecutor]:
    """The database with billing at 0001 (the test migrates it forward); at the latest after."""
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    try:
        yield executor
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_samples_survive_the_migration(migrated_back: MigrationExecutor) -> None:
    old_apps = migrated_back.loader.project_state(BEFORE).apps
    OldSample = old_apps.get_model("billing", "Sample")
    old_rows = [("GPU-b", 2, 10.0), ("GPU-a", 1, None), ("GPU-B", 3, 99.5), ("GPU-b", 9, 5.0)]
    for uuid, ts_ms, util in old_rows:
        OldSample.objects.create(
            device_uuid=uuid, ts_ms=ts_ms, gpu_util=util, node="n1", received_at=T0
        )

    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)

    assert list(
        Sample.objects.order_by("device_uuid", "ts_ms").values_list(
            "device_uuid", "ts_ms", "gap_ms"
        )
    ) == [
        ("GPU-B", 3, None),  # byte order: upper case first
        ("GPU-a", 1, None),
        ("GPU-b", 2, 7),  # the time to the device's next sample, filled in
        ("GPU-b", 9, None),
    ]
    assert Sample.objects.get(device_uuid="GPU-B").gpu_util == 99.5
    # Still unique by device and instant: a sample sent again is a duplicate.
    DeviceFactory.create(uuid="GPU-b")
    rows, _ = validate_samples(
        [
            {"uuid": "GPU-b", "ts": "1970-01-01T00:00:00.002Z"},
            {"uuid": "GPU-b", "ts": T0.isoformat()},
        ]
    )
    report = ingest(node="n1", samples=rows, received_at=T0)
    assert (report.accepted, report.duplicates) == (1, 1)
    # The newest migrated sample now reaches the new one.
    t0_ms = int(T0.timestamp() * 1000)
    assert Sample.objects.get(device_uuid="GPU-b", ts_ms=9).gap_ms == t0_ms - 9


@pytest.mark.postgres
@pytest.mark.django_db
def test_on_postgresql_uuids_compare_bytewise_and_indexes_suit_the_writes() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT collation_name FROM information_schema.columns "
            "WHERE table_name = 'billing_sample' AND column_name = 'device_uuid'"
        )
        assert cursor.fetchone() == ("C",)
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'billing_sample'"
        )
        indexes = dict(cursor.fetchall())
    assert "USING brin (ts_ms)" in indexes["sample_ts"]
    assert "autosummarize='on'" in indexes["sample_ts"]
    assert "UNIQUE" in indexes["sample_unique"]
    assert "(device_uuid, ts_ms) INCLUDE (gpu_util)" in indexes["sample_unique"]
