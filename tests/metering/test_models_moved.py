"""The metering models moved from billing to the metering app with their tables (issue 37):
a database migrated before the move keeps its rows, now the metering models', and the moved
models' content types, with the permissions that hang on them, follow them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from metering.models import Sample, UsageHour

BILLING_BEFORE = ("billing", "0017_ledger_bill_shock")
BEFORE = [BILLING_BEFORE, ("metering", None)]
RECEIVED = datetime(2026, 12, 1, 12, tzinfo=UTC)


def _migrate(targets: list[tuple[str, str | None]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()  # what was applied, read again
    return executor


@pytest.mark.django_db(transaction=True)
def test_a_sample_stored_before_the_move_is_a_metering_sample_after_it() -> None:
    permission = Permission.objects.get(codename="view_sample")
    executor = _migrate(BEFORE)
    try:
        old = executor.loader.project_state([BILLING_BEFORE]).apps
        assert "metering" not in old.all_models
        old_sample = old.get_model("billing", "Sample")
        assert old_sample._meta.db_table == "billing_sample"
        stored = old_sample.objects.create(
            device_uuid="GPU-moved", ts_ms=1_764_590_400_000, gpu_util=42.5, received_at=RECEIVED
        )
        content_type = ContentType.objects.filter(pk=permission.content_type_id)
        assert list(content_type.values_list("app_label", "model")) == [("billing", "sample")]
    finally:
        executor = _migrate(executor.loader.graph.leaf_nodes())
    ContentType.objects.clear_cache()
    sample = Sample.objects.get(pk=stored.pk)
    assert (sample.device_uuid, sample.ts_ms, sample.gpu_util) == (
        "GPU-moved",
        1_764_590_400_000,
        42.5,
    )
    # The same content type row, renamed: the permission on it is metering's now.
    moved = Permission.objects.select_related("content_type").get(pk=permission.pk)
    assert (moved.content_type.app_label, moved.content_type.model) == ("metering", "sample")
    assert ContentType.objects.get_for_model(Sample).pk == permission.content_type_id
    assert not ContentType.objects.filter(app_label="billing", model="sample").exists()


@pytest.mark.django_db
def test_the_moved_models_keep_their_tables() -> None:
    assert Sample._meta.app_label == UsageHour._meta.app_label == "metering"
    assert {Sample._meta.db_table, UsageHour._meta.db_table} == {
        "billing_sample",
        "billing_usagehour",
    }


@pytest.mark.django_db
def test_no_migration_is_missing() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)
